"""Contract rules from `(tandem.common.v1.field)` options, checked on real request messages."""

from __future__ import annotations

from tandem.inference.v1 import generation_pb2
from tandem.scheduler.v1 import job_spec_pb2, scheduler_service_pb2
from tandem.vault.v1 import vault_service_pb2

from mesh.validation import violations


def fields(message: object) -> dict[str, str]:
    return {v.field: v.description for v in violations(message)}  # type: ignore[arg-type]


def test_valid_request_has_no_violations() -> None:
    request = vault_service_pb2.PutSecretRequest(
        parent="orgs/acme", secret_id="env-key", key_id="k1", ciphertext=b"x" * 80
    )
    assert violations(request) == []


def test_required_pattern_and_length() -> None:
    request = vault_service_pb2.PutSecretRequest(
        parent="orgs/Bad Org", secret_id="", key_id="k1", ciphertext=b"x" * 80
    )
    found = fields(request)
    assert "must match" in found["parent"]
    assert found["secret_id"] == "is required"


def test_bytes_length_limits() -> None:
    small = vault_service_pb2.PutSecretRequest(
        parent="orgs/acme", secret_id="a", key_id="k1", ciphertext=b"x"
    )
    big = vault_service_pb2.PutSecretRequest(
        parent="orgs/acme", secret_id="a", key_id="k1", ciphertext=b"x" * 9000
    )
    assert "at least" in fields(small)["ciphertext"]
    assert "at most" in fields(big)["ciphertext"]


def test_numeric_range_on_page_size() -> None:
    request = vault_service_pb2.ListSecretsRequest(parent="orgs/acme", page_size=5000)
    assert "<=" in fields(request)["page_size"]


def test_repeated_elements_and_counts_are_checked() -> None:
    names = ["orgs/acme/secrets/env-key", "orgs/acme/secrets/Not OK"]
    request = vault_service_pb2.OpenSecretsRequest(secrets=names, recipient_public_key=b"k" * 32)
    found = fields(request)
    assert any(path.startswith("secrets[1]") for path in found)
    assert not any(path.startswith("secrets[0]") for path in found)
    crowded = vault_service_pb2.OpenSecretsRequest(
        secrets=[f"orgs/acme/secrets/s{i}" for i in range(200)], recipient_public_key=b"k" * 32
    )
    assert "at most" in fields(crowded)["secrets"]


def test_nested_messages_report_full_paths() -> None:
    spec = job_spec_pb2.JobSpec(tasks=[job_spec_pb2.TaskSpec(name="Bad Name!")])
    request = scheduler_service_pb2.CreateJobRequest(parent="orgs/acme", spec=spec)
    found = fields(request)
    assert any(path.startswith("spec.tasks[0].name") for path in found), found


def test_an_unset_optional_field_is_not_checked_and_a_set_one_is() -> None:
    assert violations(generation_pb2.SamplingParams(max_tokens=3)) == []
    found = violations(generation_pb2.SamplingParams(top_p=0.0, temperature=2.5))
    assert sorted(v.field for v in found) == ["temperature", "top_p"]

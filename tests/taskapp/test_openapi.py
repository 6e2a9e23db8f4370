"""The published contract, docs/taskapp-openapi.yaml, is well-formed OpenAPI 3.1 and matches the SDK."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator
from tandem.taskapp.v1 import rollout_pb2

from tandem_taskapp import schema
from tests.taskapp.conftest import REPO


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    with (REPO / "docs" / "taskapp-openapi.yaml").open() as f:
        loaded: dict[str, Any] = yaml.safe_load(f)
    return loaded


def test_is_openapi_31_with_the_three_endpoints(spec: dict[str, Any]) -> None:
    assert spec["openapi"].startswith("3.1")
    assert set(spec["paths"]) == {"/health", "/task_info", "/rollout"}
    assert "get" in spec["paths"]["/health"]
    assert "get" in spec["paths"]["/task_info"]
    assert "post" in spec["paths"]["/rollout"]
    for status in ("200", "400", "401", "409", "422", "500", "502"):
        assert status in spec["paths"]["/rollout"]["post"]["responses"]


def test_security_schemes(spec: dict[str, Any]) -> None:
    schemes = spec["components"]["securitySchemes"]
    assert schemes["apiKeyHeader"] == {
        **schemes["apiKeyHeader"],
        "type": "apiKey",
        "in": "header",
        "name": "X-API-Key",
    }
    assert schemes["bearerAuth"]["type"] == "http"
    assert schemes["bearerAuth"]["scheme"] == "bearer"
    assert {"apiKeyHeader": []} in spec["security"]
    assert {} in spec["paths"]["/health"]["get"]["security"]  # /health may answer without a key


def test_every_schema_is_valid_json_schema(spec: dict[str, Any]) -> None:
    for s in spec["components"]["schemas"].values():
        Draft202012Validator.check_schema(s)


def test_field_names_and_enums(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    assert schemas["RolloutMode"]["enum"] == ["rl", "eval"]
    assert schemas["RolloutRequest"]["required"] == ["trace_correlation_id", "env", "policy"]
    # The document and the proto the proxy sends from name the same policy fields.
    assert (
        set(schemas["RolloutPolicyConfig"]["properties"])
        == {
            "model",
            "inference_url",
            "temperature",
            "max_completion_tokens",
            "top_p",
            "top_k",
            "min_p",
            "seed",
        }
        == set(rollout_pb2.RolloutPolicyConfig.DESCRIPTOR.fields_by_name)
    )
    assert set(schemas["RolloutResponse"]["required"]) == {
        "trace_correlation_id",
        "metrics",
        "trajectory",
        "aborted",
    }
    assert schemas["Error"]["properties"]["error"]["required"] == ["code", "message"]


def test_sdk_validators_use_the_document() -> None:
    good = {
        "trace_correlation_id": "job-1:ep.2",
        "env": {"seed": "18446744073709551615"},
        "policy": {"config": {"model": "m", "inference_url": "http://127.0.0.1:9/v1/traces/job-1"}},
    }
    assert schema.errors("RolloutRequest", good) == []
    assert schema.errors("RolloutRequest", {**good, "mode": "RL"})
    assert schema.errors("RolloutRequest", {**good, "trace_correlation_id": "has space"})
    assert schema.errors("Error", {"error": {"code": "UNAUTHENTICATED", "message": "no"}}) == []
    assert schema.errors("Error", {"detail": "no"})
    response = {
        "trace_correlation_id": "x",
        "metrics": {"outcome_reward": 1.0, "event_rewards": [], "details": {}},
        "trajectory": {"turns": [{"messages": [{"role": "user", "content": "hi"}]}]},
        "aborted": False,
    }
    assert schema.errors("RolloutResponse", response) == []
    assert schema.errors("RolloutResponse", {**response, "metrics": {}})


@pytest.mark.parametrize(
    ("name", "instance"),
    [
        ("RolloutRequest", {"trace_correlation_id": "has space", "env": {"seed": -1}, "policy": {}}),
        ("RolloutRequest", {"trace_correlation_id": "ok", "env": {"seed": "x"}, "mode": "RL", "limits": 3}),
        ("RolloutResponse", {"trace_correlation_id": "ok", "metrics": {"outcome_reward": "1"}}),
        (
            "RolloutResponse",
            {
                "trace_correlation_id": "ok",
                "metrics": {"outcome_reward": 1.0},
                "trajectory": {"turns": [{"messages": [{"role": 1}]}]},
                "aborted": "no",
            },
        ),
        ("TaskInfo", {"task": {"id": 3}, "seed": -2}),
    ],
)
def test_inlined_schemas_report_what_the_referencing_ones_do(name: str, instance: Any) -> None:
    """The validators inline the components' `$ref`s for speed; the violations must not change."""
    from referencing import Registry, Resource  # noqa: PLC0415
    from referencing.jsonschema import DRAFT202012  # noqa: PLC0415

    resource: Resource[Any] = Resource.from_contents(schema.openapi_spec(), default_specification=DRAFT202012)
    referencing = Draft202012Validator(
        {"$ref": f"{schema.SPEC_URI}#/components/schemas/{name}"},
        registry=Registry().with_resource(schema.SPEC_URI, resource),
    )
    assert "$ref" not in json.dumps(schema.validator(name).schema)

    def seen(validator: Draft202012Validator) -> list[tuple[str, str]]:
        return sorted((e.json_path, e.message) for e in validator.iter_errors(instance))

    assert seen(schema.validator(name)) == seen(referencing)
    assert seen(referencing)

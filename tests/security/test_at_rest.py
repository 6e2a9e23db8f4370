"""No credential at rest: after a mesh has served two organizations through the gateway (API keys made, a secret
uploaded sealed, a Task App registered and checked with it, a job that declares the secret run to its end,
with its job token used), every file the mesh left behind (databases and their WAL files, the trace file,
the jobs' folders and logs) and every log record it wrote is searched for each credential: the secret's
plaintext, the organizations' API keys, the job's token, the mesh signing key and the vault master key. Only
the key files themselves, owner-only, may hold a key, each its own."""

from __future__ import annotations

import hashlib
import logging
import stat
from pathlib import Path

import pytest
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.gateway.v1 import gateway_service_pb2_grpc
from tandem.scheduler.v1 import job_spec_pb2
from tandem.taskapp.v1 import task_app_pb2

from gateway.orgs import ADMIN_KEY_FILE
from mesh.clients import open_channel
from mesh.observability import flush_tracing, trace_file_in_use
from tests.gateway.test_gateway import put, wait_terminal
from tests.support.mesh import mesh_settings, running_mesh
from tests.support.taskapps import example_app_in_thread

SECRET = "env-key-value-0123456789-at-rest"
DIGEST = hashlib.sha256(SECRET.encode()).hexdigest()  # what the job compares its secret with
KEY_FILES = {"mesh.key", "vault-master.key", ADMIN_KEY_FILE}  # each holds its own key, mode 0600


def forms(credential: str) -> list[bytes]:
    """The ways a credential could sit in a file: whole, its first 16 characters, and hex-encoded."""
    raw = credential.encode()
    return [raw, raw[:16], raw.hex().encode()[:32]]


def left_behind(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` but the key files, by relative path."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and p.name not in KEY_FILES
    }


async def test_no_credential_in_any_state_log_or_trace_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CPUS", "4")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__MEMORY_GIB", "8")
    state = tmp_path / "state"
    token_file = tmp_path / "job-token"
    credentials: dict[str, str] = {"the secret's plaintext": SECRET}
    async with running_mesh(mesh_settings(state)) as mesh:
        admin_key = (state / ADMIN_KEY_FILE).read_text().strip()
        credentials["the admin key"] = admin_key
        async with open_channel(mesh.address("gateway"), mesh.settings, token=admin_key) as channel:
            admin = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            acme = (await admin.CreateOrg(pb.CreateOrgRequest(org_id="acme"))).key
            credentials["globex's key"] = (await admin.CreateOrg(pb.CreateOrgRequest(org_id="globex"))).key
        credentials["acme's first key"] = acme
        async with open_channel(mesh.address("gateway"), mesh.settings, token=acme) as channel:
            user = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            made = await user.CreateApiKey(pb.CreateApiKeyRequest(parent="orgs/acme", display_name="ci"))
            credentials["acme's second key"] = made.key
            await put(user, "orgs/acme", "env-key", SECRET.encode())
            with example_app_in_thread(SECRET) as url:  # the proxy opens the secret to call the app
                await user.RegisterTaskApp(
                    pb.RegisterTaskAppRequest(
                        parent="orgs/acme",
                        task_app_id="app",
                        task_app=task_app_pb2.TaskApp(base_url=url, secret_name="orgs/acme/secrets/env-key"),
                    )
                )
                checked = await user.CheckTaskApp(pb.CheckTaskAppRequest(name="orgs/acme/taskApps/app"))
                assert checked.all_passed
            task = job_spec_pb2.TaskSpec(  # uses its secret and hands its token out, printing neither
                name="main",
                kind=job_spec_pb2.TaskSpec.KIND_COMMAND,
                run=(
                    f'test "$(printf %s "$APP_KEY" | sha256sum | cut -c1-64)" = {DIGEST}'
                    f' && printf %s "$TANDEM_JOB_TOKEN" > {token_file}'
                ),
                secrets=[job_spec_pb2.SecretBinding(secret="env-key", env="APP_KEY")],
            )
            job = await user.CreateJob(
                pb.CreateJobRequest(
                    parent="orgs/acme", job_id="uses-it", spec=job_spec_pb2.JobSpec(tasks=[task])
                )
            )
            done = await wait_terminal(user, job.job.name)
            assert done.state == done.STATE_SUCCEEDED, done
    credentials["the job's token"] = token_file.read_text()
    credentials["the mesh key"] = (state / "mesh.key").read_text().strip()
    credentials["the vault master key"] = (state / "vault-master.key").read_text().strip()
    token_file.unlink()

    flush_tracing()
    texts = left_behind(tmp_path)
    assert any(name.endswith(".db") for name in texts)
    spans = trace_file_in_use()  # one per process: the first mesh's of the session, maybe another test's
    assert spans is not None and spans.stat().st_size > 0
    texts["the span file"] = spans.read_bytes()
    texts["log records"] = caplog.text.encode()
    found = [
        f"{what} in {where}"
        for what, credential in credentials.items()
        for where, text in texts.items()
        if any(form in text for form in forms(credential))
    ]
    assert not found, found
    for name in KEY_FILES:
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name

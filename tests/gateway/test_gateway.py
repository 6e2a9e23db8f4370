"""The gateway in a real in-process mesh: organizations and API keys (stored hashed, shown once), the admin
bootstrap, every forwarded family scoped to the caller's organization, the error model at the public edge
(wrong and revoked keys, other organizations' resources, malformed and oversized requests, rate limits),
online-RL jobs from a trainer config, checkpoints and Infer."""

from __future__ import annotations

import asyncio
import io
import re
import sqlite3
import stat
import tempfile
import time
import tomllib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from google.protobuf import duration_pb2, json_format
from tandem.events.v1 import event_pb2, events_service_pb2, events_service_pb2_grpc, metric_pb2
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.gateway.v1 import gateway_service_pb2_grpc, org_pb2
from tandem.scheduler.v1 import job_pb2, job_spec_pb2
from tandem.taskapp.v1 import task_app_pb2

from gateway import inference
from gateway import orgs as orgs_module
from gateway.orgs import ADMIN_KEY_FILE, Orgs
from gateway.store import MIGRATIONS
from mesh.clients import open_channel
from mesh.errors import AlreadyExists, Unauthenticated
from mesh.identity import TokenSigner, load_signing_key
from mesh.launcher import print_addresses
from mesh.secrets import seal_for_upload
from mesh.status import RpcError
from mesh.store import open_database
from services.scheduler.spec import load_yaml
from tandem_jobs.config import parse_job
from tests.support.mesh import Mesh, mesh_settings, running_mesh
from tests.support.taskapps import example_app_in_thread

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
APP_KEY = "env-key-value-0123456789"


@dataclass
class World:
    mesh: Mesh
    admin: gateway_service_pb2_grpc.GatewayServiceStub
    acme: gateway_service_pb2_grpc.GatewayServiceStub
    globex: gateway_service_pb2_grpc.GatewayServiceStub
    acme_key: str
    channels: list[grpc.aio.Channel]

    def stub(self, key: str) -> gateway_service_pb2_grpc.GatewayServiceStub:
        channel = open_channel(self.mesh.address("gateway"), self.mesh.settings, token=key)
        self.channels.append(channel)
        return gateway_service_pb2_grpc.GatewayServiceStub(channel)


@pytest.fixture
async def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[World]:
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CPUS", "4")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__MEMORY_GIB", "8")
    monkeypatch.setenv("TANDEM_SCHEDULER_CANCEL_GRACE_S", "2")
    async with running_mesh(mesh_settings(tmp_path)) as mesh:
        admin_key = (tmp_path / ADMIN_KEY_FILE).read_text().strip()
        w = World(mesh, None, None, None, "", [])  # type: ignore[arg-type]
        w.admin = w.stub(admin_key)
        made = await w.admin.CreateOrg(pb.CreateOrgRequest(org_id="acme", display_name="Acme"))
        other = await w.admin.CreateOrg(pb.CreateOrgRequest(org_id="globex"))
        w.acme_key = made.key
        w.acme = w.stub(made.key)
        w.globex = w.stub(other.key)
        yield w
        for channel in w.channels:
            await channel.close()


async def fails(call: object, code: grpc.StatusCode, reason: str) -> RpcError:
    with pytest.raises(RpcError) as caught:
        await call  # type: ignore[misc]
    assert (caught.value.code, caught.value.reason) == (code, reason), caught.value
    return caught.value


# ---- organizations, keys, bootstrap -----------------------------------------------------------------


async def test_the_admin_credential_is_written_once_with_owner_only_permissions(world: World) -> None:
    path = world.mesh.settings.state_dir / ADMIN_KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().startswith("tdm_admin_")


async def test_create_org_returns_a_key_once_and_stores_only_its_hash(world: World) -> None:
    org = (await world.acme.GetOrg(pb.GetOrgRequest())).org
    assert (org.name, org.display_name) == ("orgs/acme", "Acme")
    assert re.fullmatch(r"tdm_[0-9a-f]{12}_[A-Za-z0-9_-]{43}", world.acme_key)
    created = await world.acme.CreateApiKey(pb.CreateApiKeyRequest(parent="orgs/acme", display_name="ci"))
    assert created.key.startswith(created.api_key.key_prefix) and len(created.api_key.key_prefix) == 12
    assert created.api_key.creator.startswith("orgs/acme/apiKeys/")
    assert created.api_key.state == org_pb2.ApiKey.STATE_ACTIVE
    listed = await world.acme.ListApiKeys(pb.ListApiKeysRequest(parent="orgs/acme"))
    assert listed.api_keys[0].name == created.api_key.name  # newest first
    assert len(listed.api_keys) == 2 and all(not k.key_prefix.endswith("_") for k in listed.api_keys)
    database = world.mesh.settings.state_dir / "gateway.db"
    with sqlite3.connect(database) as conn:
        rows = conn.execute("SELECT * FROM gateway_api_keys").fetchall()
        dumped = repr(rows) + repr(conn.execute("SELECT * FROM gateway_requests").fetchall())
    assert len(rows) == 3 and created.key not in dumped and world.acme_key not in dumped
    assert created.key.split("_", 2)[2] not in dumped


async def test_create_org_needs_the_admin_credential(world: World) -> None:
    await fails(
        world.acme.CreateOrg(pb.CreateOrgRequest(org_id="evil")),
        grpc.StatusCode.PERMISSION_DENIED,
        "PERMISSION_DENIED",
    )
    await fails(
        world.admin.CreateOrg(pb.CreateOrgRequest(org_id="acme")),
        grpc.StatusCode.ALREADY_EXISTS,
        "ALREADY_EXISTS",
    )


async def test_a_retried_create_org_answers_without_the_key(world: World) -> None:
    first = await world.admin.CreateOrg(pb.CreateOrgRequest(org_id="initech", request_id="r-1"))
    again = await world.admin.CreateOrg(pb.CreateOrgRequest(org_id="initech", request_id="r-1"))
    assert first.key and not again.key and again.api_key.name == first.api_key.name
    await fails(
        world.admin.CreateOrg(pb.CreateOrgRequest(org_id="other", request_id="r-1")),
        grpc.StatusCode.ALREADY_EXISTS,
        "REQUEST_ID_REUSED",
    )


async def test_wrong_and_revoked_keys_are_unauthenticated(world: World) -> None:
    wrong = world.acme_key[:-4] + ("AAAA" if not world.acme_key.endswith("AAAA") else "BBBB")
    await fails(
        world.stub(wrong).GetOrg(pb.GetOrgRequest()), grpc.StatusCode.UNAUTHENTICATED, "INVALID_CREDENTIALS"
    )
    await fails(
        world.stub("tdm_nonsense").GetOrg(pb.GetOrgRequest()),
        grpc.StatusCode.UNAUTHENTICATED,
        "INVALID_CREDENTIALS",
    )
    created = await world.acme.CreateApiKey(pb.CreateApiKeyRequest(parent="orgs/acme"))
    doomed = world.stub(created.key)
    assert (await doomed.GetOrg(pb.GetOrgRequest())).org.name == "orgs/acme"
    revoked = await world.acme.RevokeApiKey(pb.RevokeApiKeyRequest(name=created.api_key.name))
    assert revoked.api_key.state == org_pb2.ApiKey.STATE_REVOKED
    await fails(doomed.GetOrg(pb.GetOrgRequest()), grpc.StatusCode.UNAUTHENTICATED, "INVALID_CREDENTIALS")
    again = await world.acme.RevokeApiKey(pb.RevokeApiKeyRequest(name=created.api_key.name))
    assert again.api_key.revoke_time == revoked.api_key.revoke_time
    active = await world.acme.ListApiKeys(pb.ListApiKeysRequest(parent="orgs/acme"))
    assert created.api_key.name not in [k.name for k in active.api_keys]
    every = await world.acme.ListApiKeys(pb.ListApiKeysRequest(parent="orgs/acme", show_inactive=True))
    assert created.api_key.name in [k.name for k in every.api_keys]
    await fails(
        world.stub("").GetOrg(pb.GetOrgRequest()), grpc.StatusCode.UNAUTHENTICATED, "MISSING_CREDENTIALS"
    )


async def test_another_orgs_keys_read_as_absent(world: World) -> None:
    theirs = (await world.globex.ListApiKeys(pb.ListApiKeysRequest(parent="orgs/globex"))).api_keys[0]
    await fails(
        world.acme.RevokeApiKey(pb.RevokeApiKeyRequest(name=theirs.name)),
        grpc.StatusCode.NOT_FOUND,
        "ORG_NOT_FOUND",
    )
    await fails(
        world.acme.ListApiKeys(pb.ListApiKeysRequest(parent="orgs/globex")),
        grpc.StatusCode.NOT_FOUND,
        "ORG_NOT_FOUND",
    )
    await fails(
        world.acme.GetOrg(pb.GetOrgRequest(name="orgs/globex")), grpc.StatusCode.NOT_FOUND, "ORG_NOT_FOUND"
    )


async def test_a_key_ttl_outside_its_range_is_refused(world: World) -> None:
    error = await fails(
        world.acme.CreateApiKey(
            pb.CreateApiKeyRequest(parent="orgs/acme", ttl=duration_pb2.Duration(seconds=5))
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
    )
    assert [v.field for v in error.violations] == ["ttl"]


# ---- the public edge ----------------------------------------------------------------------------


async def test_malformed_and_oversized_requests(world: World) -> None:
    channel = open_channel(world.mesh.address("gateway"), world.mesh.settings, token=world.acme_key)
    world.channels.append(channel)
    raw = channel.unary_unary("/tandem.gateway.v1.GatewayService/GetOrg")
    await fails(raw(b"\xff\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST")
    limit = world.mesh.settings.max_message_bytes
    error = await fails(
        world.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", rl_config_toml="#" * (limit + 10))),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "MESSAGE_TOO_LARGE",
    )
    assert error.metadata["limit_bytes"] == str(limit)
    bad = await fails(
        world.acme.GetJob(pb.GetJobRequest(name="jobs/x")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
    )
    assert [v.field for v in bad.violations] == ["name"]


async def test_get_server_info_stays_public(world: World) -> None:
    info = (await world.stub("").GetServerInfo(pb.GetServerInfoRequest())).server_info
    assert info.all_serving and info.services[0].component == "gateway"


# ---- secrets ------------------------------------------------------------------------------------


async def put(stub: gateway_service_pb2_grpc.GatewayServiceStub, org: str, secret: str, value: bytes) -> None:
    key = (await stub.GetPublicKey(pb.GetPublicKeyRequest(parent=org))).key
    assert key.state == key.STATE_ACTIVE and key.name == f"{org}/keys/{key.key_id}"
    await stub.PutSecret(
        pb.PutSecretRequest(
            parent=org, secret_id=secret, key_id=key.key_id, ciphertext=seal_for_upload(key.public_key, value)
        )
    )


async def test_secrets_are_forwarded_and_scoped(world: World) -> None:
    await put(world.acme, "orgs/acme", "env-key", APP_KEY.encode())
    listed = await world.acme.ListSecrets(pb.ListSecretsRequest(parent="orgs/acme"))
    assert [s.name for s in listed.secrets] == ["orgs/acme/secrets/env-key"]
    await fails(
        world.globex.ListSecrets(pb.ListSecretsRequest(parent="orgs/acme")),
        grpc.StatusCode.NOT_FOUND,
        "ORG_NOT_FOUND",
    )
    await fails(
        world.globex.DeleteSecret(pb.DeleteSecretRequest(name="orgs/acme/secrets/env-key")),
        grpc.StatusCode.NOT_FOUND,
        "SECRET_NOT_FOUND",
    )
    await fails(  # the vault's own reason, passed through
        world.acme.DeleteSecret(pb.DeleteSecretRequest(name="orgs/acme/secrets/nope")),
        grpc.StatusCode.NOT_FOUND,
        "SECRET_NOT_FOUND",
    )
    await world.acme.DeleteSecret(pb.DeleteSecretRequest(name="orgs/acme/secrets/env-key"))
    assert not (await world.acme.ListSecrets(pb.ListSecretsRequest(parent="orgs/acme"))).secrets


# ---- Task Apps ----------------------------------------------------------------------------------


async def register(world: World, url: str, app_id: str = "fake") -> None:
    await put(world.acme, "orgs/acme", "env-key", APP_KEY.encode())
    await world.acme.RegisterTaskApp(
        pb.RegisterTaskAppRequest(
            parent="orgs/acme",
            task_app_id=app_id,
            task_app=task_app_pb2.TaskApp(base_url=url, secret_name="orgs/acme/secrets/env-key"),
        )
    )


async def test_task_apps_are_forwarded_and_scoped(world: World) -> None:
    with example_app_in_thread(APP_KEY) as url:
        await register(world, url)
        name = "orgs/acme/taskApps/fake"
        checked = await world.acme.CheckTaskApp(pb.CheckTaskAppRequest(name=name))
        assert checked.all_passed and checked.check_results
        assert (await world.acme.GetTaskApp(pb.GetTaskAppRequest(name=name))).task_app.name == name
        listed = await world.acme.ListTaskApps(pb.ListTaskAppsRequest(parent="orgs/acme"))
        assert [a.name for a in listed.task_apps] == [name]
        for call in (
            world.globex.GetTaskApp(pb.GetTaskAppRequest(name=name)),
            world.globex.CheckTaskApp(pb.CheckTaskAppRequest(name=name)),
            world.globex.DeleteTaskApp(pb.DeleteTaskAppRequest(name=name)),
        ):
            await fails(call, grpc.StatusCode.NOT_FOUND, "TASK_APP_NOT_FOUND")
        await world.acme.DeleteTaskApp(pb.DeleteTaskAppRequest(name=name))
        await fails(
            world.acme.GetTaskApp(pb.GetTaskAppRequest(name=name)),
            grpc.StatusCode.NOT_FOUND,
            "TASK_APP_NOT_FOUND",
        )


# ---- jobs, logs, events -------------------------------------------------------------------------


def echo_task() -> job_spec_pb2.TaskSpec:
    return job_spec_pb2.TaskSpec(
        name="main", kind=job_spec_pb2.TaskSpec.KIND_COMMAND, run="echo hello-gateway"
    )


async def wait_terminal(
    stub: gateway_service_pb2_grpc.GatewayServiceStub, name: str, timeout_s: float = 60
) -> job_pb2.Job:
    deadline = time.monotonic() + timeout_s
    while True:
        job = (await stub.GetJob(pb.GetJobRequest(name=name))).job
        if job.state in (job.STATE_SUCCEEDED, job.STATE_FAILED, job.STATE_CANCELLED):
            return job
        assert time.monotonic() < deadline, job
        await asyncio.sleep(0.2)


async def test_jobs_logs_and_events_are_forwarded_and_scoped(world: World) -> None:
    spec = job_spec_pb2.JobSpec(display_name="echo", tasks=[echo_task()])
    job = (await world.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", job_id="echo", spec=spec))).job
    assert job.name == "orgs/acme/jobs/echo"
    done = await wait_terminal(world.acme, job.name)
    assert done.state == done.STATE_SUCCEEDED, done
    listed = await world.acme.ListJobs(pb.ListJobsRequest(parent="orgs/acme"))
    assert [j.name for j in listed.jobs] == [job.name]
    logs = b"".join([r.data async for r in world.acme.StreamJobLogs(pb.StreamJobLogsRequest(job=job.name))])
    assert b"hello-gateway" in logs
    events = await world.acme.ListEvents(pb.ListEventsRequest(job=job.name))
    assert events.events and events.last_seq >= len(events.events)
    middle = events.events[0].seq
    seen = []
    async for item in world.acme.SubscribeEvents(
        pb.SubscribeEventsRequest(job=job.name, after_seq=middle, end_when_terminal=True)
    ):
        if item.WhichOneof("kind") == "events":
            seen.extend(e.seq for e in item.events.events)
    # The job's terminal event may be published just after its state is stored, so the stream is compared
    # with a listing taken once the stream has ended on that event.
    after = await world.acme.ListEvents(pb.ListEventsRequest(job=job.name))
    assert [e.seq for e in after.events][: len(events.events)] == [e.seq for e in events.events]
    assert seen == [e.seq for e in after.events if e.seq > middle]
    assert not (await world.acme.ListMetrics(pb.ListMetricsRequest(job=job.name))).series
    assert not (await world.acme.ListCheckpoints(pb.ListCheckpointsRequest(parent=job.name))).checkpoints
    for call in (
        world.globex.GetJob(pb.GetJobRequest(name=job.name)),
        world.globex.CancelJob(pb.CancelJobRequest(name=job.name)),
        world.globex.ListEvents(pb.ListEventsRequest(job=job.name)),
        world.globex.ListCheckpoints(pb.ListCheckpointsRequest(parent=job.name)),
    ):
        await fails(call, grpc.StatusCode.NOT_FOUND, "JOB_NOT_FOUND")
    with pytest.raises(RpcError) as caught:
        async for _ in world.globex.SubscribeEvents(pb.SubscribeEventsRequest(job=job.name)):
            pass
    assert caught.value.reason == "JOB_NOT_FOUND"
    await fails(  # the scheduler's own answer, passed through
        world.acme.CancelJob(pb.CancelJobRequest(name=job.name)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "JOB_STATE_CONFLICT",
    )
    sleeper = job_spec_pb2.TaskSpec(name="main", kind=job_spec_pb2.TaskSpec.KIND_COMMAND, run="sleep 60")
    long = (
        await world.acme.CreateJob(
            pb.CreateJobRequest(
                parent="orgs/acme", spec=job_spec_pb2.JobSpec(display_name="long", tasks=[sleeper])
            )
        )
    ).job
    cancelled = (await world.acme.CancelJob(pb.CancelJobRequest(name=long.name, reason="test"))).job
    assert cancelled.state in (cancelled.STATE_CANCELLING, cancelled.STATE_CANCELLED)
    assert (await wait_terminal(world.acme, long.name)).state == cancelled.STATE_CANCELLED


# ---- online RL ----------------------------------------------------------------------------------


def demo_toml(app: str = "orgs/acme/taskApps/fake") -> str:
    text = (ROOT / "examples" / "jobs" / "demo.toml").read_text()
    return text.replace('name = "orgs/demo/taskApps/single-turn"', f'name = "{app}"')


async def test_create_rl_job_names_the_bad_config_field(world: World) -> None:
    bad = demo_toml().replace("[optimizer]", "[optimizer]\nwarmup_steps = 1000")
    error = await fails(
        world.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", rl_config_toml=bad)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_CONFIG",
    )
    assert [v.field for v in error.violations] == ["rl_config_toml.optimizer.warmup_steps"]
    unknown = demo_toml().replace("[optimizer]", "[optimizer]\nmomentum_typo = 1")
    error = await fails(
        world.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", rl_config_toml=unknown)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_CONFIG",
    )
    assert "momentum_typo" in error.message
    await fails(
        world.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", rl_config_toml="[[[")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_CONFIG",
    )


async def test_create_rl_job_refuses_a_task_app_failing_its_checks(world: World) -> None:
    with example_app_in_thread(APP_KEY) as url:
        await register(world, url)
    # The app is gone now: its checks fail.
    error = await fails(
        world.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", rl_config_toml=demo_toml())),
        grpc.StatusCode.FAILED_PRECONDITION,
        "TASK_APP_CHECK_FAILED",
    )
    assert error.metadata["failed_checks"] and error.metadata["task_app"] == "orgs/acme/taskApps/fake"
    assert error.violations and all(v.field == "rl_config_toml.task_app.name" for v in error.violations)
    task = job_spec_pb2.TaskSpec(
        name="trainer",
        kind=job_spec_pb2.TaskSpec.KIND_ONLINE_RL,
        online_rl=job_spec_pb2.OnlineRlOptions(config_toml=demo_toml()),
    )
    error = await fails(
        world.acme.CreateJob(
            pb.CreateJobRequest(
                parent="orgs/acme", spec=job_spec_pb2.JobSpec(display_name="rl", tasks=[task])
            )
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "TASK_APP_CHECK_FAILED",
    )
    assert {v.field for v in error.violations} == {"spec.tasks[0].online_rl.config_toml.task_app.name"}
    await fails(  # another organization's app answers as an absent one (tests/security has the comparison)
        world.acme.CreateJob(
            pb.CreateJobRequest(parent="orgs/acme", rl_config_toml=demo_toml("orgs/globex/taskApps/fake"))
        ),
        grpc.StatusCode.NOT_FOUND,
        "TASK_APP_NOT_FOUND",
    )


async def test_create_rl_job_builds_a_one_task_online_rl_group(world: World, tmp_path: Path) -> None:
    with example_app_in_thread(APP_KEY) as url:
        await register(world, url)
        toml = demo_toml().replace('dir = "runs/demo-model"', f'dir = "{tmp_path / "model"}"')
        job = (
            await world.acme.CreateJob(
                pb.CreateJobRequest(parent="orgs/acme", job_id="rl", rl_config_toml=toml, validate_only=True)
            )
        ).job
        assert job.name == "orgs/acme/jobs/rl"
        [task] = job.spec.tasks
        assert task.kind == task.KIND_ONLINE_RL and task.online_rl.config_toml == toml

        config = parse_job(tomllib.loads(toml))
        typed = (
            await world.acme.CreateRlJob(
                pb.CreateRlJobRequest(
                    parent="orgs/acme", config=config, display_name="typed", priority=7, validate_only=True
                )
            )
        ).job
        [task] = typed.spec.tasks
        assert typed.spec.priority == 7 and typed.spec.display_name == "typed"
        assert parse_job(tomllib.loads(task.online_rl.config_toml)) == config


# ---- checkpoints and Infer ----------------------------------------------------------------------


async def test_checkpoints_come_from_the_jobs_events_and_infer_needs_one(world: World) -> None:
    spec = job_spec_pb2.JobSpec(display_name="echo", tasks=[echo_task()])
    job = (await world.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", job_id="ck", spec=spec))).job
    await wait_terminal(world.acme, job.name)
    await fails(
        world.acme.Infer(pb.InferRequest(model=f"{job.name}/checkpoints/step-5", prompt="hi")),
        grpc.StatusCode.NOT_FOUND,
        "CHECKPOINT_NOT_FOUND",
    )
    await fails(
        world.acme.Infer(pb.InferRequest(model=f"{job.name}/checkpoints/latest", prompt="hi")),
        grpc.StatusCode.NOT_FOUND,
        "CHECKPOINT_NOT_FOUND",
    )
    await fails(
        world.acme.Infer(pb.InferRequest(model="orgs/acme/jobs/nope/checkpoints/latest", prompt="hi")),
        grpc.StatusCode.NOT_FOUND,
        "JOB_NOT_FOUND",
    )
    await fails(
        world.globex.Infer(pb.InferRequest(model=f"{job.name}/checkpoints/latest", prompt="hi")),
        grpc.StatusCode.NOT_FOUND,
        "JOB_NOT_FOUND",
    )
    # A trainer announces checkpoints as events (here published with a service token, as the trainer's
    # job token would); ListCheckpoints reads them back newest first with their step's metrics.
    signer = TokenSigner(load_signing_key("", world.mesh.settings.state_dir))
    async with open_channel(
        world.mesh.address("events"), world.mesh.settings, token=signer.issue("service", "trainer")
    ) as channel:
        events = events_service_pb2_grpc.EventServiceStub(channel)
        board = "orgs/acme/jobs/board"
        announced = []
        for step in (2, 4):
            event = event_pb2.Event(type="checkpoint.saved", message=f"step {step}")
            event.checkpoint_saved.checkpoint = f"{board}/checkpoints/step-{step}"
            event.checkpoint_saved.step = step
            event.checkpoint_saved.uri = f"file:///ckpt/step-{step}"
            announced.append(event)
        await events.Publish(events_service_pb2.PublishRequest(job=board, events=announced))
        await events.PublishMetrics(
            events_service_pb2.PublishMetricsRequest(
                job=board, points=[metric_pb2.MetricPoint(name="reward/mean", step=4, value=0.75)]
            )
        )
    found = (await world.acme.ListCheckpoints(pb.ListCheckpointsRequest(parent=board))).checkpoints
    assert [(c.name.rsplit("/", 1)[1], c.step) for c in found] == [("step-4", 4), ("step-2", 2)]
    assert dict(found[0].metrics) == {"reward/mean": 0.75} and found[0].uri == "file:///ckpt/step-4"
    paged = await world.acme.ListCheckpoints(pb.ListCheckpointsRequest(parent=board, page_size=1))
    rest = await world.acme.ListCheckpoints(
        pb.ListCheckpointsRequest(parent=board, page_size=1, page_token=paged.next_page_token)
    )
    assert [c.step for c in [*paged.checkpoints, *rest.checkpoints]] == [4, 2] and not rest.next_page_token


# ---- rate limits --------------------------------------------------------------------------------


async def test_each_org_has_a_token_bucket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_GATEWAY_RATE_BURST", "3")
    monkeypatch.setenv("TANDEM_GATEWAY_RATE_PER_S", "0.5")
    async with running_mesh(mesh_settings(tmp_path)) as mesh:
        admin_key = (tmp_path / ADMIN_KEY_FILE).read_text().strip()
        async with open_channel(mesh.address("gateway"), mesh.settings, token=admin_key) as channel:
            admin = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            acme = (await admin.CreateOrg(pb.CreateOrgRequest(org_id="acme"))).key
            globex = (await admin.CreateOrg(pb.CreateOrgRequest(org_id="globex"))).key
        async with (
            open_channel(mesh.address("gateway"), mesh.settings, token=acme) as a,
            open_channel(mesh.address("gateway"), mesh.settings, token=globex) as g,
        ):
            stub = gateway_service_pb2_grpc.GatewayServiceStub(a)
            for _ in range(3):
                await stub.GetOrg(pb.GetOrgRequest())
            error = await fails(
                stub.GetOrg(pb.GetOrgRequest()), grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED"
            )
            assert error.retry_after_s is not None and 0 < error.retry_after_s <= 2.0
            # Another organization's bucket is its own.
            await gateway_service_pb2_grpc.GatewayServiceStub(g).GetOrg(pb.GetOrgRequest())


async def test_tandem_up_prints_where_the_admin_credential_is(world: World) -> None:
    out = io.StringIO()
    print_addresses(out)(list(world.mesh.services.values()))
    path = (world.mesh.settings.state_dir / ADMIN_KEY_FILE).resolve()
    assert f"Admin credential (for CreateOrg): {path}" in out.getvalue()
    assert path.read_text().strip() not in out.getvalue()
    # This mesh has no HTTP port: the output says how to turn the OpenAI-compatible endpoint on.
    assert "OpenAI-compatible endpoint and dashboard: off (TANDEM_GATEWAY_HTTP_PORT=8080" in out.getvalue()


# ---- the store, on both databases ---------------------------------------------------------------


async def test_orgs_and_keys_on_both_stores(store_url: str) -> None:
    db = await open_database(store_url, "gateway", MIGRATIONS)
    try:
        orgs = Orgs(db, "tdm_admin_secret")
        assert orgs_module.is_admin(await orgs.authenticate("tdm_admin_secret"))
        assert await orgs.authenticate("tdm1-or-anything-else") is None
        org, key, plaintext = await orgs.create_org("acme", "Acme", "admin")
        principal = await orgs.authenticate(plaintext)
        assert principal is not None and (principal.org, principal.subject) == (org.org, key.name)
        with pytest.raises(AlreadyExists):
            await orgs.create_org("acme", "", "admin")
        second, _ = await orgs.create_key("acme", "ci", key.name, ttl_s=3600)
        page, token = await orgs.list_keys("acme", 1, "", show_inactive=False)
        rest, end = await orgs.list_keys("acme", 1, token, show_inactive=False)
        assert [k.key_id for k in [*page, *rest]] == [second.key_id, key.key_id] and not end
        await orgs.revoke_key("acme", key.key_id)
        with pytest.raises(Unauthenticated) as revoked:
            await orgs.authenticate(plaintext)
        assert revoked.value.reason_name == "INVALID_CREDENTIALS"
        expiring, expiring_key = await orgs.create_key("acme", "short", key.name, ttl_s=3600)
        await db.execute(
            "UPDATE gateway_api_keys SET expire_time = ? WHERE key_id = ?", (time.time() - 1, expiring.key_id)
        )
        with pytest.raises(Unauthenticated) as expired:
            await orgs.authenticate(expiring_key)
        assert expired.value.reason_name == "CREDENTIALS_EXPIRED"
        with pytest.raises(Unauthenticated):
            await orgs.authenticate(expiring_key[:-1] + ("A" if expiring_key[-1] != "A" else "B"))
        rows = await db.fetchall("SELECT * FROM gateway_api_keys")
        assert plaintext not in repr(rows) and orgs_module.digest(plaintext) in repr(rows)
    finally:
        await db.close()


# ---- Infer on a real checkpoint (slow: an inference worker starts through the scheduler) --------


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_infer_starts_a_worker_through_the_scheduler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.models import build_tiny_model  # noqa: PLC0415 - torch only in this test

    model = build_tiny_model(tmp_path / "step-3", vocab_size=300, hidden_size=32, layers=1, heads=2)
    monkeypatch.setenv("TANDEM_GATEWAY_HTTP_PORT", "0")
    monkeypatch.setenv("TANDEM_GATEWAY_INFER_IDLE_S", "20")  # longer than any gap between this test's calls
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CPUS", "4")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__MEMORY_GIB", "8")
    async with running_mesh(mesh_settings(tmp_path / "state")) as mesh:
        admin_key = (tmp_path / "state" / ADMIN_KEY_FILE).read_text().strip()
        signer = TokenSigner(load_signing_key("", mesh.settings.state_dir))
        async with (
            open_channel(mesh.address("gateway"), mesh.settings, token=admin_key) as admin_channel,
            open_channel(
                mesh.address("events"), mesh.settings, token=signer.issue("service", "trainer")
            ) as events_channel,
        ):
            made = await gateway_service_pb2_grpc.GatewayServiceStub(admin_channel).CreateOrg(
                pb.CreateOrgRequest(org_id="acme")
            )
            event = event_pb2.Event(type="checkpoint.saved", message="step 3")
            event.checkpoint_saved.checkpoint = "orgs/acme/jobs/rl/checkpoints/step-3"
            event.checkpoint_saved.step = 3
            event.checkpoint_saved.uri = model.as_uri()
            await events_service_pb2_grpc.EventServiceStub(events_channel).Publish(
                events_service_pb2.PublishRequest(job="orgs/acme/jobs/rl", events=[event])
            )
        async with open_channel(mesh.address("gateway"), mesh.settings, token=made.key) as channel:
            stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            request = pb.InferRequest(model="orgs/acme/jobs/rl/checkpoints/latest", prompt="hello")
            request.sampling.max_tokens = 4
            request.sampling.temperature = 0.0
            first = await fails(stub.Infer(request), grpc.StatusCode.UNAVAILABLE, "DEPENDENCY_UNAVAILABLE")
            assert first.retry_after_s
            deadline = time.monotonic() + 300
            while True:
                try:
                    answer = await stub.Infer(request)
                    break
                except RpcError as error:
                    assert error.reason == "DEPENDENCY_UNAVAILABLE", error
                    assert time.monotonic() < deadline, error
                    await asyncio.sleep(error.retry_after_s or 1.0)
            assert answer.model == "orgs/acme/jobs/rl/checkpoints/step-3"
            assert answer.policy_version.weight_version == 3  # the step the checkpoint was saved at
            assert answer.completion_tokens == len(answer.token_ids) and 1 <= answer.completion_tokens <= 4
            chat_request = pb.InferRequest(model=request.model, sampling=request.sampling)
            chat_request.messages.add(role="user", content="hi")
            chatted = await stub.Infer(chat_request)
            assert chatted.prompt_tokens > 0 and chatted.policy_version.job == "orgs/acme/jobs/rl"
            listing = await stub.ListJobs(pb.ListJobsRequest(parent="orgs/acme"))
            jobs = listing.jobs
            assert [j.spec.tasks[0].kind for j in jobs] == [job_spec_pb2.TaskSpec.KIND_SERVICE]
            # No read API holds the worker's key: its job binds it as a vault secret, by name.
            key = inference.worker_key(signer_seed(mesh), "orgs/acme/jobs/rl/checkpoints/step-3")
            got = await stub.GetJob(pb.GetJobRequest(name=jobs[0].name))
            for reply in (listing, got):
                assert key not in json_format.MessageToJson(reply)
                assert key.encode() not in reply.SerializeToString()
            task = jobs[0].spec.tasks[0]
            assert inference.KEY_ENV not in task.envs
            assert [(b.secret, b.env) for b in task.secrets] == [
                (jobs[0].name.rsplit("/", 1)[1], inference.KEY_ENV)
            ]
            # Behind the gateway's back, the worker wants that key; its probe needs none.
            direct = jobs[0].tasks[0].endpoint.rstrip("/")
            async with httpx.AsyncClient(timeout=60) as raw:
                assert (await raw.get(direct + "/v1/models")).status_code == 401
                assert (await raw.post(direct + "/v1/completions", json={"prompt": "x"})).status_code == 401
                bearer = {"Authorization": f"Bearer {key}"}
                assert (await raw.get(direct + "/v1/models", headers=bearer)).status_code == 200
                probe = await raw.get(direct + "/health")
                assert probe.status_code == 200 and probe.json()["idle_exit_s"] == 20
            # The gateway lists its running worker, with the idle time it has left.
            workers = (
                await stub.ListInferenceWorkers(pb.ListInferenceWorkersRequest(parent="orgs/acme"))
            ).workers
            assert [(w.job, w.checkpoint, w.step, w.state) for w in workers] == [
                (jobs[0].name, "orgs/acme/jobs/rl/checkpoints/step-3", 3, job_pb2.Job.STATE_RUNNING)
            ]
            left = workers[0].idle_left.ToTimedelta().total_seconds()
            assert workers[0].HasField("idle") and 0 < left <= 20
            await fails(
                stub.ListInferenceWorkers(pb.ListInferenceWorkersRequest(parent="orgs/other")),
                grpc.StatusCode.NOT_FOUND,
                "ORG_NOT_FOUND",
            )
            info = (await stub.GetServerInfo(pb.GetServerInfoRequest())).server_info
        base = info.openai_base_url
        assert base.endswith("/v1")
        headers = {"Authorization": f"Bearer {made.key}"}
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as http:
            listed = (await http.get("/models")).json()
            assert [m["id"] for m in listed["data"]] == ["orgs/acme/jobs/rl/checkpoints/step-3"]
            body = {"model": "orgs/acme/jobs/rl/checkpoints/step-3", "prompt": "hello", "max_tokens": 3}
            completion = await http.post("/completions", json=body)
            assert completion.status_code == 200, completion.text
            assert completion.json()["usage"]["completion_tokens"] >= 1
            chat = await http.post(
                "/chat/completions",
                json={
                    "model": body["model"],
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
            )
            assert chat.status_code == 200, chat.text
            async with http.stream("POST", "/completions", json={**body, "stream": True}) as streamed:
                assert streamed.status_code == 200
                text = "".join([chunk async for chunk in streamed.aiter_text()])
            assert text.rstrip().endswith("data: [DONE]"), text
            missing = await http.post(
                "/completions", json={**body, "model": "orgs/acme/jobs/rl/checkpoints/x"}
            )
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "CHECKPOINT_NOT_FOUND"
            wrong = await http.get("/models", headers={"Authorization": "Bearer tdm_nope"})
            assert wrong.status_code == 401
            # Token ids in and out, relayed at the root beside /v1 (where vLLM serves the route).
            generated = await http.post(
                base.removesuffix("/v1") + "/inference/v1/generate",
                json={
                    "model": body["model"],
                    "token_ids": [[5, 6, 7], [8, 9]],
                    "sampling_params": {"max_tokens": 2},
                },
            )
            assert generated.status_code == 200, generated.text
            assert generated.json()["prompt_token_ids"] == [[5, 6, 7], [8, 9]]
            for choice in generated.json()["choices"]:
                assert 1 <= len(choice["token_ids"]) <= 2 and choice["weight_version"] == 3
            out_of_vocab = await http.post(
                base.removesuffix("/v1") + "/inference/v1/generate",
                json={"model": body["model"], "token_ids": [5, 300]},
            )
            assert out_of_vocab.status_code == 400 and out_of_vocab.json()["error"]["param"] == "token_ids[1]"
        # The official openai client, relayed to the worker: n choices, streamed logprobs, refusals.
        async with openai.AsyncOpenAI(base_url=base, api_key=made.key, max_retries=0) as client:
            model = "orgs/acme/jobs/rl/checkpoints/step-3"
            assert (await client.models.retrieve(model)).id == model
            hi = [{"role": "user", "content": "hi"}]
            sampled = await client.chat.completions.create(
                model=model,
                messages=hi,
                n=2,
                max_tokens=2,
                temperature=1.0,  # type: ignore[arg-type]
            )
            assert [c.index for c in sampled.choices] == [0, 1]
            streamed_chat = await client.chat.completions.create(
                model=model,
                messages=hi,
                max_tokens=3,
                temperature=0,
                logprobs=True,
                stream=True,  # type: ignore[arg-type]
            )
            entries = [
                e
                async for chunk in streamed_chat
                for c in chunk.choices
                for e in (c.logprobs.content or [] if c.logprobs else [])
            ]
            assert 1 <= len(entries) <= 3 and all(e.logprob <= 0 for e in entries)
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model=model, messages=hi, max_tokens=0)  # type: ignore[arg-type]
            assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "max_tokens"
        # Left idle, the worker stops and its job succeeds; the next call starts a new worker.
        async with open_channel(mesh.address("gateway"), mesh.settings, token=made.key) as channel:
            stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            idle = await wait_terminal(stub, jobs[0].name, timeout_s=180)
            assert idle.state == idle.STATE_SUCCEEDED, idle
            await fails(stub.Infer(request), grpc.StatusCode.UNAVAILABLE, "DEPENDENCY_UNAVAILABLE")
            names = [j.name for j in (await stub.ListJobs(pb.ListJobsRequest(parent="orgs/acme"))).jobs]
            assert len(names) == 2 and jobs[0].name in names, names
            # Stopped by hand, the new worker's job is cancelled and the listing is empty.
            stop = pb.StopInferenceWorkerRequest(model="orgs/acme/jobs/rl/checkpoints/latest")
            stopped = (await stub.StopInferenceWorker(stop)).workers
            (started,) = [n for n in names if n != jobs[0].name]
            assert [(w.job, w.checkpoint) for w in stopped] == [
                (started, "orgs/acme/jobs/rl/checkpoints/step-3")
            ]
            cancelled = await wait_terminal(stub, started, timeout_s=60)
            assert cancelled.state == cancelled.STATE_CANCELLED, cancelled
            listed = await stub.ListInferenceWorkers(pb.ListInferenceWorkersRequest(parent="orgs/acme"))
            assert not listed.workers
            await fails(
                stub.StopInferenceWorker(stop), grpc.StatusCode.NOT_FOUND, "INFERENCE_WORKER_NOT_FOUND"
            )
            other = pb.StopInferenceWorkerRequest(model="orgs/other/jobs/rl/checkpoints/latest")
            await fails(stub.StopInferenceWorker(other), grpc.StatusCode.NOT_FOUND, "JOB_NOT_FOUND")
            bad = pb.StopInferenceWorkerRequest(model="orgs/acme/jobs/rl")
            await fails(stub.StopInferenceWorker(bad), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")


def signer_seed(mesh: Any) -> bytes:
    """The deployment's signing seed, from which the gateway derives its workers' keys."""
    return load_signing_key("", mesh.settings.state_dir).encode()


async def test_a_job_group_whose_service_task_registers_its_task_app_is_accepted(world: World) -> None:
    # The app exists only once the scheduler starts the group's service task, so the gateway does not check it.
    text = (ROOT / "examples" / "jobs" / "managed-taskapp-rl.yaml").read_text()
    text = text.replace("orgs/demo/", "orgs/acme/").replace("backend: kubernetes", "backend: local")
    spec = load_yaml_text(re.sub(r"\nkubernetes:\n(  .*\n)+", "\n", text))  # a mesh with the local backend
    # The gateway passes it on: the scheduler then answers for its 8 H100s, which this mesh has not.
    await fails(
        world.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", spec=spec, validate_only=True)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "RESOURCES_UNSATISFIABLE",
    )
    # An app the group does not register is still checked.
    spec.tasks[0].service.register_task_app.app_id = "other"
    await fails(
        world.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", spec=spec, validate_only=True)),
        grpc.StatusCode.NOT_FOUND,
        "TASK_APP_NOT_FOUND",
    )


def load_yaml_text(text: str) -> job_spec_pb2.JobSpec:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "job.yaml"
        path.write_text(text)
        return load_yaml(path)

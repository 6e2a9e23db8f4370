"""The taskapp-proxy against real parts: a real Task App over HTTP, the real vault holding its key, the real
events service. Every failure of the app is a typed rollout error, never a crash or a silent zero."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2
from tandem.events.v1 import events_service_pb2, events_service_pb2_grpc
from tandem.taskapp.v1 import rollout_pb2, task_app_pb2, taskapp_service_pb2_grpc
from tandem.taskapp.v1 import taskapp_service_pb2 as pb
from tandem.vault.v1 import vault_service_pb2, vault_service_pb2_grpc

from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from mesh.secrets import seal_for_upload
from mesh.status import RpcError
from tests.support import taskapps
from tests.support.mesh import Mesh, mesh_settings, running_mesh

pytestmark = pytest.mark.timeout(90)
KEY = "env-key-5f4e3d2c1b0a"
JOB = "orgs/acme/jobs/run-1"
APP = "orgs/acme/taskApps/fake"
Kind = rollout_pb2.RolloutError


class World:
    def __init__(self, mesh: Mesh, app: taskapps.FakeTaskApp, url: str) -> None:
        self.mesh, self.app, self.url = mesh, app, url
        self.signer = TokenSigner(load_signing_key("", mesh.settings.state_dir))
        self.channels: list[grpc.aio.Channel] = []

    def stub(self, token: str) -> taskapp_service_pb2_grpc.TaskAppServiceStub:
        channel = open_channel(self.mesh.address("taskapp_proxy"), self.mesh.settings, token=token)
        self.channels.append(channel)
        return taskapp_service_pb2_grpc.TaskAppServiceStub(channel)

    @property
    def user(self) -> taskapp_service_pb2_grpc.TaskAppServiceStub:
        return self.stub(self.signer.issue("user", "alice", org="acme"))

    @property
    def job(self) -> taskapp_service_pb2_grpc.TaskAppServiceStub:
        named = [APP, "orgs/acme/taskApps/down"]
        return self.stub(self.signer.issue("job", JOB, org="acme", extra={"task_apps": named}))


@pytest.fixture
async def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[World]:
    monkeypatch.setenv("TANDEM_TASKAPP_CHECK_ON_REGISTER", "false")
    monkeypatch.setenv("TANDEM_TASKAPP_BREAKER_FAILURES", "3")
    monkeypatch.setenv("TANDEM_TASKAPP_BREAKER_OPEN_S", "60")
    app = taskapps.FakeTaskApp(KEY)
    settings = mesh_settings(tmp_path)
    async with (
        taskapps.serve_app(app.asgi()) as url,
        running_mesh(settings, ["events", "vault", "taskapp_proxy"]) as mesh,
    ):
        w = World(mesh, app, url)
        async with open_channel(
            mesh.address("vault"), settings, token=w.signer.issue("user", "alice", org="acme")
        ) as ch:
            vault = vault_service_pb2_grpc.VaultServiceStub(ch)
            key = await vault.GetPublicKey(vault_service_pb2.GetPublicKeyRequest(parent="orgs/acme"))
            await vault.PutSecret(
                vault_service_pb2.PutSecretRequest(
                    parent="orgs/acme",
                    secret_id="env-key",
                    key_id=key.key_id,
                    ciphertext=seal_for_upload(key.public_key, KEY.encode()),
                )
            )
        await w.user.RegisterTaskApp(
            pb.RegisterTaskAppRequest(
                parent="orgs/acme",
                task_app_id="fake",
                task_app=task_app_pb2.TaskApp(
                    base_url=url,
                    secret_name="orgs/acme/secrets/env-key",
                    limits=task_app_pb2.TaskAppLimits(
                        max_concurrency=4, rollout_timeout=duration_pb2.Duration(seconds=2)
                    ),
                ),
            )
        )
        yield w
        for channel in w.channels:
            await channel.close()


def spec(seed: int, correlation: str = "") -> rollout_pb2.RolloutSpec:
    return rollout_pb2.RolloutSpec(
        trace_correlation_id=correlation or f"ep-{seed}-{id(object())}",
        env=rollout_pb2.RolloutEnv(seed=seed),
        policy=rollout_pb2.RolloutPolicy(
            config=rollout_pb2.RolloutPolicyConfig(model="policy", inference_url="http://127.0.0.1:9/v1/ep")
        ),
    )


async def rollout(w: World, seed: int, correlation: str = "", job: str = JOB) -> rollout_pb2.RolloutResult:
    reply = await w.job.Rollout(
        pb.RolloutRequest(task_app="orgs/acme/taskApps/fake", spec=spec(seed, correlation), job=job)
    )
    return reply.result


async def test_registration_records_the_app(world: World) -> None:
    got = await world.user.GetTaskApp(pb.GetTaskAppRequest(name="orgs/acme/taskApps/fake"))
    assert got.task_app.base_url == world.url
    assert got.task_app.task_info["task"]["name"] == "fake"
    listed = await world.user.ListTaskApps(pb.ListTaskAppsRequest(parent="orgs/acme"))
    assert [a.name for a in listed.task_apps] == ["orgs/acme/taskApps/fake"]
    with pytest.raises(RpcError) as twice:
        await world.user.RegisterTaskApp(
            pb.RegisterTaskAppRequest(
                parent="orgs/acme", task_app_id="fake", task_app=task_app_pb2.TaskApp(base_url=world.url)
            )
        )
    assert twice.value.code == grpc.StatusCode.ALREADY_EXISTS


async def test_a_rollout_carries_the_key_and_returns_the_reward(world: World) -> None:
    result = await rollout(world, taskapps.OK, "ep-ok")
    assert not result.HasField("error")
    assert (result.trace_correlation_id, result.metrics.outcome_reward) == ("ep-ok", 1.0)
    assert list(result.metrics.event_rewards) == [0.25]
    assert result.attempts == 1 and len(result.trajectory.turns) == 1
    sent = world.app.seen[-1]
    assert (sent["trace_correlation_id"], sent["mode"], sent["env"]["seed"]) == ("ep-ok", "rl", 0)
    assert world.app.headers[-1]["x-api-key"] == KEY
    assert world.app.headers[-1]["x-trace-correlation-id"] == "ep-ok"


async def test_the_sampling_seed_reaches_the_app_as_a_json_number(world: World) -> None:
    for seed in (0, 2**53 - 1, 2**64 - 1):
        sent = spec(taskapps.OK, f"ep-seed-{seed}")
        sent.policy.config.seed = seed
        await world.job.Rollout(pb.RolloutRequest(task_app=APP, spec=sent, job=JOB))
        assert world.app.seen[-1]["policy"]["config"]["seed"] == seed  # an int, not proto3 JSON's string
    await rollout(world, taskapps.OK, "ep-unseeded")
    assert "seed" not in world.app.seen[-1]["policy"]["config"]  # unset stays unset: the worker draws one


@pytest.mark.parametrize(
    ("seed", "kind"),
    [
        (taskapps.FAIL_500, Kind.KIND_HTTP_STATUS),
        (taskapps.HANG, Kind.KIND_TIMEOUT),
        (taskapps.MALFORMED, Kind.KIND_MALFORMED_RESPONSE),
        (taskapps.NAN_REWARD, Kind.KIND_NON_FINITE_REWARD),
        (taskapps.WRONG_ID, Kind.KIND_CORRELATION_MISMATCH),
    ],
)
async def test_app_faults_are_typed_errors(world: World, seed: int, kind: int) -> None:
    result = await rollout(world, seed)
    assert result.error.kind == kind
    assert result.metrics.outcome_reward == 0.0 and not result.HasField("metrics")
    assert KEY not in result.error.message


async def test_retries_only_where_safe(world: World) -> None:
    flaky = await rollout(world, taskapps.FLAKY, "ep-flaky")
    assert not flaky.HasField("error") and flaky.attempts == 3  # two 503s, then the answer
    failing = await rollout(world, taskapps.FAIL_500, "ep-500")
    assert failing.attempts == 1  # a 500 is the app's own answer: not retried


async def test_down_app_opens_the_circuit(world: World) -> None:
    await world.user.RegisterTaskApp(
        pb.RegisterTaskAppRequest(
            parent="orgs/acme",
            task_app_id="down",
            task_app=task_app_pb2.TaskApp(
                base_url="http://127.0.0.1:9", limits=task_app_pb2.TaskAppLimits(max_retries=0)
            ),
        )
    )
    kinds = []
    for i in range(5):
        reply = await world.job.Rollout(
            pb.RolloutRequest(task_app="orgs/acme/taskApps/down", spec=spec(0, f"down-{i}"))
        )
        kinds.append(reply.result.error.kind)
    assert kinds[:3] == [Kind.KIND_UNREACHABLE] * 3
    assert kinds[3:] == [Kind.KIND_CIRCUIT_OPEN] * 2
    state = (await world.user.GetTaskApp(pb.GetTaskAppRequest(name="orgs/acme/taskApps/down"))).task_app.state
    assert state == task_app_pb2.TaskApp.STATE_CIRCUIT_OPEN
    healthy = await rollout(world, taskapps.OK)  # another app's breaker is unaffected
    assert not healthy.HasField("error")


async def test_a_repeated_correlation_id_is_one_episode(world: World) -> None:
    first, second = await asyncio.gather(
        rollout(world, taskapps.SLOW, "ep-same"), rollout(world, taskapps.SLOW, "ep-same")
    )
    assert first == second
    again = await rollout(world, taskapps.SLOW, "ep-same")
    assert again == first
    assert sum(1 for s in world.app.seen if s["trace_correlation_id"] == "ep-same") == 1


async def test_stream_rollouts_answers_as_each_finishes_within_the_concurrency_limit(world: World) -> None:
    async def requests() -> AsyncIterator[pb.StreamRolloutsRequest]:
        for i in range(12):
            seed = taskapps.SLOW if i % 2 else taskapps.OK
            yield pb.StreamRolloutsRequest(
                task_app="orgs/acme/taskApps/fake", spec=spec(seed, f"s-{i}"), job=JOB
            )

    results = [r.result async for r in world.job.StreamRollouts(requests())]
    assert sorted(r.trace_correlation_id for r in results) == sorted(f"s-{i}" for i in range(12))
    assert all(not r.HasField("error") for r in results)
    fast_positions = [i for i, r in enumerate(results) if r.metrics.outcome_reward == 1.0]
    assert sum(fast_positions) < sum(range(6)) + 6 * 3  # fast episodes tend to come back first
    assert world.app.peak_concurrent <= 4


async def test_other_orgs_cannot_use_the_app(world: World) -> None:
    other = world.stub(world.signer.issue("user", "mallory", org="globex"))
    with pytest.raises(RpcError) as info:
        await other.Rollout(pb.RolloutRequest(task_app=APP, spec=spec(0)))
    with pytest.raises(RpcError) as absent:
        await world.user.Rollout(pb.RolloutRequest(task_app="orgs/acme/taskApps/nope", spec=spec(0)))
    assert (info.value.code, info.value.reason) == (absent.value.code, absent.value.reason)
    assert info.value.reason == "TASK_APP_NOT_FOUND"
    # A job token plays only the apps its job names: not another of its org (existing or not), not
    # another org's, even one its job names; and it registers or deletes none.
    named = world.signer.issue("job", "orgs/globex/jobs/x", org="globex", extra={"task_apps": [APP]})
    cases = [
        (world.job, "orgs/acme/taskApps/nope", grpc.StatusCode.PERMISSION_DENIED, "OUTSIDE_JOB_SCOPE"),
        (world.stub(named), APP, grpc.StatusCode.NOT_FOUND, "TASK_APP_NOT_FOUND"),
    ]
    for stub, app, code, reason in cases:
        with pytest.raises(RpcError) as refused:
            await stub.Rollout(pb.RolloutRequest(task_app=app, spec=spec(0)))
        assert (refused.value.code, refused.value.reason) == (code, reason)
    with pytest.raises(RpcError) as delete:
        await world.job.DeleteTaskApp(pb.DeleteTaskAppRequest(name=APP))
    assert (delete.value.code, delete.value.reason) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "OUTSIDE_JOB_SCOPE",
    )


async def test_each_rollout_is_an_event_of_the_job(world: World) -> None:
    await rollout(world, taskapps.OK, "ev-ok")
    await rollout(world, taskapps.MALFORMED, "ev-bad")
    token = world.signer.issue("service", "test")
    async with open_channel(world.mesh.address("events"), world.mesh.settings, token=token) as ch:
        events = events_service_pb2_grpc.EventServiceStub(ch)
        for _ in range(50):
            try:
                listed = await events.ListEvents(events_service_pb2.ListEventsRequest(job=JOB))
            except RpcError:
                listed = None
            if listed is not None and len(listed.events) >= 2:
                break
            await asyncio.sleep(0.1)
    assert listed is not None
    done = {e.rollout_completed.rollout_id: e.rollout_completed for e in listed.events}
    assert done["ev-ok"].reward == 1.0 and done["ev-ok"].error_reason == ""
    assert done["ev-bad"].error_reason == "MALFORMED_RESPONSE"
    assert math.isfinite(done["ev-bad"].reward)

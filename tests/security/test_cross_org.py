"""The cross-organization matrix: every gateway RPC that names an organization's resource, called with another
organization's key on acme's real resources, answers exactly as it answers for a resource that does not
exist (the same code, reason and message once the names are swapped), and leaves acme's resources as they
were. An answer that differed would tell globex that acme has a job, secret or Task App of that name."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from typing import Any

import grpc
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.scheduler.v1 import job_spec_pb2
from tandem.taskapp.v1 import task_app_pb2
from tandem.trainer.v1 import config_pb2

from mesh.secrets import seal_for_upload
from mesh.status import RpcError
from tandem_jobs.config import parse_job
from tests.gateway.test_gateway import (
    APP_KEY,
    World,
    demo_toml,
    echo_task,
    put,
    register,
    wait_terminal,
    world,
)
from tests.support.taskapps import example_app_in_thread

__all__ = ["world"]

ORG = "orgs/acme"
ABSENT_ORG = "orgs/nobody"
Call = Callable[[Any, dict[str, str]], Any]  # (stub, names) -> an awaitable or an async iterator


async def answer(call: Any) -> tuple[str, str, str]:
    """(code, reason, message) of a call that must fail; 'OK' when it did not."""
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    except RpcError as error:
        return error.code.name, error.reason, error.message
    return "OK", "", ""


def matrix(key_id: str, sealed: bytes) -> dict[str, Call]:
    """Each RPC that takes an organization's resource, as a call on the names in `n`."""
    spec = job_spec_pb2.JobSpec(display_name="echo", tasks=[echo_task()])
    return {
        "GetOrg": lambda s, n: s.GetOrg(pb.GetOrgRequest(name=n["org"])),
        "CreateApiKey": lambda s, n: s.CreateApiKey(
            pb.CreateApiKeyRequest(parent=n["org"], display_name="k")
        ),
        "ListApiKeys": lambda s, n: s.ListApiKeys(pb.ListApiKeysRequest(parent=n["org"])),
        "RevokeApiKey": lambda s, n: s.RevokeApiKey(pb.RevokeApiKeyRequest(name=n["api_key"])),
        "GetPublicKey": lambda s, n: s.GetPublicKey(pb.GetPublicKeyRequest(parent=n["org"])),
        "PutSecret": lambda s, n: s.PutSecret(
            pb.PutSecretRequest(parent=n["org"], secret_id="env-key", key_id=key_id, ciphertext=sealed)
        ),
        "ListSecrets": lambda s, n: s.ListSecrets(pb.ListSecretsRequest(parent=n["org"])),
        "DeleteSecret": lambda s, n: s.DeleteSecret(pb.DeleteSecretRequest(name=n["secret"])),
        "RegisterTaskApp": lambda s, n: s.RegisterTaskApp(
            pb.RegisterTaskAppRequest(
                parent=n["org"],
                task_app_id="fake",
                task_app=task_app_pb2.TaskApp(base_url="http://127.0.0.1:9", secret_name=n["secret"]),
            )
        ),
        "CheckTaskApp": lambda s, n: s.CheckTaskApp(pb.CheckTaskAppRequest(name=n["task_app"])),
        "ListTaskApps": lambda s, n: s.ListTaskApps(pb.ListTaskAppsRequest(parent=n["org"])),
        "GetTaskApp": lambda s, n: s.GetTaskApp(pb.GetTaskAppRequest(name=n["task_app"])),
        "DeleteTaskApp": lambda s, n: s.DeleteTaskApp(pb.DeleteTaskAppRequest(name=n["task_app"])),
        "CreateJob": lambda s, n: s.CreateJob(
            pb.CreateJobRequest(parent=n["org"], job_id="again", spec=spec)
        ),
        "CreateRlJob": lambda s, n: s.CreateRlJob(
            pb.CreateRlJobRequest(parent=n["org"], job_id="rl", config=rl_config(n["task_app"]))
        ),
        "GetJob": lambda s, n: s.GetJob(pb.GetJobRequest(name=n["job"])),
        "ListJobs": lambda s, n: s.ListJobs(pb.ListJobsRequest(parent=n["org"])),
        "CancelJob": lambda s, n: s.CancelJob(pb.CancelJobRequest(name=n["job"], reason="cross-org")),
        "StreamJobLogs": lambda s, n: s.StreamJobLogs(pb.StreamJobLogsRequest(job=n["job"])),
        "SubscribeEvents": lambda s, n: s.SubscribeEvents(
            pb.SubscribeEventsRequest(job=n["job"], end_when_terminal=True)
        ),
        "ListEvents": lambda s, n: s.ListEvents(pb.ListEventsRequest(job=n["job"])),
        "ListMetrics": lambda s, n: s.ListMetrics(pb.ListMetricsRequest(job=n["job"])),
        "ListCheckpoints": lambda s, n: s.ListCheckpoints(pb.ListCheckpointsRequest(parent=n["job"])),
        "Infer": lambda s, n: s.Infer(pb.InferRequest(model=n["checkpoint"], prompt="hi")),
        "ListInferenceWorkers": lambda s, n: s.ListInferenceWorkers(
            pb.ListInferenceWorkersRequest(parent=n["org"])
        ),
        "StopInferenceWorker": lambda s, n: s.StopInferenceWorker(
            pb.StopInferenceWorkerRequest(model=n["checkpoint"])
        ),
    }


def rl_config(task_app: str) -> config_pb2.TrainerConfig:
    return parse_job(tomllib.loads(demo_toml(task_app)))


def names(org: str, api_key: str, job: str = "echo") -> dict[str, str]:
    return {
        "org": org,
        "api_key": f"{org}/apiKeys/{api_key}",
        "secret": f"{org}/secrets/env-key",
        "task_app": f"{org}/taskApps/fake",
        "job": f"{org}/jobs/{job}",
        "checkpoint": f"{org}/jobs/{job}/checkpoints/step-000001",
    }


async def acme_state(world: World) -> tuple[object, ...]:
    """What acme has: its keys, secrets, Task Apps, jobs (name and state) and the job's events."""
    keys = await world.acme.ListApiKeys(pb.ListApiKeysRequest(parent=ORG))
    secrets = await world.acme.ListSecrets(pb.ListSecretsRequest(parent=ORG))
    apps = await world.acme.ListTaskApps(pb.ListTaskAppsRequest(parent=ORG))
    jobs = await world.acme.ListJobs(pb.ListJobsRequest(parent=ORG))
    events = await world.acme.ListEvents(pb.ListEventsRequest(job=f"{ORG}/jobs/echo"))
    return (
        sorted((k.name, k.state) for k in keys.api_keys),
        sorted(s.name for s in secrets.secrets),
        sorted(a.name for a in apps.task_apps),
        sorted((j.name, j.state) for j in jobs.jobs),
        [e.seq for e in events.events],
    )


async def test_another_orgs_resources_answer_exactly_as_absent_ones(world: World) -> None:
    with example_app_in_thread(APP_KEY) as url:
        await register(world, url)  # acme's secret env-key and its Task App fake
        job = await world.acme.CreateJob(
            pb.CreateJobRequest(
                parent=ORG, job_id="echo", spec=job_spec_pb2.JobSpec(display_name="echo", tasks=[echo_task()])
            )
        )
        await wait_terminal(world.acme, job.job.name)
        key = (await world.acme.ListApiKeys(pb.ListApiKeysRequest(parent=ORG))).api_keys[0]
        key_id = key.name.rsplit("/", 1)[-1]
        public = (await world.acme.GetPublicKey(pb.GetPublicKeyRequest(parent=ORG))).key
        await put(world.acme, ORG, "other-value", b"kept")
        before = await acme_state(world)
        real = names(ORG, key_id)
        absent_here = names(ORG, "a" * len(key_id), job="absent")
        absent_org = names(ABSENT_ORG, key_id)
        differ: dict[str, tuple[object, ...]] = {}
        for rpc, call in matrix(public.key_id, seal_for_upload(public.public_key, b"x")).items():
            absent = absent_org if rpc in PARENT_CALLS else absent_here
            on_acme = await answer(call(world.globex, real))
            expected = await answer(call(world.globex, absent))
            unmasked = (on_acme[0], on_acme[1], swap(on_acme[2], real, absent))
            if unmasked != expected or on_acme[0] != grpc.StatusCode.NOT_FOUND.name:
                differ[rpc] = (on_acme, expected)
        assert not differ, differ
        assert await acme_state(world) == before  # nothing of acme's changed, was added or was cancelled


PARENT_CALLS = {  # called on an organization: compared with the same call on an organization that does not exist
    "GetOrg",
    "CreateApiKey",
    "ListApiKeys",
    "GetPublicKey",
    "PutSecret",
    "ListSecrets",
    "RegisterTaskApp",
    "ListTaskApps",
    "CreateJob",
    "CreateRlJob",
    "ListJobs",
    "ListInferenceWorkers",
}


def swap(message: str, real: dict[str, str], absent: dict[str, str]) -> str:
    """`message` with each of acme's real names replaced by its absent counterpart (longest first)."""
    for field in sorted(real, key=lambda f: -len(real[f])):
        message = message.replace(real[field], absent[field])
    return message


def test_the_matrix_covers_every_rpc_that_names_an_organizations_resource() -> None:
    service = pb.DESCRIPTOR.services_by_name["GatewayService"]
    unscoped = {"GetServerInfo", "CreateOrg"}  # the server's own facts, and the admin's creation of an org
    assert {m.name for m in service.methods} - unscoped == set(matrix("k", b""))

"""A job whose `[task_app]` gives `base_url` and `secret_name`: the gateway registers that app for the job
with that secret as its key (the proxy runs the checks with the key it opens from the vault), and the job's
config names the registration, so the trainer's rollouts carry the right key. `validate_only` runs the same
checks and stores nothing."""

from __future__ import annotations

import tomllib

import grpc
import pytest
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.scheduler.v1 import job_spec_pb2

from tests.gateway.test_gateway import APP_KEY, World, demo_toml, fails, put, wait_terminal, world
from tests.support.taskapps import example_app_in_thread

pytestmark = pytest.mark.timeout(180)
__all__ = ["world"]  # fixture


def bare_toml(url: str, secret: str) -> str:
    return demo_toml().replace(
        'name = "orgs/acme/taskApps/fake"', f'base_url = "{url}"\nsecret_name = "orgs/acme/secrets/{secret}"'
    )


def named_app(config_toml: str) -> dict[str, str]:
    return dict(tomllib.loads(config_toml)["task_app"])


async def test_validate_only_checks_the_bare_app_with_its_secret(world: World) -> None:
    await put(world.acme, "orgs/acme", "env-key", APP_KEY.encode())
    await put(world.acme, "orgs/acme", "other-key", b"not-the-apps-key-at-all")
    with example_app_in_thread(APP_KEY) as url:
        job = (
            await world.acme.CreateJob(
                pb.CreateJobRequest(
                    parent="orgs/acme",
                    job_id="rl",
                    rl_config_toml=bare_toml(url, "env-key"),
                    validate_only=True,
                )
            )
        ).job
        [task] = job.spec.tasks
        assert named_app(task.online_rl.config_toml) == {"name": "orgs/acme/taskApps/job-rl"}
        listed = await world.acme.ListTaskApps(pb.ListTaskAppsRequest(parent="orgs/acme"))
        assert not listed.task_apps  # checked, not stored

        # The secret is the one the app's checks ran with: a secret holding another key fails them now.
        error = await fails(
            world.acme.CreateJob(
                pb.CreateJobRequest(
                    parent="orgs/acme",
                    job_id="rl",
                    rl_config_toml=bare_toml(url, "other-key"),
                    validate_only=True,
                )
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "TASK_APP_CHECK_FAILED",
        )
        assert "auth" in error.metadata["failed_checks"]
        await fails(  # a secret that does not exist
            world.acme.CreateJob(
                pb.CreateJobRequest(
                    parent="orgs/acme", job_id="rl", rl_config_toml=bare_toml(url, "nope"), validate_only=True
                )
            ),
            grpc.StatusCode.NOT_FOUND,
            "SECRET_NOT_FOUND",
        )


async def test_a_job_registers_its_bare_app_with_the_named_secret(world: World) -> None:
    await put(world.acme, "orgs/acme", "env-key", APP_KEY.encode())
    with example_app_in_thread(APP_KEY) as url:
        spec = job_spec_pb2.JobSpec(
            display_name="rl",
            tasks=[
                job_spec_pb2.TaskSpec(
                    name="trainer",
                    kind=job_spec_pb2.TaskSpec.KIND_ONLINE_RL,
                    online_rl=job_spec_pb2.OnlineRlOptions(config_toml=bare_toml(url, "env-key")),
                )
            ],
        )
        job = (
            await world.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", job_id="bare", spec=spec))
        ).job
        await world.acme.CancelJob(pb.CancelJobRequest(name=job.name))
        await wait_terminal(world.acme, job.name, timeout_s=120)
        [task] = job.spec.tasks
        assert named_app(task.online_rl.config_toml) == {"name": "orgs/acme/taskApps/job-bare"}
        app = (await world.acme.GetTaskApp(pb.GetTaskAppRequest(name="orgs/acme/taskApps/job-bare"))).task_app
        assert (app.base_url, app.secret_name) == (url, "orgs/acme/secrets/env-key")
        assert app.last_check_results and all(c.passed for c in app.last_check_results)

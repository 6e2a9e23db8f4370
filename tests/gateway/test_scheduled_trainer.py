"""The production flow on CPU: an online RL job submitted through the gateway against a Task App registered
in the mesh runs under the scheduler (local backend) with the trainer in its scheduled mode, so its
`train.step` and `checkpoint.saved` events land in the job's own stream and ListCheckpoints lists the
checkpoint it wrote."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.scheduler.v1 import job_pb2, job_spec_pb2

from tests.gateway.test_gateway import APP_KEY, World, register, world
from tests.services.scheduler.test_online_rl import short_demo
from tests.support.taskapps import example_app_in_thread

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
__all__ = ["world"]  # fixture


async def test_a_scheduled_trainer_reports_to_the_jobs_stream(world: World, tmp_path: Path) -> None:
    with example_app_in_thread(APP_KEY) as url:
        await register(world, url)  # orgs/acme/taskApps/fake
        config = short_demo(tmp_path / "model").replace(
            'name = "orgs/demo/taskApps/single-turn"', 'name = "orgs/acme/taskApps/fake"'
        )
        task = job_spec_pb2.TaskSpec(
            name="trainer",
            kind=job_spec_pb2.TaskSpec.KIND_ONLINE_RL,
            online_rl=job_spec_pb2.OnlineRlOptions(config_toml=config),
        )
        spec = job_spec_pb2.JobSpec(display_name="rl", tasks=[task])
        job = (
            await world.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", job_id="rl", spec=spec))
        ).job
        deadline = time.monotonic() + 840
        while job.state not in (job.STATE_SUCCEEDED, job.STATE_FAILED, job.STATE_CANCELLED):
            assert time.monotonic() < deadline, job
            await asyncio.sleep(1)
            job = (await world.acme.GetJob(pb.GetJobRequest(name=job.name))).job
    assert job.state == job_pb2.Job.State.STATE_SUCCEEDED, job.failure.message
    events = (await world.acme.ListEvents(pb.ListEventsRequest(job=job.name, page_size=1000))).events
    types = [e.type for e in events]
    assert types.count("train.step") == 3, types
    saved = [e for e in events if e.type == "checkpoint.saved"]
    assert saved and saved[-1].checkpoint_saved.step == 3, types
    folder = Path(saved[-1].checkpoint_saved.uri.removeprefix("file://"))
    assert (folder / "tandem.json").is_file()
    # The rollouts went through the mesh's proxy: its rollout events are in the job's stream too.
    assert any(t.startswith("rollout.") for t in types), types

    listed = (await world.acme.ListCheckpoints(pb.ListCheckpointsRequest(parent=job.name))).checkpoints
    assert listed and listed[0].name == f"{job.name}/checkpoints/step-3", listed

    # The scheduled trainer traces its rollouts too (no collector here: a file beside the task's logs), the
    # root of each rollout's trace through the proxy, the Task App and the worker.
    traces = folder.parents[2] / "traces.jsonl"
    names = {json.loads(line)["name"] for line in traces.read_text().splitlines() if line.strip()}
    assert "trainer.rollouts" in names, names

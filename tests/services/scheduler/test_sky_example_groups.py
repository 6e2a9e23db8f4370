"""The SkyPilot-vocabulary examples with buckets, job groups and an image, examples/jobs/sky-*.yaml, run
through CreateJob on the local backend and on the real one-node Slurm cluster, against the S3-compatible
server the bucket tests use (moto's, tests/support/s3.py): a task reading a MOUNT_CACHED dataset bucket, the
trainer + eval-watcher group sharing a checkpoint bucket, the RL group whose trainer reaches its rollout
server by sibling host name, and an image task, which is a PRECHECK failure where nothing can run images.
That SkyPilot's own loader reads these files as Tandem does is checked in test_skypilot.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tandem.scheduler.v1 import job_pb2

from services.scheduler.spec import load_yaml
from tests.services.scheduler.test_scheduler import TERMINAL, log_text, wait_for
from tests.services.scheduler.test_skypilot_files import (
    BACKENDS,
    Acme,
    acme,
    container_runtime_works,
    refused,
    store_key,
    submit,
)
from tests.support.postgres import free_port
from tests.support.s3 import S3Server, s3_server

__all__ = ["acme", "s3_server"]  # fixtures
pytestmark = pytest.mark.timeout(300)
EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "jobs"
State = job_pb2.Job.State


async def run_example(clients: Acme, name: str, **envs: str) -> tuple[job_pb2.Job, dict[str, str]]:
    """Submit the example with `envs` given as `--env` would; it must succeed. The job and each task's log."""
    # The bucket wrapper imports Tandem from this checkout, as the tests of test_skypilot_files.py do.
    spec = load_yaml(EXAMPLES / name, envs={**envs, "PYTHONPATH": str(EXAMPLES.parents[1])})
    job = await submit(clients, spec)
    done = await wait_for(clients, job.name, *TERMINAL, within_s=240)
    logs = {t.name: await log_text(clients, job.name, t.name) for t in spec.tasks}
    assert done.state == State.STATE_SUCCEEDED, (done.failure.message, logs)
    assert done.backend == BACKENDS[clients.backend]
    return done, logs


async def test_the_bucket_dataset_example(acme: Acme, s3_server: S3Server) -> None:
    await store_key(acme, s3_server)
    store = s3_server.store()
    store.mkdir("tandem-example-datasets")
    rows = [
        {"question": "2+2", "answer": 4},
        {"question": "3-5", "answer": -2},
        {"question": "?", "answer": "x"},
    ]
    store.pipe_file(
        "tandem-example-datasets/arith/train.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()
    )
    _, logs = await run_example(acme, "sky-bucket-dataset.yaml", AWS_ENDPOINT_URL=s3_server.endpoint)
    summary = {"examples": 3, "numeric_answers": 2}
    assert f"dataset summary: {json.dumps(summary)}" in logs["sky-bucket-dataset"], logs
    assert json.loads(store.cat_file("tandem-example-results/summary.json")) == summary


async def test_the_train_and_eval_watcher_group(acme: Acme, s3_server: S3Server) -> None:
    await store_key(acme, s3_server)
    store = s3_server.store()
    store.mkdir("tandem-example-datasets")
    points = [[x / 2, 3 * x / 8 + 1] for x in range(-6, 7)]  # y = 0.75 x + 1
    store.pipe_file("tandem-example-datasets/line/points.json", json.dumps(points).encode())
    done, logs = await run_example(acme, "sky-train-eval-group.yaml", AWS_ENDPOINT_URL=s3_server.endpoint)
    saved = [int(s) for s in re.findall(r"trainer: checkpoint step (\d+)", logs["trainer"])]
    assert saved == [10, 20, 30, 40, 50], logs["trainer"]
    evaluated = [(int(s), float(m)) for s, m in re.findall(r"step (\d+) mse ([\d.]+)", logs["eval-watcher"])]
    steps = [s for s, _ in evaluated]
    assert steps[-1] == 50 and steps == sorted(set(steps)) and set(steps) <= set(saved), logs["eval-watcher"]
    losses = [m for _, m in evaluated]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.05, evaluated  # training helps
    # The checkpoints are in the bucket under the trainer's task id, the group's job id in it.
    job_id = done.name.rsplit("/", 1)[1]
    assert store.ls(f"tandem-example-ckpts/acme_{job_id}-0", detail=False), store.find("tandem-example-ckpts")


async def test_the_rl_group_trains_against_its_rollout_sibling_by_host_name(acme: Acme) -> None:
    _, logs = await run_example(acme, "sky-rl-group.yaml", ROLLOUT_PORT=str(free_port()))
    rewards = [float(r) for r in re.findall(r"trainer: step \d+ mean reward ([\d.]+)", logs["trainer"])]
    assert len(rewards) == 30, logs["trainer"]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards  # the rewarded action is learnt
    assert "trainer: done, the policy prefers action 2" in logs["trainer"], logs["trainer"]
    assert "rollout: served policy version 30" in logs["rollout"], logs["rollout"]


async def test_the_image_example_is_a_precheck_failure_where_images_cannot_run(
    acme: Acme, tmp_path: Path
) -> None:
    if acme.backend == "local" and container_runtime_works():
        pytest.skip("this machine has a working docker or podman: the task would run in its image")
    text = (
        (EXAMPLES / "sky-docker-image.yaml").read_text().replace("python -c", "echo ran-the-task; python -c")
    )
    done, _ = await refused(acme, text, tmp_path)
    words = {"local": "no container runtime that works", "slurm": "no pyxis plugin"}
    assert words[acme.backend] in done.failure.message, done.failure.message
    assert "pytorch/pytorch:2.3.1-cuda12.1-cudnn8-runtime" in done.failure.message

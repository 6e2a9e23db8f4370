"""GPU alternatives and GPU model names through the engine on the local backend: a SkyPilot task asking
`accelerators: [H100:8, A100:4]` runs on the first choice the nodes satisfy and is told which it got
(`SKYPILOT_NUM_GPUS_PER_NODE`, `TANDEM_GPU_TYPE`, `CUDA_VISIBLE_DEVICES`), and `accelerators: H100:8` runs on
nodes reporting their full model name, as the admission check already accepts it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import nacl.signing
import pytest

from mesh.identity import TokenSigner
from mesh.store import open_database
from services.scheduler.backends.base import Handle, LaunchSpec, Resources
from services.scheduler.backends.local import LocalBackend
from services.scheduler.engine import Engine, EngineConfig, EventOutbox, job_event
from services.scheduler.lifecycle import JobState
from services.scheduler.spec import check_fits, parse_yaml
from services.scheduler.store import MIGRATIONS, JobRecord, JobRow, JobStore, TaskRow

pytestmark = pytest.mark.timeout(60)

REPORT = 'echo "$SKYPILOT_NUM_GPUS_PER_NODE ${TANDEM_GPU_TYPE:-none} $CUDA_VISIBLE_DEVICES" > OUT'


def task_file(accelerators: str, out: Path) -> str:
    """A one-task SkyPilot file asking `accelerators` whose run writes what it was given to `out`."""
    return f"name: pick\nresources:\n  accelerators: {accelerators}\nrun: {REPORT.replace('OUT', str(out))}\n"


class Recording(LocalBackend):
    """The local backend, keeping what each launch asked for (Slurm and Kubernetes turn the same
    `resources` into `--gres` and a pod's GPU limit and node selector)."""

    asked: list[Resources]

    async def launch(self, spec: LaunchSpec) -> Handle:
        self.asked.append(spec.resources)
        return await super().launch(spec)


@pytest.fixture
async def engines(tmp_path: Path) -> AsyncIterator[Callable[[int, str], Engine]]:
    """An engine over a local backend with the GPUs and GPU model given (settings, not a device probe)."""
    db = await open_database(f"sqlite:///{tmp_path / 'scheduler.db'}", "scheduler", MIGRATIONS)
    signer = TokenSigner(nacl.signing.SigningKey.generate())

    def make(gpus: int, gpu_type: str) -> Engine:
        backend = Recording(tmp_path / "local", gpus=gpus, gpu_type=gpu_type, cpus=4, memory_gib=8)
        backend.asked = []
        store = JobStore(db)
        return Engine(
            store, {"local": backend}, signer, EngineConfig(work_dir=tmp_path), EventOutbox(store, None, None)
        )

    yield make
    await db.close()


async def run_file(engine: Engine, name: str, text: str) -> JobRecord:
    """Submit a SkyPilot task file as CreateJob does (its admission check included) and run it to its end."""
    spec = parse_yaml(text)
    check_fits(spec, await engine.backends["local"].inventory())
    now = time.time()
    row = JobRow(name, "acme", spec.SerializeToString(), 0, "local", now, waiting_since=now)
    tasks = [TaskRow(name, t.name, i) for i, t in enumerate(spec.tasks)]
    record, _ = await engine.store.create(row, tasks, name, job_event(row, None)[2])
    await engine.submitted(record)
    deadline = time.monotonic() + 30
    while True:
        await engine.run_pass()
        record = await engine.store.get(name)
        if record.job.state in (JobState.SUCCEEDED, JobState.FAILED):
            return record
        assert time.monotonic() < deadline, (record.job.state, record.job.message)
        await asyncio.sleep(0.05)


async def test_the_first_alternative_the_nodes_satisfy_is_placed_and_reported(
    engines: Callable[[int, str], Engine], tmp_path: Path
) -> None:
    engine = engines(4, "NVIDIA-A100-SXM4-80GB")
    out = tmp_path / "chosen"
    text = task_file("[H100:8, A100:4, A100:2]", out)
    done = await run_file(engine, "orgs/acme/jobs/pick", text)
    assert done.job.state is JobState.SUCCEEDED, done.job.message
    assert out.read_text().split() == ["4", "A100", "0,1,2,3"]
    (node,) = done.attempts["pick"][0].nodes
    assert node["gpu_type"] == "A100" and node["gpu_indices"] == [0, 1, 2, 3]
    # The backend is asked for the choice placed, named as the nodes report their model.
    backend = engine.backends["local"]
    assert isinstance(backend, Recording)
    assert backend.asked == [Resources(gpus=4, gpu_type="NVIDIA-A100-SXM4-80GB", cpus=0.0, memory_gib=0.0)]


async def test_a_set_of_alternatives_keeps_its_written_order(
    engines: Callable[[int, str], Engine], tmp_path: Path
) -> None:
    engine = engines(8, "NVIDIA-H100-80GB-HBM3")
    out = tmp_path / "chosen"
    text = task_file("{L4:1, H100:2, H100:8}", out)
    done = await run_file(engine, "orgs/acme/jobs/set", text)
    assert done.job.state is JobState.SUCCEEDED, done.job.message
    assert out.read_text().split() == ["2", "H100", "0,1"]


async def test_a_gpu_named_as_skypilot_does_runs_on_nodes_reporting_the_full_model(
    engines: Callable[[int, str], Engine], tmp_path: Path
) -> None:
    # Accepted by the admission check and placed by the same rule: it no longer waits PENDING for good.
    engine = engines(8, "NVIDIA-H100-80GB-HBM3")
    out = tmp_path / "chosen"
    text = task_file("H100:8", out)
    done = await run_file(engine, "orgs/acme/jobs/whole", text)
    assert done.job.state is JobState.SUCCEEDED, done.job.message
    assert out.read_text().split() == ["8", "H100", "0,1,2,3,4,5,6,7"]

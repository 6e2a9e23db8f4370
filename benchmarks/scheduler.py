"""Scheduler benchmark: submit-to-running latency on the local backend beside spawning the same process
directly, and the time of one admission pass over 10,000 queued jobs beside sorting the same jobs.

Run from the repository root:

    .venv/bin/python benchmarks/scheduler.py            # 50 jobs, ~30 s
    .venv/bin/python benchmarks/scheduler.py --quick    # 10 jobs, < 15 s

a. Latency: the events service and the scheduler run in this process (`tests.support.mesh`, the shape of
   `tandem up`: SQLite with synchronous=FULL, interceptors, token auth) with the local backend. Jobs are
   submitted one at a time with CreateJob; each job's task is `date +%s.%N > FILE` and the latency is from
   just before the CreateJob call to the time the task wrote (the process really running, not a state
   read back). Baseline, in the same run: `asyncio.create_subprocess_exec("bash", "-c", <same script>)`,
   from just before the call to the time the script wrote. Goal: p50 <= 300 ms.
b. One pass: `lifecycle.admit` over 10,000 queued groups of mixed priorities (0..1000, one to three tasks of
   1 to 8 GPUs, 1 to 4 nodes) against 256 nodes of 8 GPUs, all but a few GPUs held (a busy cluster, where
   the pass orders the whole queue with aging and places groups until the first that waits). Baseline:
   `sorted()` of 10,000 (priority, seq) tuples. Goal: one pass <= 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.scheduler.v1 import job_spec_pb2, scheduler_service_pb2_grpc
from tandem.scheduler.v1 import scheduler_service_pb2 as pb

from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from services.scheduler import lifecycle as lc
from tests.support.mesh import mesh_settings, running_mesh


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def read_stamp(path: Path) -> str:
    return path.read_text().strip() if path.exists() else ""


async def wait_file(path: Path, timeout_s: float = 30.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        text = read_stamp(path)
        if text:
            return float(text)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was never written")
        await asyncio.sleep(0.002)


async def latency(jobs: int, root: Path) -> tuple[list[float], list[float]]:
    settings = mesh_settings(root / "state", log_level="WARNING")
    async with running_mesh(settings, services=["events", "scheduler"]) as mesh:
        token = TokenSigner(load_signing_key("", settings.state_dir)).issue(
            "user", "bench", org="bench", ttl_s=3600
        )
        channel = open_channel(mesh.address("scheduler"), settings, token=token)
        stub = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)
        scheduled: list[float] = []
        try:
            for n in range(jobs + 2):  # two warm-up jobs, not counted
                marker = root / f"job-{n}"
                task = job_spec_pb2.TaskSpec(
                    name="main", kind=job_spec_pb2.TaskSpec.KIND_COMMAND, run=f"date +%s.%N > {marker}"
                )
                started = time.time()
                await stub.CreateJob(
                    pb.CreateJobRequest(parent="orgs/bench", spec=job_spec_pb2.JobSpec(tasks=[task]))
                )
                ran = await wait_file(marker)
                if n >= 2:
                    scheduled.append(ran - started)
        finally:
            await channel.close()
    direct: list[float] = []
    for n in range(jobs + 2):
        marker = root / f"direct-{n}"
        started = time.time()
        process = await asyncio.create_subprocess_exec("bash", "-c", f"date +%s.%N > {marker}")
        ran = await wait_file(marker)
        await process.wait()
        if n >= 2:
            direct.append(ran - started)
    return scheduled, direct


def admission_pass(count: int, seed: int = 7) -> tuple[float, float, int]:
    rng = random.Random(seed)
    queue = []
    for seq in range(count):
        tasks = tuple(
            lc.Demand(
                f"t{i}", rng.choice((1, 1, 2, 4)), rng.choice((1, 2, 4, 8)), rng.choice((0, 4, 8)), 16.0
            )
            for i in range(rng.choice((1, 1, 2, 3)))
        )
        queue.append(
            lc.QueuedGroup(f"orgs/o/jobs/j{seq}", rng.randint(0, 1000), rng.uniform(0, 3600), seq, tasks)
        )

    def nodes() -> list[lc.NodeFree]:
        return [
            lc.NodeFree(
                f"n{i}", f"10.0.{i // 256}.{i % 256}", [7] if i % 16 == 0 else [], 64.0, 512.0, "H100"
            )
            for i in range(256)
        ]

    passes = []
    admitted = 0
    for _ in range(20):
        inventory = nodes()
        started = time.perf_counter()
        result = lc.admit(queue, inventory, now=3600.0)
        passes.append(time.perf_counter() - started)
        admitted = len(result.admitted)
    tuples = [(g.priority, g.seq) for g in queue]
    sorts = []
    for _ in range(20):
        started = time.perf_counter()
        sorted(tuples, key=lambda t: (-t[0], t[1]))
        sorts.append(time.perf_counter() - started)
    return statistics.median(passes), statistics.median(sorts), admitted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 jobs instead of 50")
    parser.add_argument("--jobs", type=int, default=0)
    args = parser.parse_args()
    jobs = args.jobs or (10 if args.quick else 50)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-scheduler-") as folder:
        scheduled, direct = asyncio.run(latency(jobs, Path(folder)))
    p50, p99 = percentile(scheduled, 0.5) * 1e3, percentile(scheduled, 0.99) * 1e3
    b50, b99 = percentile(direct, 0.5) * 1e3, percentile(direct, 0.99) * 1e3
    print(f"submit-to-running, local backend, {jobs} jobs one at a time")
    print(f"  scheduler   p50 {p50:8.1f} ms   p99 {p99:8.1f} ms   (goal p50 <= 300 ms)")
    print(f"  direct exec p50 {b50:8.1f} ms   p99 {b99:8.1f} ms")
    print(f"  ratio       p50 {p50 / b50:8.1f} x   p99 {p99 / b99:8.1f} x")
    one_pass, one_sort, admitted = admission_pass(10_000)
    print("one admission pass over 10,000 queued jobs, 256 nodes x 8 GPUs (busy)")
    print(f"  lifecycle.admit  {one_pass * 1e3:8.2f} ms   ({admitted} admitted; goal <= 50 ms)")
    print(f"  sorted() tuples  {one_sort * 1e3:8.2f} ms")
    print(f"  ratio            {one_pass / one_sort:8.1f} x")


if __name__ == "__main__":
    main()

"""Gateway benchmark: ListJobs of 50 jobs beside GetServerInfo at 16 concurrent callers, and ListJobs with two
gateway replicas on one address beside one, all in the same run.

Run from the repository root:

    .venv/bin/python benchmarks/gateway.py                # 4 rounds, 16 callers x 10 calls a phase, ~30 s
    .venv/bin/python benchmarks/gateway.py --quick        # 2 rounds, 16 callers x 5 calls a phase, ~20 s
    .venv/bin/python benchmarks/gateway.py --replicas 1   # without the scale-out phase

Processes, each a child of this one so that none shares the measuring client's event loop:

* the internal services (events, vault, taskapp-proxy, scheduler) in one process, as `tandem up` runs them
  (`mesh.server.serve`, embedded SQLite defaults, interceptors, token auth; `--serve-services` here);
* each gateway replica is `python -m gateway`, the deployment shape, all on one port with
  `TANDEM_GATEWAY_REUSE_PORT=1` (the kernel hands each new connection to one of them) and one state folder
  (mesh key, admin credential, the gateway's SQLite store). Rate limits are raised out of the way.

The client creates an organization and 50 jobs (a `true` command each, waited on until all have ended, so
every job has its task and attempt rows). Then each round runs three phases of 16 callers, each caller on a
connection of its own (a local subchannel pool, so that the kernel can spread them over replicas), calling
back to back with the organization's API key after two warm-up calls that are not counted:

1. GetServerInfo, one replica (public; the internal services' health cached 2 s): the baseline, a call that
   reads no store, through the same interceptors, the key's authentication included.
2. ListJobs of the organization's 50 jobs (one page, the default page size), one replica.
3. ListJobs again with a second replica started on the port for this phase (and stopped after it).

Rounds interleave the phases, so that a change in the machine's other load falls on all three alike.
Figures: p50 and p95 of each phase over all rounds, the ratio ListJobs p50 / GetServerInfo p50 (goal <= 3),
the ratio of ListJobs p50 with two replicas to one, how each round's connections fell over the replicas,
and the cores each process kept busy (the client is one Python process too; on a small machine it can
limit a figure itself, and with every process on two cores a second replica has no core of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from _children import Child, child_process, cpu_seconds, free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.gateway.v1 import gateway_service_pb2_grpc
from tandem.scheduler.v1 import job_pb2, job_spec_pb2

SCRIPT = Path(__file__).resolve()
INTERNAL = ("events", "vault", "taskapp_proxy", "scheduler")
ORG = "bench"
JOBS = 50
CALLERS = 16
START_TIMEOUT_S = 60.0
JOBS_TIMEOUT_S = 120.0
TERMINAL = (job_pb2.Job.STATE_SUCCEEDED, job_pb2.Job.STATE_FAILED, job_pb2.Job.STATE_CANCELLED)
Stub = gateway_service_pb2_grpc.GatewayServiceStub


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def serve_services() -> None:
    """`--serve-services`: the internal services in this process until SIGINT/SIGTERM."""
    from mesh.observability import configure_logging  # noqa: PLC0415 - the child alone needs the runtime
    from mesh.server import serve  # noqa: PLC0415
    from mesh.settings import Settings  # noqa: PLC0415

    settings = Settings()
    configure_logging(settings.log_level, settings.log_format)
    asyncio.run(serve(INTERNAL, settings))


def listening_sockets(pid: int, port: int) -> tuple[int, int]:
    """(listening, established) TCP sockets of process `pid` on local `port`, from /proc (Linux)."""
    inodes: dict[str, str] = {}  # socket inode -> state (0A: LISTEN, 01: ESTABLISHED)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes[fields[9]] = fields[3]
    listening = established = 0
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                state = inodes.get(link.removeprefix("socket:[").removesuffix("]"), "")
                listening += state == "0A"
                established += state == "01"
    return listening, established


async def wait_listening(child: Child, port: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while listening_sockets(child.proc.pid, port)[0] == 0:
        child.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{child.name} never listened on {port}:\n{child.tail()}")
        await asyncio.sleep(0.1)


def open_callers(address: str, count: int) -> list[grpc.aio.Channel]:
    # A local subchannel pool gives each channel a connection of its own (channels with the same arguments
    # otherwise share one), so the kernel can hand each to a different replica.
    return [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(count)
    ]


@dataclass
class Phase:
    """One kind of measurement, summed over the rounds."""

    name: str
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)
    spread: list[str] = field(default_factory=list)  # connections per replica, each round

    @property
    def p50(self) -> float:
        return percentile(self.latencies, 0.5) * 1e3

    @property
    def p95(self) -> float:
        return percentile(self.latencies, 0.95) * 1e3

    def cores(self) -> str:
        return ", ".join(f"{label} {cpu / self.wall_s:.2f}" for label, cpu in self.cpu_s.items())


async def run_phase(
    phase: Phase,
    address: str,
    call: Callable[[Stub], Awaitable[Any]],
    calls: int,
    processes: dict[str, int | None],
) -> list[grpc.aio.Channel]:
    """`calls` calls by each of CALLERS callers, on fresh connections, added to `phase`; returns the
    channels, still open (the caller counts their connections per replica, then closes them)."""
    channels = open_callers(address, CALLERS)
    stubs = [Stub(channel) for channel in channels]
    await asyncio.gather(*(call(stub) for stub in stubs for _ in range(2)))  # warm-up, not counted

    async def caller(stub: Stub) -> None:
        for _ in range(calls):
            started = time.perf_counter()
            await call(stub)
            phase.latencies.append(time.perf_counter() - started)

    before = {label: cpu_seconds(pid) for label, pid in processes.items()}
    started = time.perf_counter()
    await asyncio.gather(*(caller(stub) for stub in stubs))
    phase.wall_s += time.perf_counter() - started
    for label, pid in processes.items():
        phase.cpu_s[label] = phase.cpu_s.get(label, 0.0) + cpu_seconds(pid) - before[label]
    return channels


async def close_all(channels: list[grpc.aio.Channel]) -> None:
    for channel in channels:
        await channel.close()


async def create_jobs(stub: Stub, metadata: tuple[tuple[str, str], ...]) -> None:
    task = job_spec_pb2.TaskSpec(name="main", kind=job_spec_pb2.TaskSpec.KIND_COMMAND, run="true")
    for n in range(JOBS):
        spec = job_spec_pb2.JobSpec(display_name=f"bench {n}", tasks=[task])
        request = pb.CreateJobRequest(parent=f"orgs/{ORG}", job_id=f"bench-{n:02d}", spec=spec)
        await stub.CreateJob(request, metadata=metadata, timeout=30)
    deadline = time.monotonic() + JOBS_TIMEOUT_S
    while True:
        jobs = (await stub.ListJobs(pb.ListJobsRequest(parent=f"orgs/{ORG}"), metadata=metadata)).jobs
        if len(jobs) == JOBS and all(job.state in TERMINAL for job in jobs):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{sum(j.state in TERMINAL for j in jobs)} of {JOBS} jobs ended")
        await asyncio.sleep(0.5)


def child_env(root: Path, ports: dict[str, int]) -> dict[str, str]:
    env = {
        **os.environ,
        "TANDEM_STATE_DIR": str(root / "state"),
        "TANDEM_LOG_LEVEL": "WARNING",
        "TANDEM_GATEWAY_RATE_PER_S": "1000000",
        "TANDEM_GATEWAY_RATE_BURST": "1000000",
        "TANDEM_GATEWAY_REUSE_PORT": "1",
        "TANDEM_SCHEDULER_LOCAL__CPUS": "8",
        "TANDEM_SCHEDULER_LOCAL__MEMORY_GIB": "16",
    }
    env.pop("TANDEM_CONFIG", None)
    env.update({f"TANDEM_PORTS__{name.upper()}": str(port) for name, port in ports.items()})
    return env


@contextlib.contextmanager
def gateway_replica(index: int, env: dict[str, str], root: Path, port: int) -> Iterator[Child]:
    argv = [sys.executable, "-m", "gateway"]
    with child_process(f"gateway-{index}", argv, env, root, port=port) as child:
        yield child


async def measure(root: Path, rounds: int, calls: int, replicas: int) -> list[Phase]:
    ports = {name: free_port() for name in (*INTERNAL, "gateway")}
    env = child_env(root, ports)
    address = f"127.0.0.1:{ports['gateway']}"
    info, listed = Phase("GetServerInfo, 1 replica"), Phase("ListJobs, 1 replica")
    scaled = Phase(f"ListJobs, {replicas} replicas")
    with contextlib.ExitStack() as stack:
        argv = [sys.executable, str(SCRIPT), "--serve-services"]
        services = stack.enter_context(child_process("services", argv, env, root))
        await wait_listening(services, ports["scheduler"])
        first = stack.enter_context(gateway_replica(1, env, root, ports["gateway"]))
        await wait_listening(first, ports["gateway"])
        admin_key = (root / "state" / "admin.key").read_text().strip()
        setup = open_callers(address, 1)[0]
        stub = Stub(setup)
        made = await stub.CreateOrg(
            pb.CreateOrgRequest(org_id=ORG), metadata=(("authorization", f"Bearer {admin_key}"),), timeout=30
        )
        metadata = (("authorization", f"Bearer {made.key}"),)
        await create_jobs(stub, metadata)
        await setup.close()

        async def server_info(stub: Stub) -> None:
            await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=metadata, timeout=30)

        async def list_jobs(stub: Stub) -> None:
            reply = await stub.ListJobs(
                pb.ListJobsRequest(parent=f"orgs/{ORG}"), metadata=metadata, timeout=30
            )
            assert len(reply.jobs) == JOBS

        processes: dict[str, int | None] = {
            "client": None,
            "services": services.proc.pid,
            first.name: first.proc.pid,
        }
        # Rounds interleave the phases, so that a change in the machine's other load falls on all of them.
        for _ in range(rounds):
            await close_all(await run_phase(info, address, server_info, calls, processes))
            await close_all(await run_phase(listed, address, list_jobs, calls, processes))
            if replicas < 2:
                continue
            with contextlib.ExitStack() as more:
                children = [first]
                for index in range(2, replicas + 1):
                    child = more.enter_context(gateway_replica(index, env, root, ports["gateway"]))
                    await wait_listening(child, ports["gateway"])
                    children.append(child)
                everyone = {**processes, **{c.name: c.proc.pid for c in children}}
                channels = await run_phase(scaled, address, list_jobs, calls, everyone)
                spread = [listening_sockets(c.proc.pid, ports["gateway"])[1] for c in children]
                scaled.spread.append("/".join(map(str, spread)))
                await close_all(channels)
    return [info, listed, scaled] if replicas > 1 else [info, listed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 5 calls per caller, not 4 of 10")
    parser.add_argument("--calls", type=int, default=0, help="calls per caller in each phase of a round")
    parser.add_argument("--replicas", type=int, default=2, help="gateway replicas in the scale-out phase")
    parser.add_argument("--serve-services", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_services:
        serve_services()
        return
    rounds = 2 if args.quick else 4
    calls = args.calls or (5 if args.quick else 10)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-gateway-") as folder:
        phases = asyncio.run(measure(Path(folder), rounds, calls, args.replicas))
    print(
        f"gateway, {CALLERS} concurrent callers, {rounds} rounds x {calls} calls each a phase,"
        f" ListJobs of {JOBS} jobs, {os.cpu_count()} cores"
    )
    for phase in phases:
        spread = f"   (connections per replica: {', '.join(phase.spread)})" if phase.spread else ""
        print(f"  {phase.name}{spread}")
        print(f"    p50 {phase.p50:8.1f} ms   p95 {phase.p95:8.1f} ms   cores busy: {phase.cores()}")
    info, listed = phases[0], phases[1]
    print(f"  ratio ListJobs / GetServerInfo        p50 {listed.p50 / info.p50:6.2f} x   (goal <= 3 x)")
    for phase in phases[2:]:
        print(f"  ratio ListJobs {args.replicas} replicas / 1 replica  p50 {phase.p50 / listed.p50:6.2f} x")


if __name__ == "__main__":
    main()

"""Task App proxy benchmark: rollouts per second and the latency the proxy adds, beside the same trivial
Task App called directly over HTTP in the same run, at 1, 16 and 256 concurrent rollouts.

Run from the repository root:

    .venv/bin/python benchmarks/taskapp_proxy.py                 # ~70 s
    .venv/bin/python benchmarks/taskapp_proxy.py --quick         # smoke run, < 30 s
    .venv/bin/python benchmarks/taskapp_proxy.py --profile-mesh /tmp/mesh.pstats   # + cProfile of the mesh

Two servers run as child processes, so neither shares an event loop or a GIL with the client (this process):

* the Task App: `python benchmarks/taskapp_proxy.py --serve-app PORT KEY`, a minimal Starlette app under
  uvicorn that answers `/health`, `/task_info` and `POST /rollout`; a rollout checks `X-API-Key`, parses
  the body and answers at once with a valid result (one-turn trajectory, reward 1.0) echoing the episode's
  `trace_correlation_id`.
* the mesh: `python -m gateway.cli up` (events, vault, taskapp_proxy, scheduler, gateway in one process,
  the shape a user runs) on free ports with a fresh state folder, conformance checks on registration
  switched off (`TANDEM_TASKAPP_CHECK_ON_REGISTER=false`) and audit forwarding off
  (`TANDEM_VAULT_FORWARD_AUDIT=false`). The app's key is uploaded to the vault sealed to the org key (a
  `user` token of org `bench`), and the app is registered through the proxy with max_concurrency 4096 and
  a 30 s rollout timeout; the proxy reads the key from the vault by runtime injection, as in deployment.

For each concurrency c, c loops in this process run rollouts back to back (closed loop), each with a fresh
correlation id, for a short warm-up that is not counted and then a measured window:

* direct: POST /rollout on one shared `httpx.AsyncClient` (1,024 connections, as the proxy) with the key and
  the very JSON body the proxy sends (`spec_json` of the same RolloutSpec); the answer is parsed and its
  echoed correlation id checked. The goals are judged against this path, a researcher's usual client.
* app capacity: the same call on one aiohttp session made as the proxy makes its own
  (`rollouts.http_session`). aiohttp costs this client far less CPU per call than httpx, so at 16 and 256
  this is the app's own rate, which httpx's one process cannot reach: the ratio against it says how much of
  what the app can serve the proxy passes on. Reported, not judged.
* proxy: `TaskAppService.Rollout` on one gRPC channel with a `job` token of org bench that names the app
  (as the scheduler's token for a job whose config names it), the request naming the job (so the proxy
  also records a `rollout.completed` event per rollout, as for a trainer); a result carrying an error
  counts as a failure.

The paths alternate in rounds at each concurrency (summed), so slow drifts of the shared machine
touch both columns alike. Rollouts/s counts rollouts completed in the measured windows; the latency of a
rollout is its wall time in the client, and added p50/p99 is the proxy's percentile minus the direct one at
the same concurrency. Goals (from the issue): added p50 <= 2 ms, judged at 1 concurrent rollout, where it is
the proxy's own cost (in a closed loop at higher concurrency latency is concurrency / throughput, so there it
restates the throughput ratio: reported, not judged); proxy throughput >= 0.7x direct at 16 and 256.

Under the table: the cores the client, the app and the mesh kept busy in each measured window, and the
process that was at a core, i.e. the one that limited a figure (one Python process cannot use much more than
one core; on a 2-core machine the proxy path runs three busy processes where the direct path runs two), and
the CPU time the app and the mesh spent per completed rollout, which other work on a shared machine moves
far less than it moves the rates. When
the direct path is limited by this client, the direct figure is httpx's limit rather than the app's: the
ratio then compares the proxy with httpx (the proxy itself calls the app through aiohttp). The 1-minute load
average before and after tells whether other work shared the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import math
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import httpx
import nacl.signing
from _children import Child, child_process, cpu_seconds, free_port
from google.protobuf import duration_pb2
from tandem.taskapp.v1 import rollout_pb2, task_app_pb2, taskapp_service_pb2, taskapp_service_pb2_grpc
from tandem.vault.v1 import vault_service_pb2, vault_service_pb2_grpc

from mesh.identity import TokenSigner
from mesh.launcher import MESH_SERVICES
from mesh.secrets import seal_for_upload
from services.taskapp_proxy.rollouts import http_session, spec_json

pb = taskapp_service_pb2
SCRIPT = Path(__file__).resolve()
ORG = "bench"
APP_ID = "trivial"
APP_NAME = f"orgs/{ORG}/taskApps/{APP_ID}"
KEY_SECRET_NAME = f"orgs/{ORG}/secrets/env-key"  # the vault secret holding the app's key
JOB = f"orgs/{ORG}/jobs/bench-rollouts"
READY_LINE = "Press Ctrl-C to stop."
START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 30.0
HTTP_LIMITS = httpx.Limits(max_connections=1024, max_keepalive_connections=256)  # as many as the proxy
PROCESSES = ("client", "app", "mesh")
BUSY_CORES = 0.8  # a process this busy is at its limit: one Python process cannot use much more than one core
Metadata = tuple[tuple[str, str], ...]
Call = Callable[[str], Awaitable[None]]
PATH_ERRORS = (
    grpc.aio.AioRpcError,
    httpx.HTTPError,
    aiohttp.ClientError,
    TimeoutError,
    RuntimeError,
    ValueError,
)


@dataclass(frozen=True)
class Plan:
    warmup_s: float
    window_s: float
    rounds: int
    concurrencies: tuple[int, ...] = (1, 16, 256)


FULL = Plan(warmup_s=0.5, window_s=4.0, rounds=2)
QUICK = Plan(warmup_s=0.2, window_s=1.2, rounds=1)


# ---- the trivial Task App -----------------------------------------------------------------------------


def trivial_app(key: str) -> Any:
    from starlette.applications import Starlette  # noqa: PLC0415 - only the app child needs them
    from starlette.requests import Request  # noqa: PLC0415
    from starlette.responses import JSONResponse, Response  # noqa: PLC0415
    from starlette.routing import Route  # noqa: PLC0415

    expected = key.encode()
    unauthorized = {"error": {"code": "unauthorized", "message": "missing or wrong key"}}

    def authorized(request: Request) -> bool:
        return hmac.compare_digest(request.headers.get("x-api-key", "").encode(), expected)

    async def health(request: Request) -> Response:
        return JSONResponse({"healthy": True})

    async def task_info(request: Request) -> Response:
        if not authorized(request):
            return JSONResponse(unauthorized, 401)
        return JSONResponse(
            {"task": {"name": "bench-trivial"}, "seed": int(request.query_params.get("seed", 0))}
        )

    async def rollout(request: Request) -> Response:
        if not authorized(request):
            return JSONResponse(unauthorized, 401)
        body = await request.json()
        return JSONResponse(
            {
                "trace_correlation_id": body["trace_correlation_id"],
                "metrics": {"outcome_reward": 1.0, "event_rewards": [1.0]},
                "trajectory": {
                    "turns": [
                        {
                            "messages": [
                                {"role": "user", "content": "2+2?"},
                                {"role": "assistant", "content": "4"},
                            ]
                        }
                    ]
                },
                "aborted": False,
            }
        )

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/task_info", task_info),
            Route("/rollout", rollout, methods=["POST"]),
        ]
    )


def serve_app(port: int, key: str) -> None:
    import uvicorn  # noqa: PLC0415

    uvicorn.run(
        trivial_app(key),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=300,  # idle pooled connections stay open between measurements
    )


# ---- child processes ----------------------------------------------------------------------------------


def mesh_env(state_dir: Path, seed_hex: str) -> tuple[dict[str, str], dict[str, int]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    ports = {name: free_port() for name in MESH_SERVICES}
    env.update({f"TANDEM_PORTS__{name.upper()}": str(port) for name, port in ports.items()})
    env.update(
        TANDEM_STATE_DIR=str(state_dir),
        TANDEM_MESH_KEY=seed_hex,
        TANDEM_DRAIN_GRACE_S="1",
        TANDEM_TASKAPP_CHECK_ON_REGISTER="false",
        TANDEM_VAULT_FORWARD_AUDIT="false",
    )
    return env, ports


async def wait_for_mesh(mesh: Child) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while READY_LINE not in mesh.log():
        mesh.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the mesh did not start within {START_TIMEOUT_S:.0f} s:\n{mesh.tail()}")
        await asyncio.sleep(0.1)


async def wait_for_app(app: Child, http: httpx.AsyncClient, url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        app.check_alive()
        with contextlib.suppress(httpx.HTTPError):
            if (await http.get(f"{url}/health", timeout=1.0)).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Task App did not answer within {START_TIMEOUT_S:.0f} s:\n{app.tail()}")
        await asyncio.sleep(0.05)


# ---- setup through the mesh ---------------------------------------------------------------------------


def bearer(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),)


async def upload_key_and_register(ports: dict[str, int], signer: TokenSigner, app_url: str, key: str) -> None:
    """The app's key into the vault, sealed to the org key; the app registered through the proxy."""
    user = bearer(signer.issue("user", "bench-admin", org=ORG, ttl_s=600))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['vault']}") as channel:
        vault = vault_service_pb2_grpc.VaultServiceStub(channel)
        org_key = await vault.GetPublicKey(
            vault_service_pb2.GetPublicKeyRequest(parent=f"orgs/{ORG}"), metadata=user, timeout=CALL_TIMEOUT_S
        )
        await vault.PutSecret(
            vault_service_pb2.PutSecretRequest(
                parent=f"orgs/{ORG}",
                secret_id=KEY_SECRET_NAME.rsplit("/", 1)[1],
                key_id=org_key.key_id,
                ciphertext=seal_for_upload(org_key.public_key, key.encode()),
            ),
            metadata=user,
            timeout=CALL_TIMEOUT_S,
        )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['taskapp_proxy']}") as channel:
        proxy = taskapp_service_pb2_grpc.TaskAppServiceStub(channel)
        await proxy.RegisterTaskApp(
            pb.RegisterTaskAppRequest(
                parent=f"orgs/{ORG}",
                task_app_id=APP_ID,
                task_app=task_app_pb2.TaskApp(
                    base_url=app_url,
                    secret_name=KEY_SECRET_NAME,
                    limits=task_app_pb2.TaskAppLimits(
                        max_concurrency=4096, rollout_timeout=duration_pb2.Duration(seconds=30)
                    ),
                ),
            ),
            metadata=user,
            timeout=CALL_TIMEOUT_S,
        )


# ---- the two paths ------------------------------------------------------------------------------------


def rollout_spec(correlation: str = "") -> rollout_pb2.RolloutSpec:
    return rollout_pb2.RolloutSpec(
        trace_correlation_id=correlation,
        env=rollout_pb2.RolloutEnv(seed=7),
        policy=rollout_pb2.RolloutPolicy(
            config=rollout_pb2.RolloutPolicyConfig(
                model="policy", inference_url="http://127.0.0.1:9/v1/episodes/bench"
            )
        ),
    )


class Direct:
    """POST /rollout straight to the app, with the body and headers the proxy would send, on one httpx client
    (`Capacity`: on one aiohttp session)."""

    name = "direct"

    def __init__(self, http: httpx.AsyncClient | aiohttp.ClientSession, url: str, key: str) -> None:
        self._http = http
        self._url = f"{url}/rollout"
        self._key = key
        self._body = spec_json(rollout_spec("template"))

    async def __call__(self, correlation: str) -> None:
        body = json.dumps({**self._body, "trace_correlation_id": correlation}).encode()
        headers = {
            "Content-Type": "application/json",
            "X-API-Key": self._key,
            "X-Trace-Correlation-Id": correlation,
        }
        status, content = await self._post(body, headers)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {content[:200]!r}")
        echoed = json.loads(content).get("trace_correlation_id")
        if echoed != correlation:
            raise RuntimeError(f"answer for {echoed!r}, not {correlation!r}")

    async def _post(self, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        assert isinstance(self._http, httpx.AsyncClient)
        response = await self._http.post(self._url, content=body, headers=headers, timeout=CALL_TIMEOUT_S)
        return response.status_code, response.content


class Capacity(Direct):
    """The same call on the proxy's own kind of aiohttp session: what the app serves a cheap client."""

    name = "capacity"

    async def _post(self, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        assert isinstance(self._http, aiohttp.ClientSession)
        async with (
            asyncio.timeout(CALL_TIMEOUT_S),
            self._http.post(self._url, data=body, headers=headers) as response,
        ):
            return response.status, await response.read()


class Proxied:
    """TaskAppService.Rollout on one gRPC channel, as a trainer's job calls it."""

    name = "proxy"

    def __init__(self, channel: grpc.aio.Channel, metadata: Metadata) -> None:
        self._stub = taskapp_service_pb2_grpc.TaskAppServiceStub(channel)
        self._metadata = metadata

    async def __call__(self, correlation: str) -> None:
        reply: pb.RolloutResponse = await self._stub.Rollout(
            pb.RolloutRequest(task_app=APP_NAME, spec=rollout_spec(correlation), job=JOB),
            metadata=self._metadata,
            timeout=CALL_TIMEOUT_S,
        )
        result = reply.result
        if result.HasField("error"):
            kind = rollout_pb2.RolloutError.Kind.Name(result.error.kind)
            raise RuntimeError(f"{kind}: {result.error.message}")
        if result.trace_correlation_id != correlation:
            raise RuntimeError(f"result for {result.trace_correlation_id!r}, not {correlation!r}")


# ---- measurement --------------------------------------------------------------------------------------


@dataclass
class Sample:
    """Rollouts completed in measured windows, their latencies (s), and CPU seconds spent meanwhile."""

    completed: int = 0
    window_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds in the windows

    @property
    def per_s(self) -> float:
        return self.completed / self.window_s if self.window_s else math.nan

    def percentile_ms(self, fraction: float) -> float:
        ordered = sorted(self.latencies)
        if not ordered:
            return math.nan
        return 1000 * ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]

    def cores(self, process: str) -> float:
        return self.cpu.get(process, math.nan) / self.window_s if self.window_s else math.nan

    def cpu_ms_per_rollout(self, process: str) -> float:
        return 1000 * self.cpu.get(process, math.nan) / self.completed if self.completed else math.nan


async def closed_loop(
    call: Call, concurrency: int, plan: Plan, prefix: str, pids: dict[str, int | None], into: Sample
) -> None:
    """`concurrency` loops of back-to-back calls: a warm-up, then one measured window added to `into`."""
    start = time.perf_counter()
    measure_from = start + plan.warmup_s
    end = measure_from + plan.window_s

    async def worker(index: int) -> None:
        n = 0
        while (began := time.perf_counter()) < end:
            n += 1
            try:
                await call(f"{prefix}-{index}-{n}")
            except PATH_ERRORS as error:
                into.errors += 1
                into.first_error = into.first_error or f"{type(error).__name__}: {error}"[:300]
                await asyncio.sleep(0.01)  # a failing path must not spin
                continue
            done = time.perf_counter()
            if measure_from <= done <= end:
                into.completed += 1
                into.latencies.append(done - began)

    async def meter() -> None:
        await asyncio.sleep(max(0.0, measure_from - time.perf_counter()))
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        for name, pid in pids.items():
            into.cpu[name] = into.cpu.get(name, 0.0) + cpu_seconds(pid) - before[name]

    await asyncio.gather(meter(), *(worker(i) for i in range(concurrency)))
    into.window_s += plan.window_s


@dataclass
class Row:
    concurrency: int
    direct: Sample
    proxy: Sample
    capacity: Sample


async def measure(
    paths: Sequence[Direct | Proxied], plan: Plan, pids: dict[str, int | None], run: str
) -> list[Row]:
    rows = []
    for concurrency in plan.concurrencies:
        samples = {path.name: Sample() for path in paths}
        for round_ in range(plan.rounds):
            for path in paths if round_ % 2 == 0 else reversed(paths):
                print(f"  {concurrency:>3} concurrent, {path.name}, round {round_ + 1} ...", flush=True)
                prefix = f"{run}-{path.name}-c{concurrency}-r{round_}"
                await closed_loop(path, concurrency, plan, prefix, pids, samples[path.name])
        rows.append(Row(concurrency, samples["direct"], samples["proxy"], samples["capacity"]))
    return rows


# ---- the report ---------------------------------------------------------------------------------------


def number(value: float, digits: int = 0) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.{digits}f}"


def pair(first: float, second: float, signed: bool = False) -> str:
    form = "{:+.2f}" if signed else "{:.2f}"
    if math.isnan(first) or math.isnan(second):
        return "n/a"
    return f"{form.format(first)} / {form.format(second)}"


def verdict(value: float, met: bool) -> str:
    return "n/a" if math.isnan(value) else "met" if met else "MISSED"


def goal(row: Row, ratio: float, added_p50: float) -> str:
    if row.concurrency == 1:
        return f"added p50 <= 2 ms: {verdict(added_p50, added_p50 <= 2.0)}"
    return f"ratio >= 0.7x: {verdict(ratio, ratio >= 0.7)}"


def limiter(sample: Sample) -> str:
    """The process that kept (nearly) a core busy, i.e. the one that limited a closed loop's rate."""
    busiest = max(PROCESSES, key=lambda name: -1.0 if math.isnan(sample.cores(name)) else sample.cores(name))
    return busiest if sample.cores(busiest) >= BUSY_CORES else "none at a core"


def report(rows: Sequence[Row], plan: Plan, elapsed_s: float, load: tuple[float, float]) -> str:
    table = [
        (
            "concurrency",
            "direct rollouts/s",
            "proxy rollouts/s",
            "ratio",
            "direct p50/p99 ms",
            "proxy p50/p99 ms",
            "added p50/p99 ms",
            "goal",
            "app capacity rollouts/s",
            "proxy / capacity",
        )
    ]
    for row in rows:
        d, p = row.direct, row.proxy
        ratio = p.per_s / d.per_s if d.per_s else math.nan
        of_capacity = p.per_s / row.capacity.per_s if row.capacity.per_s else math.nan
        d50, d99, p50, p99 = (
            d.percentile_ms(0.5),
            d.percentile_ms(0.99),
            p.percentile_ms(0.5),
            p.percentile_ms(0.99),
        )
        table.append(
            (
                str(row.concurrency),
                number(d.per_s),
                number(p.per_s),
                "n/a" if math.isnan(ratio) else f"{ratio:.2f}x",
                pair(d50, d99),
                pair(p50, p99),
                pair(p50 - d50, p99 - d99, signed=True),
                goal(row, ratio, p50 - d50),
                number(row.capacity.per_s),
                "n/a" if math.isnan(of_capacity) else f"{of_capacity:.2f}x",
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = [
        " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in table
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    lines += [
        "",
        f"{os.cpu_count()} cores; {plan.rounds} x {plan.window_s:.1f} s measured per cell after "
        f"{plan.warmup_s:.1f} s warm-ups; run took {elapsed_s:.0f} s; load average (1 min) before/after "
        f"{load[0]:.2f}/{load[1]:.2f}" + ("; --quick: short windows, rough figures" if plan is QUICK else ""),
        "cores busy, client/app/mesh, direct vs proxy vs capacity: "
        + "; ".join(
            f"{row.concurrency}: "
            + " vs ".join(
                "/".join(number(s.cores(n), 2) for n in PROCESSES)
                for s in (row.direct, row.proxy, row.capacity)
            )
            for row in rows
        ),
        "CPU ms per rollout, app/mesh, direct vs proxy vs capacity: "
        + "; ".join(
            f"{row.concurrency}: "
            + " vs ".join(
                "/".join(number(s.cpu_ms_per_rollout(n), 2) for n in ("app", "mesh"))
                for s in (row.direct, row.proxy, row.capacity)
            )
            for row in rows
        ),
        f"limited by (the process at >= {BUSY_CORES} cores), direct vs proxy vs capacity: "
        + "; ".join(
            f"{row.concurrency}: {limiter(row.direct)} vs {limiter(row.proxy)} vs {limiter(row.capacity)}"
            for row in rows
        ),
    ]
    for row in rows:
        for sample, name in ((row.direct, "direct"), (row.proxy, "proxy"), (row.capacity, "capacity")):
            if sample.errors:
                lines.append(
                    f"{row.concurrency} concurrent, {name}: {sample.errors} failed calls, first: {sample.first_error}"
                )
    return "\n".join(lines)


# ---- the run ------------------------------------------------------------------------------------------


async def run_benchmark(plan: Plan, profile_path: Path | None) -> int:
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    seed = secrets.token_hex(32)
    signer = TokenSigner(nacl.signing.SigningKey(bytes.fromhex(seed)))
    key = secrets.token_urlsafe(24)
    run = f"r{secrets.token_hex(4)}"
    with tempfile.TemporaryDirectory(prefix="tandem-bench-taskapp-") as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp)
        app_port = free_port()
        app_url = f"http://127.0.0.1:{app_port}"
        app = stack.enter_context(
            child_process(
                "app",
                [sys.executable, str(SCRIPT), "--serve-app", str(app_port), key],
                dict(os.environ),
                folder,
            )
        )
        env, ports = mesh_env(folder / "state", seed)
        profiler = ["-m", "cProfile", "-o", str(profile_path)] if profile_path else []
        mesh = stack.enter_context(
            child_process("mesh", [sys.executable, *profiler, "-m", "gateway.cli", "up"], env, folder)
        )
        http = httpx.AsyncClient(limits=HTTP_LIMITS)
        session = http_session()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{ports['taskapp_proxy']}")
        try:
            await wait_for_app(app, http, app_url)
            await wait_for_mesh(mesh)
            print(f"Task App at {app_url}; mesh up (proxy at 127.0.0.1:{ports['taskapp_proxy']})", flush=True)
            await upload_key_and_register(ports, signer, app_url, key)
            job = bearer(signer.issue("job", JOB, org=ORG, ttl_s=3600, extra={"task_apps": [APP_NAME]}))
            paths: list[Direct | Proxied] = [
                Direct(http, app_url, key),
                Proxied(channel, job),
                Capacity(session, app_url, key),
            ]
            for path in paths:  # one call each, so a broken setup fails here with its own message
                try:
                    await path(f"{run}-{path.name}-first")
                except PATH_ERRORS as error:
                    raise RuntimeError(
                        f"{path.name}: the first rollout failed: {error}\n{mesh.tail()}"
                    ) from None
            pids: dict[str, int | None] = dict(
                zip(PROCESSES, (None, app.proc.pid, mesh.proc.pid), strict=True)
            )
            rows = await measure(paths, plan, pids, run)
        finally:
            await channel.close()
            await session.close()
            await http.aclose()
    print()
    print(report(rows, plan, time.perf_counter() - started, (load_before, os.getloadavg()[0])))
    if profile_path:
        print(f"mesh profile (cProfile, the whole mesh process): {profile_path}")
    return 1 if any(r.direct.errors or r.proxy.errors for r in rows) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="short windows for a smoke run (< 30 s)")
    parser.add_argument(
        "--profile-mesh",
        type=Path,
        metavar="FILE",
        help="run the mesh under cProfile and write its stats to FILE (slows the proxy: figures are not comparable)",
    )
    parser.add_argument("--serve-app", nargs=2, metavar=("PORT", "KEY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_app is not None:
        serve_app(int(args.serve_app[0]), args.serve_app[1])
        return 0
    # Ctrl-C and SIGTERM (also when started in the background, where SIGINT arrives ignored) unwind through
    # the `finally` blocks, which stop the child processes.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    profile = args.profile_mesh.resolve() if args.profile_mesh else None
    try:
        return asyncio.run(run_benchmark(QUICK if args.quick else FULL, profile))
    except KeyboardInterrupt:
        print("interrupted; the child processes were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

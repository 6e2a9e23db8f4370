"""Vault benchmark: sealed uploads and runtime injection through the vault, each beside a no-crypto,
no-storage echo baseline measured in the same run, and the in-process crypto floor.

Run from the repository root:

    .venv/bin/python benchmarks/vault.py                  # SQLite in a temporary folder, ~60 s
    .venv/bin/python benchmarks/vault.py --quick          # smoke run, < 20 s
    .venv/bin/python benchmarks/vault.py --store postgresql://user:pass@host/db

Two servers run as child processes, so neither shares an event loop or a GIL with the client (this process):

* vault: `python -m services.vault`, the deployment shape (interceptors, token auth, validation, tracing,
  request logging, the audit log, SQLite with synchronous=FULL by default), with its own master key
  generated into the temporary state folder. Copying audit records to the events service is switched off
  (`TANDEM_VAULT_FORWARD_AUDIT=false`): it runs beside the calls, not in them, and needs a mesh.
* baseline: `python benchmarks/vault.py --serve-baseline PORT`, a plain `grpc.aio` server with the same
  VaultService PutSecret and OpenSecrets that answers each call with a response of the vault's size built
  once (random bytes where the vault puts sealed values): no crypto, no storage, no auth, no interceptors.

Both are driven by the same client code: 16 concurrent callers over 4 connections, 64-byte values, requests
built before the clock starts (sealing happens outside the measured window, so the client spends its time on
the transport). Each measurement runs a short warm-up that is not counted, then counts calls completed in
its window. What is measured:

a. PutSecret: each call uploads a 64-byte value sealed to the org key, as a new secret (the vault opens it
   to check it and fingerprint it, seals it again, and commits the version and its audit record); uploads/s.
b. OpenSecrets: a job token declaring 8 secrets, a recipient key per call from a pool of ephemeral keys;
   1 secret per call and 8 secrets per call (the vault checks the token, opens each value and re-seals it
   to the recipient, and commits one audit record per secret); calls/s and secrets/s.
c. The crypto floor, in this process on one thread, with the vault's own `services.vault.crypto`: per
   injected secret, unwrap the org private key under the master key, open the stored value and seal it to
   a recipient; per upload, the same plus the fingerprint. Operations/s.

The ratio column is vault / baseline: the share of a plain gRPC call's rate the vault keeps. Under the table
come the p50 latency per call, the cores the client and the server kept busy (which side limited a figure;
one Python process cannot use much more than one core), and the crypto share: the crypto floor's CPU time
per operation over the vault server's CPU time per operation, i.e. how much of the vault's cost is crypto.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import nacl.public
import nacl.signing
from _children import Child, child_process, cpu_seconds, free_port, serve_until_signal
from google.protobuf import timestamp_pb2
from google.protobuf.message import Message
from tandem.vault.v1 import secret_pb2, vault_service_pb2, vault_service_pb2_grpc

from mesh.identity import TokenSigner
from services.vault import crypto

pb = vault_service_pb2
Stub = vault_service_pb2_grpc.VaultServiceStub
SCRIPT = Path(__file__).resolve()
ORG = "bench"
START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 30.0
RECIPIENT_STRIDE = 17  # spreads the callers' successive calls over the pool of recipient keys
Metadata = tuple[tuple[str, str], ...]
RequestFactory = Callable[[int, int], Message]


@dataclass(frozen=True)
class Plan:
    warmup_s: float
    measure_s: float
    crypto_s: float
    callers: int = 16
    channels: int = 4
    value_bytes: int = 64
    declared: int = 8
    recipients: int = 64


FULL = Plan(warmup_s=1.0, measure_s=6.0, crypto_s=3.0)
QUICK = Plan(warmup_s=0.3, measure_s=1.2, crypto_s=0.5)


# ---- the baseline server ------------------------------------------------------------------------------


def _stamp() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.GetCurrentTime()
    return stamp


class BaselineServicer(vault_service_pb2_grpc.VaultServiceServicer):
    """PutSecret and OpenSecrets answered with vault-sized responses built once: no crypto, no storage."""

    def __init__(self, value_bytes: int) -> None:
        name = f"orgs/{ORG}/secrets/baseline-secret"
        version = secret_pb2.SecretVersion(
            name=f"{name}/versions/1",
            version=1,
            state=secret_pb2.SecretVersion.STATE_ENABLED,
            fingerprint="b2-" + secrets.token_hex(16),
            key_id="k" + secrets.token_hex(8),
            create_time=_stamp(),
        )
        secret = secret_pb2.Secret(
            name=name, latest_version=version, version_count=1, create_time=_stamp(), update_time=_stamp()
        )
        self._put = pb.PutSecretResponse(created=True, version=version, secret=secret)
        self._sealed = os.urandom(value_bytes + crypto.SEAL_OVERHEAD)
        self._fingerprint = version.fingerprint

    async def PutSecret(
        self, request: pb.PutSecretRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PutSecretResponse:
        return self._put

    async def OpenSecrets(
        self, request: pb.OpenSecretsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.OpenSecretsResponse:
        return pb.OpenSecretsResponse(
            secrets=[
                pb.OpenSecretsResponse.SealedSecret(
                    secret=name, version=1, fingerprint=self._fingerprint, sealed_value=self._sealed
                )
                for name in request.secrets
            ]
        )


async def serve_baseline(port: int, value_bytes: int) -> None:
    server = grpc.aio.server()
    servicer = BaselineServicer(value_bytes)  # type: ignore[abstract]  # two methods are all it serves
    vault_service_pb2_grpc.add_VaultServiceServicer_to_server(servicer, server)
    await serve_until_signal(server, port)


# ---- child processes ----------------------------------------------------------------------------------


def vault_env(state_dir: Path, port: int, seed_hex: str, store_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(
        TANDEM_STATE_DIR=str(state_dir),
        TANDEM_PORTS__VAULT=str(port),
        TANDEM_MESH_KEY=seed_hex,
        TANDEM_DRAIN_GRACE_S="1",
        # The vault alone: no copying of audit records to an events service (off the request path anyway),
        # and the events port it would dial is a free one, so no other mesh on this machine is reached.
        TANDEM_VAULT_FORWARD_AUDIT="false",
        TANDEM_PORTS__EVENTS=str(free_port()),
    )
    if store_url:
        env["TANDEM_STORE_URL"] = store_url
    return env


# ---- client side --------------------------------------------------------------------------------------


class Target:
    """One server as the client sees it: stubs on a few connections of their own."""

    def __init__(self, name: str, child: Child, plan: Plan) -> None:
        self.name = name
        self.child = child
        options = [("grpc.use_local_subchannel_pool", 1)]
        address = f"127.0.0.1:{child.port}"
        self.channels = [grpc.aio.insecure_channel(address, options) for _ in range(plan.channels)]
        self.stubs = [Stub(c) for c in self.channels]

    async def wait_ready(self, metadata: Metadata) -> None:
        """Until the server answers a call (for the vault, GetPublicKey also creates the org's key)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.child.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.child.proc.returncode}):\n{self.child.tail()}")
            try:
                if self.name == "vault":
                    await self.stubs[0].GetPublicKey(
                        pb.GetPublicKeyRequest(parent=f"orgs/{ORG}"),
                        metadata=metadata,
                        timeout=1.0,
                        wait_for_ready=True,
                    )
                else:
                    await self.stubs[0].OpenSecrets(
                        pb.OpenSecretsRequest(
                            secrets=[f"orgs/{ORG}/secrets/x"], recipient_public_key=bytes(32)
                        ),
                        timeout=1.0,
                        wait_for_ready=True,
                    )
                return
            except grpc.aio.AioRpcError as error:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} did not answer: {error}\n{self.child.tail()}") from None

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


@dataclass
class Rate:
    """One load measurement: completed calls per second, p50 latency, cores busy on each side."""

    calls_per_s: float
    p50_ms: float
    client_cores: float
    server_cores: float


async def measure_load(
    target: Target, plan: Plan, method: str, make: RequestFactory, metadata: Metadata
) -> Rate:
    """`plan.callers` callers send back to back for warm-up + window; only the window is counted."""
    counting = False
    stop = False
    done = 0
    latencies: list[float] = []

    async def caller(index: int) -> None:
        nonlocal done
        call = getattr(target.stubs[index % len(target.stubs)], method)
        sequence = 0
        while not stop:
            request = make(index, sequence)
            sequence += 1
            started = time.perf_counter()
            await call(request, metadata=metadata, timeout=CALL_TIMEOUT_S)
            if counting:
                done += 1
                latencies.append(time.perf_counter() - started)

    tasks = [asyncio.create_task(caller(i)) for i in range(plan.callers)]
    try:
        await asyncio.sleep(plan.warmup_s)
        for task in tasks:
            if task.done():
                task.result()  # a caller failed during the warm-up: raise its error
        pid = target.child.proc.pid
        counting = True
        wall, client, server = time.perf_counter(), cpu_seconds(), cpu_seconds(pid)
        await asyncio.sleep(plan.measure_s)
        counting = False
        elapsed = time.perf_counter() - wall
        client_cores = (cpu_seconds() - client) / elapsed
        server_cores = (cpu_seconds(pid) - server) / elapsed
        completed = done
        stop = True
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    ordered = sorted(latencies)
    p50 = ordered[len(ordered) // 2] * 1000 if ordered else math.nan
    return Rate(completed / elapsed, p50, client_cores, server_cores)


@dataclass
class Workload:
    """Requests for both servers, built before the clock starts."""

    put_metadata: Metadata
    job_metadata: Metadata
    job_token: str
    sealed: list[bytes]
    key_id: str
    names: list[str]
    recipients: list[nacl.public.PrivateKey]
    put_run: str = field(default_factory=lambda: secrets.token_hex(3))

    def put(self, caller: int, sequence: int) -> pb.PutSecretRequest:
        return pb.PutSecretRequest(
            parent=f"orgs/{ORG}",
            secret_id=f"u{self.put_run}-{caller}-{sequence}",
            key_id=self.key_id,
            ciphertext=self.sealed[(caller * 7919 + sequence) % len(self.sealed)],
        )

    def opener(self, count: int) -> RequestFactory:
        keys = [bytes(k.public_key) for k in self.recipients]

        def make(caller: int, sequence: int) -> pb.OpenSecretsRequest:
            first = caller % len(self.names)
            names = [self.names[(first + i) % len(self.names)] for i in range(count)]
            return pb.OpenSecretsRequest(
                job_token=self.job_token,
                secrets=names,
                recipient_public_key=keys[(caller + sequence * RECIPIENT_STRIDE) % len(keys)],
            )

        return make


async def prepare(
    vault: Target, plan: Plan, signer: TokenSigner, put_metadata: Metadata
) -> tuple[Workload, dict[str, bytes]]:
    """The org key, a pool of sealed values, `plan.declared` stored secrets and a job token declaring them.
    Returns the workload and the stored plaintexts (to check one injection before measuring)."""
    stub = vault.stubs[0]
    key = await stub.GetPublicKey(pb.GetPublicKeyRequest(parent=f"orgs/{ORG}"), metadata=put_metadata)
    sealed = [crypto.seal(key.public_key, os.urandom(plan.value_bytes)) for _ in range(256)]
    values: dict[str, bytes] = {}
    for index in range(plan.declared):
        secret_id = f"declared-{index}"
        value = os.urandom(plan.value_bytes)
        await stub.PutSecret(
            pb.PutSecretRequest(
                parent=f"orgs/{ORG}",
                secret_id=secret_id,
                key_id=key.key_id,
                ciphertext=crypto.seal(key.public_key, value),
            ),
            metadata=put_metadata,
        )
        values[f"orgs/{ORG}/secrets/{secret_id}"] = value
    names = list(values)
    job = signer.issue("job", f"orgs/{ORG}/jobs/bench", org=ORG, ttl_s=3600, extra={"secrets": names})
    workload = Workload(
        put_metadata=put_metadata,
        job_metadata=(("authorization", f"Bearer {job}"),),
        job_token=job,
        sealed=sealed,
        key_id=key.key_id,
        names=names,
        recipients=[nacl.public.PrivateKey.generate() for _ in range(plan.recipients)],
    )
    return workload, values


async def check_injection(vault: Target, workload: Workload, values: dict[str, bytes]) -> None:
    """One real injection, opened with the recipient's private key, before anything is timed."""
    recipient = workload.recipients[0]
    reply = await vault.stubs[0].OpenSecrets(
        pb.OpenSecretsRequest(
            job_token=workload.job_token,
            secrets=workload.names,
            recipient_public_key=bytes(recipient.public_key),
        ),
        metadata=workload.job_metadata,
    )
    box = nacl.public.SealedBox(recipient)
    opened = {s.secret: box.decrypt(s.sealed_value) for s in reply.secrets}
    if opened != values:
        raise RuntimeError("OpenSecrets returned values that differ from the ones uploaded")


# ---- the crypto floor ---------------------------------------------------------------------------------


def crypto_floor(plan: Plan) -> tuple[float, float]:
    """(inject, upload) operations per second on this thread, with the vault's own crypto calls."""
    master = crypto.MasterKey(os.urandom(32))
    private, public = crypto.new_key_pair()
    boxed = master.wrap(private)
    stored = crypto.seal(public, os.urandom(plan.value_bytes))
    recipients = [bytes(nacl.public.PrivateKey.generate().public_key) for _ in range(plan.recipients)]

    def inject(i: int) -> None:
        value = crypto.unseal(master.unwrap(boxed), stored)
        crypto.seal(recipients[i % len(recipients)], value)

    def upload(i: int) -> None:
        value = crypto.unseal(master.unwrap(boxed), stored)
        master.fingerprint(ORG, value)
        crypto.seal(public, value)

    def rate(operation: Callable[[int], None]) -> float:
        for i in range(200):  # warm-up
            operation(i)
        count, started = 0, time.perf_counter()
        end = started + plan.crypto_s
        while (now := time.perf_counter()) < end:
            for i in range(100):
                operation(i)
            count += 100
        return count / (now - started)

    return rate(inject), rate(upload)


# ---- the run ------------------------------------------------------------------------------------------


@dataclass
class Results:
    load: dict[tuple[str, str], Rate] = field(default_factory=dict)
    inject_floor: float = math.nan
    upload_floor: float = math.nan
    failures: list[str] = field(default_factory=list)

    async def record(self, scenario: str, target: Target, measurement: Awaitable[Rate]) -> None:
        """Run one measurement on one server; a failure is reported and leaves the cell empty."""
        print(f"{scenario:<8} {target.name} ...", flush=True)
        try:
            self.load[scenario, target.name] = await measurement
        except (RuntimeError, TimeoutError, grpc.aio.AioRpcError) as error:
            message = f"{scenario} on {target.name} failed: {error}"
            print(f"  {message}", flush=True)
            self.failures.append(message)

    def get(self, scenario: str, target: str, scale: float = 1.0) -> float:
        rate = self.load.get((scenario, target))
        return rate.calls_per_s * scale if rate else math.nan


def number(value: float, digits: int = 0) -> str:
    return "error" if math.isnan(value) else f"{value:,.{digits}f}"


def ratio(ours: float, theirs: float) -> str:
    return "-" if math.isnan(ours) or math.isnan(theirs) or not theirs else f"{ours / theirs:.2f}x"


def crypto_share(rate: Rate | None, floor: float, per_call: int) -> str:
    """Crypto CPU time per call over the vault server's CPU time per call."""
    if rate is None or math.isnan(floor) or not rate.calls_per_s or not rate.server_cores:
        return "-"
    server_s_per_call = rate.server_cores / rate.calls_per_s
    return f"{100 * (per_call / floor) / server_s_per_call:.0f}%"


def report(results: Results, plan: Plan, store: str, elapsed_s: float) -> str:
    n = plan.declared
    rows = [("metric", "vault", "baseline (echo)", "ratio")]
    for label, scenario, scale in (
        ("(a) PutSecret (uploads/s)", "put", 1.0),
        ("(b) OpenSecrets x1 (calls/s = secrets/s)", "open1", 1.0),
        (f"(b) OpenSecrets x{n} (calls/s)", f"open{n}", 1.0),
        (f"(b) OpenSecrets x{n} (secrets/s)", f"open{n}", float(n)),
    ):
        ours, theirs = results.get(scenario, "vault", scale), results.get(scenario, "baseline", scale)
        rows.append((label, number(ours), number(theirs), ratio(ours, theirs)))
    rows += [
        ("(c) crypto floor, inject: unwrap+open+re-seal (ops/s)", number(results.inject_floor), "-", "-"),
        ("(c) crypto floor, upload: + fingerprint (ops/s)", number(results.upload_floor), "-", "-"),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    scenarios = ("put", "open1", f"open{n}")

    def both(get: Callable[[Rate], str]) -> str:
        parts = []
        for scenario in scenarios:
            cells = [results.load.get((scenario, t)) for t in ("vault", "baseline")]
            parts.append(f"{scenario} " + " vs ".join(get(c) if c else "-" for c in cells))
        return "; ".join(parts)

    shares = [
        f"put {crypto_share(results.load.get(('put', 'vault')), results.upload_floor, 1)}",
        f"open1 {crypto_share(results.load.get(('open1', 'vault')), results.inject_floor, 1)}",
        f"open{n} {crypto_share(results.load.get((f'open{n}', 'vault')), results.inject_floor, n)}",
    ]
    lines += [
        "",
        f"{plan.callers} concurrent callers over {plan.channels} connections, {plan.value_bytes}-byte values, "
        f"{plan.measure_s:g} s windows; store: {store}; {os.cpu_count()} cores; run took {elapsed_s:.0f} s"
        + ("; --quick: short windows, rough figures" if plan is QUICK else ""),
        "p50 latency per call (ms), vault vs baseline: " + both(lambda r: number(r.p50_ms, 2)),
        "cores busy, client/server, vault vs baseline: "
        + both(lambda r: f"{r.client_cores:.2f}/{r.server_cores:.2f}"),
        "crypto share of the vault server's CPU per call: " + "; ".join(shares),
        *results.failures,
    ]
    return "\n".join(lines)


async def run_benchmark(store: str, plan: Plan) -> int:
    started = time.perf_counter()
    seed = secrets.token_hex(32)
    store_url = "" if store == "sqlite" else store
    results = Results()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-vault-") as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp)
        vault_port, baseline_port = free_port(), free_port()
        vault_child = stack.enter_context(
            child_process(
                "vault",
                [sys.executable, "-m", "services.vault"],
                vault_env(folder / "state", vault_port, seed, store_url),
                folder,
                port=vault_port,
            )
        )
        baseline_child = stack.enter_context(
            child_process(
                "baseline",
                [
                    sys.executable,
                    str(SCRIPT),
                    "--serve-baseline",
                    str(baseline_port),
                    "--value-bytes",
                    str(plan.value_bytes),
                ],
                dict(os.environ),
                folder,
                port=baseline_port,
            )
        )
        vault, baseline = Target("vault", vault_child, plan), Target("baseline", baseline_child, plan)
        targets = [vault, baseline]
        try:
            signer = TokenSigner(nacl.signing.SigningKey(bytes.fromhex(seed)))
            user = signer.issue("user", "bench-user", org=ORG, ttl_s=3600)
            put_metadata: Metadata = (("authorization", f"Bearer {user}"),)
            await vault.wait_ready(put_metadata)
            await baseline.wait_ready(())
            workload, values = await prepare(vault, plan, signer, put_metadata)
            await check_injection(vault, workload, values)
            # Scenario by scenario, each on both servers back to back, so slow drifts of a shared machine
            # touch both columns of a row alike.
            for target in targets:
                await results.record(
                    "put",
                    target,
                    measure_load(target, plan, "PutSecret", workload.put, workload.put_metadata),
                )
            for count in (1, plan.declared):
                for target in targets:
                    load = measure_load(
                        target, plan, "OpenSecrets", workload.opener(count), workload.job_metadata
                    )
                    await results.record(f"open{count}", target, load)
        finally:
            for target in targets:
                await target.close()
    print("crypto floor (in this process) ...", flush=True)
    results.inject_floor, results.upload_floor = crypto_floor(plan)
    store_name = store_url or "sqlite in a temporary folder (synchronous=FULL)"
    print()
    print(report(results, plan, store_name, time.perf_counter() - started))
    return 1 if results.failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--store", default="sqlite", help="sqlite (default, a temporary file) or a postgresql:// URL"
    )
    parser.add_argument("--quick", action="store_true", help="short windows for a smoke run (< 20 s)")
    parser.add_argument("--serve-baseline", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--value-bytes", type=int, default=FULL.value_bytes, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_baseline is not None:
        asyncio.run(serve_baseline(args.serve_baseline, args.value_bytes))
        return 0
    if args.store != "sqlite" and not args.store.startswith(("postgresql://", "postgres://")):
        parser.error("--store takes sqlite or a postgresql:// URL")
    return asyncio.run(run_benchmark(args.store, QUICK if args.quick else FULL))


if __name__ == "__main__":
    sys.exit(main())

"""The one way a Tandem service boots.

`start_service` builds a `grpc.aio` server with explicit message limits and keepalive, the interceptors in
their fixed order, grpc health and reflection, plaintext on loopback or mTLS when configured, and calls the
service's `setup(server, deps)`. `serve` runs one or more services in this process until SIGINT/SIGTERM,
then drains: health turns NOT_SERVING, new calls are refused, in-flight calls get `drain_grace_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from types import ModuleType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mesh.clients import ClientFactory
from mesh.identity import TokenSigner, TokenVerifier, load_retired_keys, load_signing_key
from mesh.interceptors import AuthInterceptor, server_interceptors
from mesh.jobtokens import JobLiveness, scheduler_lookup
from mesh.observability import configure_logging, configure_tracing, flush_tracing
from mesh.settings import Settings, settings_problem

log = logging.getLogger("tandem.server")


@dataclass
class Deps:
    """What a service's setup receives: settings, identity, typed clients for its peers."""

    service: str
    settings: Settings
    signer: TokenSigner
    verifier: TokenVerifier
    clients: ClientFactory
    auth: AuthInterceptor
    colocated: Sequence[str] = ()
    """Services running in this same process (all of them under `tandem up`)."""


@dataclass
class Registration:
    """What a service's setup returns: its gRPC service names, public methods and shutdown hooks."""

    service_names: Sequence[str]
    public_methods: Sequence[str] = ()
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # Shutdown hooks, run one after another in the order listed once the server has stopped: the service's
    # own loops first, the store last (a loop stopped after its store logged errors on every shutdown).
    # Credentials for this service's own port instead of the mesh's (the gateway's public TLS, for clients
    # that have no mesh certificate); None: the mesh's mTLS when configured, else plaintext.
    server_credentials: grpc.ServerCredentials | None = None
    # Lines `tandem up` prints once the mesh is up: where the service's other listeners are (the gateway's
    # OpenAI-compatible endpoint), or how to turn them on.
    announce: Sequence[str] = ()


Setup = Callable[[grpc.aio.Server, Deps], Awaitable[Registration]]


@dataclass
class RunningService:
    name: str
    address: str
    port: int
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    registration: Registration
    deps: Deps

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        for hook in self.registration.on_stop:  # in the order listed: what uses the store before the store
            await hook()
        await self.deps.clients.close()


def _servicer_module(service: str) -> ModuleType:
    return import_module("gateway.servicer" if service == "gateway" else f"services.{service}.servicer")


def setup_for(service: str) -> Setup:
    """The `setup` function of `services/<service>` (or `gateway`)."""
    fn: Setup = _servicer_module(service).setup
    return fn


def shares_port(service: str) -> bool:
    """Whether `service` lets other processes of it listen on its port (SO_REUSEPORT): its module's
    `shares_port()` when it has one. Only the gateway may (stateless over the mesh, so any replica can take
    any connection), and only when its settings say so; every other service owns its port alone."""
    fn: Callable[[], bool] | None = getattr(_servicer_module(service), "shares_port", None)
    return fn() if fn is not None else False


def server_options(settings: Settings, reuse_port: bool = False) -> list[tuple[str, int]]:
    # gRPC core refuses anything past this hard limit itself (RESOURCE_EXHAUSTED); below it our validation
    # interceptor measures each request against max_message_bytes and answers with a reason.
    hard_limit = settings.max_message_bytes * 2 + 64 * 1024
    keepalive_ms = int(settings.keepalive_s * 1000)
    return [
        ("grpc.max_receive_message_length", hard_limit),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", int(reuse_port)),  # a second process on the port fails unless it may share
    ]


def _server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    tls = settings.tls
    if not tls.enabled:
        return None
    assert tls.cert_file and tls.key_file and tls.ca_file
    return grpc.ssl_server_credentials(
        [(tls.key_file.read_bytes(), tls.cert_file.read_bytes())],
        root_certificates=tls.ca_file.read_bytes(),
        require_client_auth=True,
    )


async def start_service(
    service: str, settings: Settings, setup: Setup | None = None, colocated: Sequence[str] = ()
) -> RunningService:
    key = load_signing_key(settings.mesh_key, settings.state_dir)
    signer = TokenSigner(key)
    # Tokens of a key rotated out still verify until its cutoff (mesh/identity.py: rotation).
    verifier = TokenVerifier(key.verify_key, retired=load_retired_keys(settings.state_dir))
    public: set[str] = set()
    interceptors, auth = server_interceptors(service, verifier, public, settings.max_message_bytes)
    reuse_port = setup is None and shares_port(service)
    server = grpc.aio.server(interceptors=interceptors, options=server_options(settings, reuse_port))
    deps = Deps(
        service, settings, signer, verifier, ClientFactory(settings, signer, service), auth, colocated
    )
    auth.liveness = JobLiveness(scheduler_lookup(deps.clients))
    registration = await (setup or setup_for(service))(server, deps)
    public.update(registration.public_methods)

    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*registration.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)

    bind = f"{settings.host}:{settings.port(service)}"
    credentials = registration.server_credentials or _server_credentials(settings)
    port = server.add_secure_port(bind, credentials) if credentials else server.add_insecure_port(bind)
    await server.start()
    for name in ["", *registration.service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    address = f"{settings.host}:{port}"
    log.info("serving", extra={"service": service, "address": address})
    return RunningService(service, address, port, server, health_servicer, registration, deps)


async def serve(
    services: Sequence[str],
    settings: Settings,
    on_ready: Callable[[list[RunningService]], None] | None = None,
    stop_event: asyncio.Event | None = None,
    setups: Mapping[str, Setup] | None = None,
    handle_signals: bool = True,
) -> None:
    """Run services in this process until SIGINT/SIGTERM (or `stop_event`), then drain and stop.

    Services start in the given order with their ports from settings; a peer a service calls is reached
    through `settings.target(peer)`. When a port is 0 the chosen port is written back into the settings
    so later services in this process find it. `setups` gives the setup of a service that is not a module
    under `services/` (an inference worker builds its own around the engine it loaded). With
    `handle_signals=False` the caller owns SIGINT/SIGTERM and stops the services with `stop_event`.
    """
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    configure_tracing("tandem-" + "+".join(services), settings.otlp_endpoint, settings.trace_path)
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM) if handle_signals else ()
    for sig in signals:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    running: list[RunningService] = []
    try:
        for name in services:
            service = await start_service(name, settings, (setups or {}).get(name), colocated=services)
            setattr(settings.ports, name, service.port)
            running.append(service)
        harden_state(settings.state_dir)  # the stores and keys each service just opened or made
        if on_ready:
            on_ready(running)
        await stop.wait()
    finally:
        log.info("draining", extra={"grace_s": settings.drain_grace_s})
        await asyncio.gather(*(s.stop(settings.drain_grace_s) for s in reversed(running)))
        flush_tracing()
        for sig in signals:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


def harden_state(state_dir: Path) -> None:
    """The state folder shut to other accounts (tasks run as other users): its own files (keys, SQLite
    databases and their journals, logs, traces) 0600, its `logs` folder 0700, and the folder itself
    execute-only for others, so a task reaches its own work folders below it by name and lists nothing."""
    with contextlib.suppress(OSError):
        state_dir.chmod((state_dir.stat().st_mode & 0o700) | 0o711)
    for folder in (state_dir, state_dir / "logs"):
        if not folder.is_dir():
            continue
        if folder != state_dir:
            folder.chmod(0o700)
        for item in folder.iterdir():
            if item.is_file() and not item.is_symlink():
                with contextlib.suppress(OSError):
                    item.chmod(0o600)


def run_single(service: str) -> None:
    """Entry point of `python -m services.<name>`: one service, settings from env/TOML. A bad setting ends
    it at start-up with status 2 and a line naming the setting."""
    try:
        settings = Settings()
        configure_logging(settings.log_level, settings.log_format)
        asyncio.run(serve([service], settings))
    except Exception as error:
        problem = settings_problem(error)
        if problem is None:
            raise
        print(f"{service}: {problem}", file=sys.stderr)
        raise SystemExit(2) from None

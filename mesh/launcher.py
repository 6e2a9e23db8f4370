"""The one-process mesh behind `tandem up`: every service on loopback in one event loop, sharing one
state folder (SQLite files, the mesh key, logs, traces). The same services run one per process with
`python -m services.<name>` (the deployment shape); nothing here differs but the process boundary.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from mesh.observability import configure_logging
from mesh.server import RunningService, serve
from mesh.settings import Settings

ADMIN_KEY_FILE = "admin.key"  # written by the gateway on first start (gateway.orgs)

# Start order: a service's peers come up before it (the gateway fronts all of them, so it is last).
MESH_SERVICES = ("events", "vault", "taskapp_proxy", "scheduler", "gateway")


def print_addresses(out: TextIO) -> Callable[[list[RunningService]], None]:
    def on_ready(running: list[RunningService]) -> None:
        width = max(len(s.name) for s in running)
        out.write("Tandem is up. Services (gRPC, health and reflection on each):\n")
        for service in running:
            out.write(f"  {service.name:<{width}}  {service.address}\n")
        for service in running:
            for line in service.registration.announce:
                out.write(f"{line}\n")
        admin = running[0].deps.settings.state_dir / ADMIN_KEY_FILE
        if any(s.name == "gateway" for s in running) and admin.exists():
            out.write(f"Admin credential (for CreateOrg): {admin.resolve()}\n")
        out.write("Press Ctrl-C to stop.\n")
        out.flush()

    return on_ready


def up(settings: Settings, out: TextIO = sys.stdout, stop_event: asyncio.Event | None = None) -> None:
    """Run the whole mesh until Ctrl-C / SIGTERM; logs go to state_dir/logs/tandem.log."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    log_dir: Path = settings.state_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    configure_logging(settings.log_level, settings.log_format, stream=(log_dir / "tandem.log").open("a"))
    out.write(f"State folder: {settings.state_dir.resolve()}\n")
    try:
        asyncio.run(serve(MESH_SERVICES, settings, on_ready=print_addresses(out), stop_event=stop_event))
    except KeyboardInterrupt:  # a second Ctrl-C during the drain
        logging.getLogger("tandem").warning("interrupted during shutdown")
    out.write("Tandem stopped.\n")
    out.flush()

"""Run the real mesh (or one service) in the test's event loop on free loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.launcher import MESH_SERVICES
from mesh.server import RunningService, serve
from mesh.settings import Ports, Settings


def mesh_settings(state_dir: Path, **overrides: Any) -> Settings:
    """Settings for a test mesh: every port 0 (chosen at start), state in the test's folder."""
    return Settings(
        state_dir=state_dir,
        ports=Ports(gateway=0, vault=0, scheduler=0, taskapp_proxy=0, events=0),
        **overrides,
    )


@dataclass
class Mesh:
    settings: Settings
    services: dict[str, RunningService]

    def address(self, service: str) -> str:
        return self.services[service].address


@contextlib.asynccontextmanager
async def running_mesh(settings: Settings, services: Sequence[str] = MESH_SERVICES) -> AsyncIterator[Mesh]:
    ready: asyncio.Future[list[RunningService]] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(services, settings, on_ready=ready.set_result, stop_event=stop))
    done, _ = await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # startup failed: raise its error
    try:
        yield Mesh(settings, {s.name: s for s in ready.result()})
    finally:
        stop.set()
        await task
        # A scheduler's tasks outlive it on purpose (a restarted scheduler reattaches); a test's must not.
        kill_tasks_under(settings.state_dir)


def kill_tasks_under(folder: Path) -> None:
    """SIGKILL the process group of every process whose command line names `folder`: the local backend's
    task wrappers name their exit files there, and each leads its task's group (a session of its own)."""
    own = os.getpgrp()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if str(folder.absolute()) not in (proc / "cmdline").read_bytes().decode(errors="replace"):
                continue
            group = os.getpgid(int(proc.name))
            if group != own:
                os.killpg(group, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue

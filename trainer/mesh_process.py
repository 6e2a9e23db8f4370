"""The job's embedded mesh services (events, vault, taskapp-proxy) in a process of their own:
`python -m trainer.mesh_process STATE_DIR READY_FILE`, with the mesh key in `TANDEM_MESH_KEY`.

`local_environment` starts it when the job names no running mesh. Out of the trainer's process, the proxy's
work (an HTTP call to the Task App per episode, their results streamed back) does not compete with the
trainer's update for one interpreter lock, so generation really runs ahead of training when
`max_staleness > 0`. Once serving, it writes the services' ports as JSON to READY_FILE; SIGTERM (also sent
when its parent dies) drains and stops it. Its log is STATE_DIR/logs/mesh.log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from mesh.files import write_atomic
from mesh.observability import configure_logging
from mesh.server import RunningService, serve
from mesh.settings import Ports, Settings, Targets
from trainer.inference.process import ROOT, die_with_parent, stop_process

MESH = ("events", "vault", "taskapp_proxy")
START_TIMEOUT_S = 120.0


def local_settings(state_dir: Path, mesh_key: str) -> Settings:
    """Settings for what a job starts on loopback (its own services, workers and TrainerService): ports
    picked at start, and no targets from the environment (those name the scheduler's mesh)."""
    return Settings(
        state_dir=state_dir,
        mesh_key=mesh_key,
        ports=Ports(gateway=0, vault=0, scheduler=0, taskapp_proxy=0, events=0),
        targets=Targets(),
    )


def _write_ready(path: Path, running: Sequence[RunningService]) -> None:
    write_atomic(path, json.dumps({service.name: service.port for service in running}))  # never half a file


def main() -> None:
    state_dir, ready_file = Path(sys.argv[1]), Path(sys.argv[2])
    settings = local_settings(state_dir, os.environ.get("TANDEM_MESH_KEY", ""))
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    with (state_dir / "logs" / "mesh.log").open("a") as stream:
        configure_logging(settings.log_level, settings.log_format, stream=stream)
        asyncio.run(serve(list(MESH), settings, on_ready=lambda running: _write_ready(ready_file, running)))


@contextlib.asynccontextmanager
async def mesh_process(state_dir: Path, mesh_key: str) -> AsyncIterator[Settings]:
    """The embedded services in a child process; yields the settings that reach them, and stops the child
    on the way out."""
    ready = state_dir / "mesh.ready.json"
    output = state_dir / "mesh.out"
    proc = await asyncio.to_thread(_start, state_dir, ready, output, mesh_key)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not await asyncio.to_thread(ready.exists):
            if proc.poll() is not None or time.monotonic() > deadline:
                said = (await asyncio.to_thread(output.read_text, errors="replace"))[-4000:]
                raise RuntimeError(f"the job's mesh services did not start (exit {proc.poll()}):\n{said}")
            await asyncio.sleep(0.05)
        settings = local_settings(state_dir, mesh_key)
        for name, port in json.loads(await asyncio.to_thread(ready.read_text)).items():
            setattr(settings.ports, name, int(port))
        yield settings
    finally:
        await asyncio.to_thread(stop_process, proc)


def _start(state_dir: Path, ready: Path, output: Path, mesh_key: str) -> subprocess.Popen[bytes]:
    state_dir.mkdir(parents=True, exist_ok=True)
    ready.unlink(missing_ok=True)
    with output.open("wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "trainer.mesh_process", str(state_dir), str(ready)],
            cwd=ROOT,
            env={**os.environ, "TANDEM_MESH_KEY": mesh_key},
            stdout=sink,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - only sets the parent-death signal
        )


if __name__ == "__main__":
    main()

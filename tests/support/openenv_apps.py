"""The example OpenEnv environment (examples/openenv/guess_env.py, written on openenv-core's server API) served
the way OpenEnv serves one, as its own env server process in .venv-openenv (`make setup-openenv`): openenv-core
would downgrade pillow in .venv, so it is not there. Tandem's adapter (tandem_taskapp.openenv_env) talks to it
over HTTP and WebSocket from .venv. Tests that need the server carry `needs_openenv` and skip without that venv."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.postgres import free_port
from tests.support.processes import ROOT

OE_PYTHON = Path(os.environ.get("TANDEM_OPENENV_PYTHON", ROOT / ".venv-openenv" / "bin" / "python"))
ENVS = ROOT / "examples" / "openenv"
GUESS_ENV = ENVS / "guess_env.py"
GUESS_ADAPTER = ENVS / "guess_adapter.py"

needs_openenv = pytest.mark.skipif(
    not OE_PYTHON.exists(), reason="needs openenv-core in .venv-openenv (make setup-openenv)"
)


@contextmanager
def openenv_server(env: Path = GUESS_ENV, *extra: str) -> Iterator[str]:
    """The OpenEnv env server `env` (run as `python ENV --port P [EXTRA...]`) in .venv-openenv on a free port;
    yields its base URL once `/health` answers and stops it (SIGTERM) on the way out."""
    port = free_port()
    environment = {**os.environ}
    environment.pop("VIRTUAL_ENV", None)
    environment.pop("PYTHONPATH", None)  # the env server imports openenv, never Tandem
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed below, after the process
    proc = subprocess.Popen(
        [str(OE_PYTHON), str(env), "--port", str(port), *extra],
        cwd=ROOT,
        env=environment,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                log.seek(0)
                output = log.read().decode(errors="replace")
                raise AssertionError(f"the OpenEnv server exited {proc.returncode}: {output[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the OpenEnv server did not start"
            time.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        finally:
            log.close()

"""The example verifiers environments (examples/verifiers/) served as Task Apps the way a user serves one,
`tandem taskapp serve --verifiers FILE`, in .venv-verifiers (`make setup-verifiers`): verifiers pins
openai<3, so it is not in .venv. Tests that need it carry `needs_verifiers` and skip without that venv."""

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

VF_PYTHON = Path(os.environ.get("TANDEM_VERIFIERS_PYTHON", ROOT / ".venv-verifiers" / "bin" / "python"))
ENVS = ROOT / "examples" / "verifiers"
SINGLE_TURN = ENVS / "vf_copy_letter.py"
MULTI_TURN = ENVS / "vf_guess_number.py"

needs_verifiers = pytest.mark.skipif(
    not VF_PYTHON.exists(), reason="needs verifiers in .venv-verifiers (make setup-verifiers)"
)


@contextmanager
def verifiers_app(env: Path | str, key: str, *extra: str) -> Iterator[str]:
    """`tandem taskapp serve --verifiers ENV` in .venv-verifiers on a free port, the key in
    `ENVIRONMENT_API_KEY`; yields the app's base URL and stops it (SIGTERM) on the way out."""
    port = free_port()
    environment = {**os.environ, "ENVIRONMENT_API_KEY": key}
    environment.pop("VIRTUAL_ENV", None)
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed below, after the process
    proc = subprocess.Popen(
        [
            str(VF_PYTHON),
            "-m",
            "gateway.cli",
            "taskapp",
            "serve",
            "--verifiers",
            str(env),
            "--port",
            str(port),
            "--log-level",
            "warning",
            *extra,
        ],
        cwd=ROOT,
        env=environment,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                log.seek(0)
                output = log.read().decode(errors="replace")
                raise AssertionError(f"the verifiers app exited {proc.returncode}: {output[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the verifiers app did not start"
            time.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        finally:
            log.close()

"""`tandem_taskapp.serve`: loading an app and the command line, including a real
`python -m tandem_taskapp.serve examples/taskapps/single_turn.py` process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem_taskapp import TaskApp
from tandem_taskapp.serve import load_task_app, main
from tandem_taskapp.testing import free_port
from tests.taskapp.conftest import EXAMPLES, KEY, REPO, PolicyFixture, rollout_body


def test_load_by_path_module_and_attribute(tmp_path: Path) -> None:
    assert load_task_app(str(EXAMPLES / "single_turn.py")).name == "copy-letter"
    f = tmp_path / "custom_app.py"
    f.write_text("from tandem_taskapp import TaskApp\nmine = TaskApp(name='custom')\napp = 3\n")
    assert load_task_app(f"{f}:mine").name == "custom"
    with pytest.raises(TypeError, match="TaskApp"):
        load_task_app(str(f))
    with pytest.raises(FileNotFoundError):
        load_task_app(str(tmp_path / "missing.py"))
    assert isinstance(load_task_app("tandem_taskapp_user_custom_app:mine"), TaskApp)  # a module name


def test_main_refuses_to_start_without_a_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("ENVIRONMENT_API_KEY", raising=False)
    assert main([str(EXAMPLES / "single_turn.py")]) == 2
    assert "ENVIRONMENT_API_KEY" in capsys.readouterr().err


def test_main_reports_a_bad_path(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ENVIRONMENT_API_KEY", KEY)
    assert main(["no/such/app.py"]) == 2
    err = capsys.readouterr().err
    assert "no such Task App file" in err
    assert KEY not in err


def test_main_refuses_an_empty_stdin_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # noqa: SIM115
    assert main([str(EXAMPLES / "single_turn.py"), "--key-from-stdin"]) == 2


@pytest.fixture
def port() -> int:
    return free_port()


@contextlib.contextmanager
def _start(port: int, *, stdin_key: bool) -> Iterator[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if k != "ENVIRONMENT_API_KEY"}
    args = [
        sys.executable,
        "-m",
        "tandem_taskapp.serve",
        str(EXAMPLES / "single_turn.py"),
        "--port",
        str(port),
    ]
    if stdin_key:
        args.append("--key-from-stdin")
    else:
        env["ENVIRONMENT_API_KEY"] = KEY
    proc = subprocess.Popen(
        args, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        if stdin_key:
            assert proc.stdin is not None
            proc.stdin.write(KEY.encode() + b"\n")
            proc.stdin.close()
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else b""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        output = proc.stdout.read()
        proc.stdout.close()
        assert KEY.encode() not in output


@pytest.mark.parametrize("stdin_key", [False, True], ids=["env", "stdin"])
def test_python_m_serve_end_to_end(port: int, policy: PolicyFixture, stdin_key: bool) -> None:
    with _start(port, stdin_key=stdin_key):
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/task_info").status_code == 401
        info = httpx.get(f"{base}/task_info", params={"seed": 4}, headers={"X-API-Key": KEY}).json()
        policy.server.replies = info["instance"]["target"]
        r = httpx.post(
            f"{base}/rollout",
            json=rollout_body("srv-1", policy.url("srv-1"), seed=4),
            headers={"X-API-Key": KEY},
        )
        assert r.status_code == 200
        assert r.json()["metrics"]["outcome_reward"] == 1.0

"""Configuration fails closed: a missing or unreadable TANDEM_CONFIG, a partial TLS setup, a TLS file that is
not there and an unknown key each stop a process at start-up with a line naming the setting (exit 2), never
a plaintext mesh or a "bug" report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mesh.settings import Settings, SettingsError, settings_problem

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    return subprocess.run(
        [sys.executable, *args],
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def problem_of(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    for key in [k for k in os.environ if k.startswith("TANDEM_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises((SettingsError, ValueError)) as caught:
        Settings()
    problem = settings_problem(caught.value)
    assert problem is not None
    return problem


def test_each_bad_setting_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pem = tmp_path / "cert.pem"
    pem.write_text("not checked here")
    (tmp_path / "bad.toml").write_text("state_dir = [unclosed\n")
    (tmp_path / "extra.toml").write_text("no_such_setting = 1\n")
    cases = {
        "TANDEM_CONFIG names": {"TANDEM_CONFIG": str(tmp_path / "missing.toml")},
        "not readable TOML": {"TANDEM_CONFIG": str(tmp_path / "bad.toml")},
        "setting no_such_setting": {"TANDEM_CONFIG": str(tmp_path / "extra.toml")},
        "key_file, ca_file not set": {"TANDEM_TLS__CERT_FILE": str(pem)},
        "ca_file not set": {"TANDEM_TLS__CERT_FILE": str(pem), "TANDEM_TLS__KEY_FILE": str(pem)},
        "which is not a file": {
            "TANDEM_TLS__CERT_FILE": str(pem),
            "TANDEM_TLS__KEY_FILE": str(pem),
            "TANDEM_TLS__CA_FILE": str(tmp_path / "no-ca.pem"),
        },
    }
    for fragment, env in cases.items():
        assert fragment in problem_of(monkeypatch, **env), env


def test_processes_refuse_to_start_and_say_which_setting(tmp_path: Path) -> None:
    pem = tmp_path / "cert.pem"
    pem.write_text("x")
    partial = {"TANDEM_TLS__CERT_FILE": str(pem), "TANDEM_TLS__KEY_FILE": str(pem)}
    service = run("-m", "services.vault", TANDEM_STATE_DIR=str(tmp_path / "s"), **partial)
    assert service.returncode == 2 and "ca_file not set" in service.stderr, service.stderr
    assert "Traceback" not in service.stderr
    cli = run("-m", "gateway.cli", "status", TANDEM_CONFIG=str(tmp_path / "missing.toml"))
    assert cli.returncode == 2 and "TANDEM_CONFIG names" in cli.stderr, cli.stderr
    assert "bug" not in cli.stderr
    up = run("-m", "gateway.cli", "up", "--state-dir", str(tmp_path / "s"), **partial)
    assert up.returncode == 2 and "setting tls" in up.stderr, up.stderr
    assert not (tmp_path / "s" / "vault.db").exists()  # nothing started

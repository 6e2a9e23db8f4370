"""`tandem secrets put|list` against a running `tandem up`, through its gateway with an organization API key:
the value comes from standard input, is sealed on the client, and appears nowhere in the output, the databases
or the logs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import ROOT, mesh_env, stop, tandem_up

pytestmark = pytest.mark.timeout(120)
VALUE = "sk-cli-0123456789abcdef0123456789"


def tandem(args: list[str], env: dict[str, str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        cwd=ROOT,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_put_and_list_secrets_from_the_cli(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with tandem_up(state) as (proc, ports):
        env, _ = mesh_env(state)
        env["TANDEM_GATEWAY"] = f"127.0.0.1:{ports['gateway']}"
        org = tandem(["orgs", "create", "acme", "--state-dir", str(state), "--json"], env)
        assert org.returncode == 0, org.stderr
        env["TANDEM_API_KEY"] = json.loads(org.stdout)["key"]
        put = tandem(["secrets", "put", "env-key", "--json"], env, stdin=VALUE + "\n")
        assert put.returncode == 0, put.stderr
        created = json.loads(put.stdout)
        assert (created["secret"], created["version"], created["result"]) == (
            "orgs/acme/secrets/env-key",
            1,
            "created",
        )
        again = tandem(["secrets", "put", "env-key"], env, stdin=VALUE)
        assert "updated orgs/acme/secrets/env-key version 2" in again.stdout
        assert json.loads(put.stdout)["fingerprint"] in again.stdout  # same value, same fingerprint
        listed = tandem(["secrets", "list", "--json"], env)
        assert json.loads(listed.stdout)[0]["versions"] == 2
        bad = tandem(["secrets", "put", "Bad Name"], env, stdin=VALUE)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "Traceback" not in bad.stderr
        empty = tandem(["secrets", "put", "env-key"], env, stdin="")
        assert empty.returncode != 0 and "empty" in empty.stderr
        code, out = stop(proc, signal.SIGINT)
    assert code == 0
    everything = out + put.stdout + again.stdout + listed.stdout + bad.stderr
    assert VALUE not in everything
    for path in state.rglob("*"):
        if path.is_file():
            assert VALUE[:12].encode() not in path.read_bytes(), path

"""No job reads the mesh's keys or another organization's state: an attack job on the local backend looks
for them everywhere it can reach (every folder above its own, the names the mesh's key files have there,
the environment of every process, its own environment) and writes down what it could read. With the
scheduler's `local.run_as = org` (tasks run as an unprivileged user of their organization) it finds
nothing; run as the mesh's own account, as the control, it finds the mesh's signing key, which shows the
search works."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from pathlib import Path

import pytest
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.gateway.v1 import gateway_service_pb2_grpc
from tandem.scheduler.v1 import job_spec_pb2

from gateway.orgs import ADMIN_KEY_FILE
from mesh.clients import open_channel
from mesh.secrets import seal_for_upload
from tests.support.mesh import mesh_settings, running_mesh

SYSTEM_PYTHON = "/usr/bin/python3"
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="starting tasks as other users needs root"),
    pytest.mark.skipif(
        not os.access(SYSTEM_PYTHON, os.X_OK), reason="the attack job runs the system's python3"
    ),
]

# Reads what it can and writes it, base64-free, as JSON beside itself: its findings are the test's to judge.
ATTACK = r"""
import json, os, pathlib
found = {"files": {}, "environ": {}, "env": dict(os.environ)}
budget = [16 << 20]  # bytes kept in all: nearest folders first, so the mesh's state is read before the rest
SKIP = {".git", "node_modules", "site-packages", "__pycache__"}  # bulk that holds no key of this mesh
def take(path):
    try:
        if path.is_file() and str(path) not in found["files"] and path.stat().st_size < min(1 << 20, budget[0]):
            found["files"][str(path)] = text = path.read_text(errors="replace")
            budget[0] -= len(text)
    except OSError:
        pass
def walk(folder):
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return
    for entry in entries:
        try:
            inside = entry.is_dir() and not entry.is_symlink() and entry.name not in SKIP
        except OSError:
            continue
        walk(entry) if inside else take(entry)
here = pathlib.Path.cwd().resolve()
names = ["mesh.key", "vault-master.key", "admin.key", "vault.db", "gateway.db", "scheduler.db", "events.db",
         "taskapp_proxy.db", "traces.jsonl", "logs/tandem.log"]
for folder in [here, *here.parents]:
    for name in names:
        take(folder / name)
    if folder == pathlib.Path("/"):
        for entry in folder.iterdir():
            take(entry)
    else:
        walk(folder)
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            found["environ"][pid] = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
        except OSError:
            pass
(pathlib.Path.cwd() / "found.json").write_text(json.dumps(found))
print("searched", len(found["files"]), "files and", len(found["environ"]), "environments")
"""


async def attack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_as: str) -> tuple[dict[str, str], str]:
    """(every key and secret of the mesh and of the other organization, by what it is; what the attack read)."""
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CPUS", "4")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__MEMORY_GIB", "8")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__RUN_AS", run_as)
    state = tmp_path / "state"
    # Made now, so it is in no file (this one included) that the search could reach but the mesh's own.
    plaintext = f"globex-plaintext-{secrets.token_hex(8)}"
    async with running_mesh(mesh_settings(state)) as mesh:
        admin_key = (state / ADMIN_KEY_FILE).read_text().strip()
        async with open_channel(mesh.address("gateway"), mesh.settings, token=admin_key) as channel:
            admin = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            acme = (await admin.CreateOrg(pb.CreateOrgRequest(org_id="acme"))).key
            globex = (await admin.CreateOrg(pb.CreateOrgRequest(org_id="globex"))).key
        async with open_channel(mesh.address("gateway"), mesh.settings, token=globex) as channel:
            other = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            key = (await other.GetPublicKey(pb.GetPublicKeyRequest(parent="orgs/globex"))).key
            await other.PutSecret(
                pb.PutSecretRequest(
                    parent="orgs/globex",
                    secret_id="env-key",
                    key_id=key.name.rsplit("/", 1)[1],
                    ciphertext=seal_for_upload(key.public_key, plaintext.encode()),
                )
            )
        async with open_channel(mesh.address("gateway"), mesh.settings, token=acme) as channel:
            user = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            (tmp_path / "attack.py").write_text(ATTACK)
            os.chmod(tmp_path / "attack.py", 0o644)
            for folder in (tmp_path, *tmp_path.parents):  # the attack script itself is readable
                os.chmod(folder, folder.stat().st_mode | 0o001)

            task = job_spec_pb2.TaskSpec(
                name="main",
                kind=job_spec_pb2.TaskSpec.KIND_COMMAND,
                run=f"{SYSTEM_PYTHON} {tmp_path}/attack.py",
            )
            job = (
                await user.CreateJob(
                    pb.CreateJobRequest(
                        parent="orgs/acme", job_id="snoop", spec=job_spec_pb2.JobSpec(tasks=[task])
                    )
                )
            ).job
            deadline = time.monotonic() + 120
            while (got := (await user.GetJob(pb.GetJobRequest(name=job.name))).job).state not in (
                got.STATE_SUCCEEDED,
                got.STATE_FAILED,
            ):
                assert time.monotonic() < deadline, got
                await asyncio.sleep(0.2)
            assert got.state == got.STATE_SUCCEEDED, got.failure
        [report] = list((state / "scheduler").rglob("found.json"))
        hidden = {
            "mesh signing key": (state / "mesh.key").read_text().strip(),
            "vault master key": (state / "vault-master.key").read_text().strip(),
            "admin key": admin_key,
            "acme's API key": acme,
            "globex's API key": globex,
            "globex's secret": plaintext,
        }
        return hidden, report.read_text()


def leaks(secrets: dict[str, str], report: str) -> list[str]:
    return [what for what, value in secrets.items() if value in report]


async def test_a_job_of_one_org_reads_no_key_and_no_other_orgs_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets, report = await attack(tmp_path, monkeypatch, "org")
    assert leaks(secrets, report) == []
    found = json.loads(report)
    assert found["env"]["USER"] == "tdm-acme" and "TANDEM_JOB_TOKEN" in found["env"]


async def test_the_control_run_as_the_mesh_finds_its_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets, report = await attack(tmp_path, monkeypatch, "mesh")
    assert "mesh signing key" in leaks(secrets, report)

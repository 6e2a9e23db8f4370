"""No job reads the mesh's keys or another organization's state, on the local backend and on a real Slurm
cluster (tests/support/slurm.py). Beside a running job of another organization (globex), an attack job of
acme (`attack_job.py`) reads every file it can reach, from its working folder and from `/`, and every
process's environment; the test then looks in what it read for the mesh's signing key and the vault's
master key (as stored, as bytes, in hex and base64), the admin and API keys, globex's secret, globex's job
token, and any name in globex's folders. With the organization's own user (`run_as = org`) it finds none
of them; run as the mesh's own account, as the control, it finds the signing key, which shows the search
works."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pwd
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.gateway.v1 import gateway_service_pb2_grpc
from tandem.scheduler.v1 import job_pb2, job_spec_pb2

from gateway.orgs import ADMIN_KEY_FILE
from mesh.clients import open_channel
from mesh.secrets import seal_for_upload
from services.scheduler.backends import sandbox
from tests.support.mesh import mesh_settings, running_mesh
from tests.support.slurm import SlurmCluster

SYSTEM_PYTHON = "/usr/bin/python3"
ATTACK = Path(__file__).with_name("attack_job.py")
FAR_BUDGET_S = 45.0  # how long the attack searches the rest of `/` once its own surroundings are done
ENDED = (job_pb2.Job.State.STATE_SUCCEEDED, job_pb2.Job.State.STATE_FAILED, job_pb2.Job.State.STATE_CANCELLED)
BACKENDS = {"local": job_spec_pb2.BACKEND_LOCAL, "slurm": job_spec_pb2.BACKEND_SLURM}
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.geteuid() != 0, reason="starting tasks as other users needs root"),
    pytest.mark.skipif(
        not os.access(SYSTEM_PYTHON, os.X_OK), reason="the attack job runs the system's python3"
    ),
]

Gateway = gateway_service_pb2_grpc.GatewayServiceStub


@dataclass
class Attack:
    secrets: dict[str, str]  # what must not be found, by what it is
    found: bytes  # everything the attack read (found.bin)
    report: dict[str, Any]  # found.json
    state: Path

    def leaks(self) -> list[str]:
        return [what for what, value in self.secrets.items() if any(f in self.found for f in forms(value))]


def forms(secret: str) -> set[bytes]:
    """The ways a secret may be written down: as it is, and a hex key also as bytes, in capitals and in
    base64; a token's or API key's signature and secret parts on their own."""
    found = {secret.encode()}
    found |= {part.encode() for part in secret.replace("_", ".").split(".") if len(part) >= 24}
    try:
        raw = bytes.fromhex(secret)
    except ValueError:
        return found
    found |= {raw, secret.upper().encode(), base64.b64encode(raw), base64.urlsafe_b64encode(raw)}
    return found | {f.rstrip(b"=") for f in found}


async def wait_until(check: Callable[[], Awaitable[bool]], what: str, within_s: float = 180.0) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)


async def job_state(client: Gateway, name: str) -> job_pb2.Job:
    return (await client.GetJob(pb.GetJobRequest(name=name))).job


async def attack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, run_as: str, budget_s: float, slurm: Any
) -> Attack:
    if backend == "slurm":
        cluster: SlurmCluster = slurm()
        monkeypatch.setenv("TANDEM_SCHEDULER_SLURM__ENABLED", "true")
        monkeypatch.setenv("TANDEM_SCHEDULER_SLURM__CONF", str(cluster.conf))
        monkeypatch.setenv("TANDEM_SCHEDULER_SLURM__RUN_AS", run_as)
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CPUS", "4")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__MEMORY_GIB", "8")
    if run_as == "auto":  # the default
        monkeypatch.delenv("TANDEM_SCHEDULER_LOCAL__RUN_AS")
    else:
        monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__RUN_AS", run_as)
    state = tmp_path / "state"
    # Slurm finds attempts by name and the cluster outlives a test: each test's jobs are its own
    suffix = os.urandom(3).hex()
    busy, snoop_id = f"busy-{suffix}", f"snoop-{suffix}"
    shutil.copy(ATTACK, tmp_path / ATTACK.name)
    os.chmod(tmp_path / ATTACK.name, 0o644)  # the attack script itself is readable

    def job(run: str) -> job_spec_pb2.JobSpec:
        task = job_spec_pb2.TaskSpec(name="main", kind=job_spec_pb2.TaskSpec.KIND_COMMAND, run=run)
        return job_spec_pb2.JobSpec(tasks=[task], backend=BACKENDS[backend])

    async with running_mesh(mesh_settings(state)) as mesh:
        admin_key = (state / ADMIN_KEY_FILE).read_text().strip()
        gateway = mesh.address("gateway")
        async with open_channel(gateway, mesh.settings, token=admin_key) as channel:
            acme = (await Gateway(channel).CreateOrg(pb.CreateOrgRequest(org_id="acme"))).key
            globex = (await Gateway(channel).CreateOrg(pb.CreateOrgRequest(org_id="globex"))).key
        async with (
            open_channel(gateway, mesh.settings, token=globex) as other_channel,
            open_channel(gateway, mesh.settings, token=acme) as channel,
        ):
            other, user = Gateway(other_channel), Gateway(channel)
            key = (await other.GetPublicKey(pb.GetPublicKeyRequest(parent="orgs/globex"))).key
            secret = os.urandom(20).hex()
            await other.PutSecret(
                pb.PutSecretRequest(
                    parent="orgs/globex",
                    secret_id="env-key",
                    key_id=key.name.rsplit("/", 1)[1],
                    ciphertext=seal_for_upload(key.public_key, secret.encode()),
                )
            )
            # globex's job runs all along, its token in its environment and its own folder
            neighbour = (
                await other.CreateJob(
                    pb.CreateJobRequest(
                        parent="orgs/globex",
                        job_id=busy,
                        spec=job('printf %s "$TANDEM_JOB_TOKEN" > token; exec sleep 600'),
                    )
                )
            ).job
            token_file = state / "scheduler" / "jobs" / f"orgs-globex-jobs-{busy}" / "main" / "token"

            async def neighbour_ready() -> bool:
                now = await job_state(other, neighbour.name)
                assert now.state not in ENDED, now.failure
                return token_file.is_file() and token_file.stat().st_size > 0

            await wait_until(neighbour_ready, "globex's job never started")
            # On the local backend the attack runs in Tandem's own Python, which a job of the organization's
            # user must reach (its online-RL tasks and secret openers run in it); a Slurm node has its own.
            script = f"{tmp_path / ATTACK.name} {budget_s}"
            if backend == "local":
                run = f"{sys.executable} -c 'import mesh, trainer' && {sys.executable} {script}"
            else:
                run = f"{SYSTEM_PYTHON} {script}"
            snoop = (
                await user.CreateJob(pb.CreateJobRequest(parent="orgs/acme", job_id=snoop_id, spec=job(run)))
            ).job

            async def snoop_ended() -> bool:
                return (await job_state(user, snoop.name)).state in ENDED

            await wait_until(snoop_ended, "the attack job never ended", within_s=240 + budget_s)
            done = await job_state(user, snoop.name)
            assert done.state == job_pb2.Job.State.STATE_SUCCEEDED, done.failure
            await other.CancelJob(pb.CancelJobRequest(name=neighbour.name))

            async def neighbour_ended() -> bool:
                return (await job_state(other, neighbour.name)).state in ENDED

            await wait_until(neighbour_ended, "globex's job was not cancelled")
        here = state / "scheduler" / "jobs" / f"orgs-acme-jobs-{snoop_id}" / "main"
        return Attack(
            secrets={
                "mesh signing key": (state / "mesh.key").read_text().strip(),
                "vault master key": (state / "vault-master.key").read_text().strip(),
                "admin key": admin_key,
                "acme's API key": acme,
                "globex's API key": globex,
                "globex's secret": secret,
                "globex's job token": token_file.read_text(),
            },
            found=(here / "found.bin").read_bytes(),
            report=json.loads((here / "found.json").read_text()),
            state=state,
        )


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A folder of the test's own outside pytest's, which every pytest session starting on this machine
    shuts to other users again (0700), and with it the tasks' way to their own folders."""
    folder = Path(tempfile.mkdtemp(prefix="tandem-isolation-"))
    folder.chmod(0o711)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def slurm(request: pytest.FixtureRequest) -> Callable[[], SlurmCluster]:
    """The session's Slurm cluster, started only by a test that runs on it."""
    return lambda: request.getfixturevalue("slurm_cluster")


async def test_a_job_of_one_org_reads_no_key_and_no_other_orgs_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, slurm: Callable[[], SlurmCluster]
) -> None:
    # The local backend's default isolates (root here: per-organization users in bubblewrap); Slurm's is
    # chosen explicitly, the job's user having a Python of the node's own.
    found = await attack(
        tmp_path, monkeypatch, backend, "auto" if backend == "local" else "org", FAR_BUDGET_S, slurm
    )
    assert found.leaks() == []
    report = found.report
    if backend == "local" and not sandbox.problem():  # its own processes only: no other job's, not the mesh's
        assert report["processes"] and all(ATTACK.name in c for c in report["processes"]), report["processes"]
    assert report["uid"] == pwd.getpwnam("tdm-acme").pw_uid and report["env"]["USER"] == "tdm-acme"
    assert "TANDEM_JOB_TOKEN" in report["env"]
    assert report["near_complete"], "the search of the job's own surroundings did not finish"
    seen = [p for p in (*report["read"], *report["listed"]) if p.startswith(str(found.state))]
    assert [p for p in seen if "globex" in p] == []
    assert any(p.endswith("rank-0.log") for p in seen), "the attack should read its own log"


async def test_the_control_run_as_the_mesh_finds_its_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, slurm: Callable[[], SlurmCluster]
) -> None:
    found = await attack(tmp_path, monkeypatch, backend, "mesh", 0.0, slurm)  # its first steps suffice
    assert {"mesh signing key", "vault master key", "globex's job token"} <= set(found.leaks())


def test_slurm_submits_as_the_orgs_user_and_warns_when_it_cannot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.scheduler.backends.base import LaunchSpec  # noqa: PLC0415
    from services.scheduler.backends.slurm import SlurmBackend  # noqa: PLC0415
    from services.scheduler.config import SchedulerSettings  # noqa: PLC0415
    from services.scheduler.servicer import make_backends  # noqa: PLC0415

    monkeypatch.setenv("TANDEM_SCHEDULER_SLURM__ENABLED", "true")
    monkeypatch.delenv("TANDEM_SCHEDULER_SLURM__RUN_AS")  # the default, auto
    with caplog.at_level("INFO"):
        slurm = make_backends(SchedulerSettings(), tmp_path)["slurm"]
    assert isinstance(slurm, SlurmBackend)
    unreachable = sandbox.unreachable(sandbox.runtime_paths())
    if unreachable:  # the job's user could not run Tandem's Python: the mesh's account, one organization
        assert slurm.run_as == "mesh" and slurm.one_organization
        assert "serves one organization only" in caplog.text and str(unreachable[0]) in caplog.text
    else:
        assert slurm.run_as == "org" and "each organization's jobs run as its own user" in caplog.text

    work = tmp_path / "jobs" / "orgs-acme-jobs-j1" / "main"
    task = LaunchSpec(
        key="orgs-acme-jobs-j1.main.0", job="orgs/acme/jobs/j1", task="main", attempt=0, command="id -u",
        env={"TANDEM_JOB_TOKEN": "tdm1.claims.sig"}, log_dir=work / "logs", workdir=work,
    )  # fmt: skip
    args = SlurmBackend(run_as="org", work_dir=tmp_path).sbatch_args(task)
    assert "--uid=tdm-acme" in args and "--gid=tdm-acme" in args
    exported = next(a for a in args if a.startswith("--export=")).removeprefix("--export=").split(",")
    assert not {"HOME", "USER", "LOGNAME"} & set(exported), "the scheduler's own account stays out"
    script = SlurmBackend(run_as="org").batch_script(task)
    assert f"export HOME={work}" in script and "export USER=tdm-acme" in script
    assert "--uid" not in " ".join(SlurmBackend().sbatch_args(task))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    os.geteuid() != 0 or bool(sandbox.problem()), reason="the default isolates only as root with bubblewrap"
)
async def test_the_demo_runs_isolated_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tandem demo` on the default settings, as root: the trainer, the Task App and the inference worker run
    as the demo organization's own user in bubblewrap, and the whole flow still ends with an answer."""
    monkeypatch.delenv("TANDEM_SCHEDULER_LOCAL__RUN_AS")
    state = tmp_path / "state"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "demo", "--steps", "2", "--state-dir", str(state),
        "--model-dir", str(tmp_path / "model"), cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(process.communicate(), 580)
    text = out.decode()
    assert process.returncode == 0, text
    assert (
        "orgs/demo/jobs/demo ended SUCCEEDED" in text
        and "(from orgs/demo/jobs/demo/checkpoints/step-2)" in text
    )
    demo_user = pwd.getpwnam("tdm-demo").pw_uid
    jobs = state / "scheduler" / "jobs"
    for task in (jobs / "orgs-demo-jobs-demo" / "trainer", jobs / "orgs-demo-jobs-demo" / "task-app"):
        assert task.stat().st_uid == demo_user, task
    assert (state / "mesh.key").stat().st_uid == 0 and (state / "mesh.key").stat().st_mode & 0o077 == 0

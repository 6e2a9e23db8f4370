"""SkyPilot task files loaded by `load_yaml` and run through CreateJob on the local backend and on the real
one-node Slurm cluster (tests/support/slurm.py): `workdir` (a folder, a git repository), bucket `file_mounts`
against a real S3-compatible server (moto's, signatures checked; tests/support/s3.py) whose key the
organization keeps in the vault, and `resources.ports`, `disk_size`, `use_spot` and `image_id`."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tandem.scheduler.v1 import job_pb2, job_spec_pb2
from tandem.scheduler.v1 import scheduler_service_pb2 as pb

from mesh.identity import TokenSigner, load_signing_key
from services.scheduler.spec import load_yaml
from tests.services.scheduler.test_scheduler import ORG, TERMINAL, Clients, log_text, put_secret, wait_for
from tests.support.git_http import git_http_server
from tests.support.mesh import mesh_settings, running_mesh
from tests.support.s3 import S3Server, s3_server
from tests.support.slurm import TMP_DISK_MB

__all__ = ["s3_server"]
pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[3]
State = job_pb2.Job.State


BACKENDS = {"local": job_spec_pb2.BACKEND_LOCAL, "slurm": job_spec_pb2.BACKEND_SLURM}


class Acme(Clients):
    backend: str = "local"
    slurm_conf: str = ""


@pytest.fixture(params=["local", pytest.param("slurm", marks=pytest.mark.slow)])
async def acme(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Acme]:
    monkeypatch.setenv("TANDEM_SCHEDULER_BUCKET_SYNC_INTERVAL_S", "0.5")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CPUS", "2")
    monkeypatch.setenv("TANDEM_SCHEDULER_DEFAULT_BACKEND", request.param)
    if request.param == "slurm":
        cluster = request.getfixturevalue("slurm_cluster")
        monkeypatch.setenv("TANDEM_SCHEDULER_SLURM__ENABLED", "true")
        monkeypatch.setenv("TANDEM_SCHEDULER_SLURM__CONF", str(cluster.conf))
    async with running_mesh(
        mesh_settings(tmp_path / "mesh"), services=["events", "vault", "taskapp_proxy", "scheduler"]
    ) as mesh:
        signer = TokenSigner(load_signing_key("", mesh.settings.state_dir))
        clients = Acme(mesh, signer.issue("user", "alice", org="acme", ttl_s=600))
        clients.backend = request.param
        if request.param == "slurm":
            clients.slurm_conf = str(cluster.conf)
        yield clients
        await clients.close()


async def submit(clients: Clients, spec: job_spec_pb2.JobSpec) -> job_pb2.Job:
    reply = await clients.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, spec=spec))
    return reply.job


def write_job(folder: Path, text: str) -> Path:
    path = folder / "task.yaml"
    path.write_text(textwrap.dedent(text))
    return path


async def store_key(clients: Clients, s3: S3Server) -> None:
    await put_secret(clients, "aws-access-key-id", s3.key_id.encode())
    await put_secret(clients, "aws-secret-access-key", s3.secret.encode())


async def dataset_bucket(clients: Clients, s3: S3Server, files: dict[str, bytes]) -> Any:
    """The bucket `datasets` with `files` in it, and the organization's key to it in the vault; the store."""
    await store_key(clients, s3)
    store = s3.store()
    store.mkdir("datasets")
    for name, data in files.items():
        store.pipe_file(f"datasets/{name}", data)
    return store


async def test_workdir_and_buckets_as_skypilot_writes_them(
    acme: Acme, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await dataset_bucket(acme, s3_server, {"gsm/train.jsonl": b'{"q": "2+2"}\n'})
    code = tmp_path / "project"
    (code / "src").mkdir(parents=True)
    (code / "src" / "train.py").write_text("print('training from the workdir')\n")
    job_file = write_job(
        tmp_path,
        f"""\
        name: finetune
        workdir: project
        envs:
          AWS_ENDPOINT_URL: {s3_server.endpoint}
          PYTHONPATH: {ROOT}
        secrets:
          AWS_ACCESS_KEY_ID: null
          AWS_SECRET_ACCESS_KEY: null
        file_mounts:
          /data: s3://datasets/gsm
          /checkpoints:
            name: finetune-ckpts
            store: s3
            mode: MOUNT_CACHED
        setup: test -f src/train.py
        run: |
          python src/train.py
          cat "$TANDEM_MOUNT_DATA/train.jsonl"
          echo weights > "$TANDEM_MOUNT_CHECKPOINTS/step-1.bin"
        """,
    )
    monkeypatch.chdir(tmp_path)  # SkyPilot reads a relative workdir from where `sky launch` runs
    spec = load_yaml(job_file)
    assert spec.tasks[0].workdir.path == str(code)
    job = await submit(acme, spec)
    done = await wait_for(acme, job.name, *TERMINAL, within_s=180)
    logs = await log_text(acme, job.name)
    assert done.state == State.STATE_SUCCEEDED, (done.failure.message, logs)
    assert done.backend == BACKENDS[acme.backend]
    assert "training from the workdir" in logs
    assert '{"q": "2+2"}' in logs
    assert store.cat_file("finetune-ckpts/step-1.bin") == b"weights\n"


async def test_a_non_persistent_bucket_the_job_made_is_deleted_when_it_ends(
    acme: Acme, s3_server: S3Server, tmp_path: Path
) -> None:
    await store_key(acme, s3_server)
    store = s3_server.store()
    store.mkdir("kept-scratch")  # there before the job: someone's own, kept
    store.pipe_file("kept-scratch/theirs.txt", b"theirs\n")
    job_file = write_job(
        tmp_path,
        f"""\
        name: scratch
        envs:
          AWS_ENDPOINT_URL: {s3_server.endpoint}
          PYTHONPATH: {ROOT}
        secrets:
          AWS_ACCESS_KEY_ID: null
          AWS_SECRET_ACCESS_KEY: null
        file_mounts:
          /scratch: {{name: job-scratch, mode: MOUNT, persistent: false}}
          /kept: {{name: kept-scratch, mode: MOUNT, persistent: false}}
        run: |
          echo partial > "$TANDEM_MOUNT_SCRATCH/part-1.bin"
          ls -a "$TANDEM_MOUNT_SCRATCH" "$TANDEM_MOUNT_KEPT"
        """,
    )
    job = await submit(acme, load_yaml(job_file))
    done = await wait_for(acme, job.name, *TERMINAL, within_s=180)
    logs = await log_text(acme, job.name)
    assert done.state == State.STATE_SUCCEEDED, (done.failure.message, logs)
    assert ".tandem-made-by" not in logs  # the job's own mark is never the task's to see
    deadline = asyncio.get_running_loop().time() + 60
    while await asyncio.to_thread(store.exists, "job-scratch"):
        assert asyncio.get_running_loop().time() < deadline, "the job's bucket was not deleted"
        await asyncio.sleep(0.5)
        store.invalidate_cache()
    assert store.cat_file("kept-scratch/theirs.txt") == b"theirs\n"


async def test_a_git_workdir_is_checked_out_at_its_ref(acme: Acme, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    git("init", "-q", "-b", "main")
    (repo / "version.txt").write_text("first\n")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    git("tag", "v1")
    (repo / "version.txt").write_text("second\n")
    git("commit", "-q", "-am", "second")
    job_file = write_job(
        tmp_path,
        f"""\
        workdir:
          url: file://{repo}
          ref: v1
        run: cat version.txt
        """,
    )
    job = await submit(acme, load_yaml(job_file))
    done = await wait_for(acme, job.name, *TERMINAL, within_s=120)
    logs = await log_text(acme, job.name)
    assert done.state == State.STATE_SUCCEEDED, (done.failure.message, logs)
    assert "first" in logs and "second" not in logs


def private_repo(root: Path) -> None:
    """`root/private.git`, a bare repository whose main holds version.txt: "private"."""
    repo, work = root / "private.git", root / "work"
    for args in (["init", "-q", "--bare", "-b", "main", str(repo)], ["init", "-q", "-b", "main", str(work)]):
        subprocess.run(["git", *args], check=True, capture_output=True)
    (work / "version.txt").write_text("private\n")
    for args in (["add", "."], ["commit", "-q", "-m", "one"], ["push", "-q", str(repo), "main"]):
        subprocess.run(
            ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t", *args],
            check=True,
            capture_output=True,
        )


async def test_a_private_git_workdir_is_fetched_with_the_tasks_git_token(acme: Acme, tmp_path: Path) -> None:
    private_repo(tmp_path / "repos")
    await put_secret(acme, "git-token", b"a-forge-token")
    with git_http_server(tmp_path / "repos", "x-access-token", "a-forge-token") as url:
        text = f"""\
            workdir: {{url: {url}/private.git, ref: main}}
            secrets: {{GIT_TOKEN: null}}
            run: cat version.txt
            """
        job = await submit(acme, load_yaml(write_job(tmp_path, text)))
        done = await wait_for(acme, job.name, *TERMINAL, within_s=120)
        logs = await log_text(acme, job.name)
        assert done.state == State.STATE_SUCCEEDED, (done.failure.message, logs)
        assert "private" in logs and "a-forge-token" not in logs
        (tmp_path / "no-token").mkdir()
        anonymous = write_job(tmp_path / "no-token", text.replace("secrets: {GIT_TOKEN: null}", ""))
        job = await submit(acme, load_yaml(anonymous))
        done = await wait_for(acme, job.name, *TERMINAL, within_s=120)  # refused at once, never prompting
    assert done.failure.failure_class == job_pb2.Failure.CLASS_PRECHECK, done.failure
    assert "cannot fill the workdir" in await log_text(acme, job.name)


async def test_buckets_that_cannot_be_read_are_a_precheck_failure(
    acme: Acme, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_server.store().mkdir("private")
    # The mesh's own environment holds a valid key; a task that declares no secrets must not get it.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret)
    job_file = write_job(
        tmp_path,
        f"""\
        envs:
          AWS_ENDPOINT_URL: {s3_server.endpoint}
          PYTHONPATH: {ROOT}
        file_mounts:
          /data: {{source: s3://private, mode: COPY}}
        run: echo ran-the-task
        """,
    )
    job = await submit(acme, load_yaml(job_file))
    done = await wait_for(acme, job.name, *TERMINAL, within_s=120)
    assert done.state == State.STATE_FAILED
    assert done.failure.failure_class == job_pb2.Failure.CLASS_PRECHECK, done.failure
    logs = await log_text(acme, job.name)
    assert "cannot copy the task's buckets down" in logs
    assert "ran-the-task" not in logs.replace("echo ran-the-task", "")


async def refused(clients: Acme, text: str, folder: Path) -> tuple[job_pb2.Job, str]:
    """Run a job file that must fail before its `run`: the job and its log."""
    job = await submit(clients, load_yaml(write_job(folder, text)))
    done = await wait_for(clients, job.name, *TERMINAL, within_s=120)
    logs = await log_text(clients, job.name)
    assert done.state == State.STATE_FAILED, logs
    assert done.failure.failure_class == job_pb2.Failure.CLASS_PRECHECK, done.failure
    assert "ran-the-task" not in logs.replace("echo ran-the-task", "")
    return done, logs


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_ports_are_the_tasks_and_a_taken_one_is_a_precheck_failure(acme: Acme, tmp_path: Path) -> None:
    port = free_port()
    serve = (
        f'echo "ports=$TANDEM_PORTS"; python -c "import socket; s = socket.socket(); '
        f"s.bind(('0.0.0.0', {port})); s.listen(); print('listening')\""
    )
    text = f"resources:\n  ports: {port}\nrun: |\n  {serve}\n"
    job = await submit(acme, load_yaml(write_job(tmp_path, text)))
    done = await wait_for(acme, job.name, *TERMINAL, within_s=120)
    logs = await log_text(acme, job.name)
    assert done.state == State.STATE_SUCCEEDED, (done.failure.message, logs)
    assert f"ports={port}" in logs and "listening" in logs
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", port))  # noqa: S104 - as a task on the node would
        taken.listen()
        text = f"resources:\n  ports: [{port}, '{port + 1}-{port + 2}']\nrun: echo ran-the-task\n"
        _, logs = await refused(acme, text, tmp_path)
    assert f"port {port} (resources.ports) is in use" in logs


async def test_disk_size_is_asked_of_the_node(acme: Acme, tmp_path: Path) -> None:
    fits = TMP_DISK_MB / 1024 / 2  # GiB: within the Slurm node's TmpDisk, and free on this machine
    job = await submit(
        acme, load_yaml(write_job(tmp_path, f"resources:\n  disk_size: {fits}\nrun: echo has-disk\n"))
    )
    done = await wait_for(acme, job.name, *TERMINAL, within_s=120)
    assert done.state == State.STATE_SUCCEEDED, done.failure.message
    too_much = shutil.disk_usage(tmp_path).total // 2**30 + 1024
    done, _ = await refused(acme, f"resources:\n  disk_size: {too_much}\nrun: echo ran-the-task\n", tmp_path)
    words = {"local": "GiB of disk (resources.disk_size)", "slurm": "node configuration is not available"}
    assert words[acme.backend] in done.failure.message, done.failure.message


def container_runtime_works() -> bool:
    for name in ("docker", "podman"):
        path = shutil.which(name)
        if (
            path
            and subprocess.run([path, "info"], capture_output=True, timeout=20, check=False).returncode == 0
        ):
            return True
    return False


async def test_an_image_without_a_way_to_run_it_is_a_precheck_failure(acme: Acme, tmp_path: Path) -> None:
    if acme.backend == "local" and container_runtime_works():
        pytest.skip("this machine has a working docker or podman: the task would run in its image")
    text = "resources:\n  image_id: docker:nvcr.io/nvidia/pytorch:24.01-py3\nrun: echo ran-the-task\n"
    done, _ = await refused(acme, text, tmp_path)
    words = {"local": "no container runtime that works", "slurm": "no pyxis plugin"}
    assert words[acme.backend] in done.failure.message, done.failure.message
    assert "nvcr.io/nvidia/pytorch:24.01-py3" in done.failure.message


async def test_spot_groups_wait_behind_every_other_group(acme: Acme, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    hold = f"run: while [ ! -e {gate} ]; do sleep 0.05; done\n"
    blocker = await submit(acme, load_yaml(write_job(tmp_path, "resources: {cpus: 2}\n" + hold)))
    await wait_for(acme, blocker.name, State.STATE_RUNNING, within_s=120)
    spot = await submit(
        acme, load_yaml(write_job(tmp_path, "resources: {cpus: 2, use_spot: true}\nrun: echo spot\n"))
    )
    second = tmp_path / "second-gate"
    later = await submit(
        acme,
        load_yaml(
            write_job(
                tmp_path, f"resources: {{cpus: 2}}\nrun: while [ ! -e {second} ]; do sleep 0.05; done\n"
            )
        ),
    )
    gate.touch()
    # The spot group came first and has waited longer; the other is still admitted before it.
    await wait_for(acme, later.name, State.STATE_RUNNING, within_s=120)
    pending = (await acme.scheduler.GetJob(pb.GetJobRequest(name=spot.name))).job
    assert pending.state == State.STATE_PENDING
    second.touch()
    assert (await wait_for(acme, spot.name, *TERMINAL, within_s=120)).state == State.STATE_SUCCEEDED
    if acme.backend == "slurm":  # submitted below every other attempt, and requeued when preempted
        finished = (await acme.scheduler.GetJob(pb.GetJobRequest(name=spot.name))).job
        slurm_id = finished.tasks[0].backend_handle.slurm.job_id
        shown = await asyncio.to_thread(
            subprocess.run,
            ["scontrol", "show", "job", slurm_id],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "SLURM_CONF": acme.slurm_conf},
        )
        assert "Nice=3001" in shown.stdout and "Requeue=1" in shown.stdout, shown.stdout  # 1000 + 2001

"""A task's image on the local backend (services/scheduler/backends/task_image.py): pulled within the
scheduler's bound before the task runs, logged in to a private registry with the task's vault secrets
(SkyPilot's SKYPILOT_DOCKER_USERNAME / _PASSWORD / _SERVER) through a private auth file, and a pull that fails
or hangs a PRECHECK failure naming the image, the bound and what the runtime said. With a real podman
(Debian's `podman`) where one works here: a registry that refuses connections, one that accepts them and
never answers, and a job whose registry login comes from the vault; those tests skip without podman."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s
from tandem.scheduler.v1 import job_pb2, job_spec_pb2
from tandem.vault.v1 import vault_service_pb2

from mesh.errors import InvalidArgument
from services.scheduler import expand
from services.scheduler.backends import task_image
from services.scheduler.backends.base import LaunchSpec
from services.scheduler.backends.kubernetes import KubernetesBackend, docker_config
from services.scheduler.backends.slurm import SlurmBackend
from services.scheduler.backends.task_image import Login, login_command, pull_command, reference
from services.scheduler.backends.task_secrets import format_secrets
from services.scheduler.spec import load_yaml, parse_yaml
from tests.services.scheduler.test_kubernetes_jobs import acme as kube_acme
from tests.services.scheduler.test_kubernetes_jobs import cluster
from tests.services.scheduler.test_scheduler import ORG, TERMINAL, Clients, log_text, put_secret, wait_for
from tests.services.scheduler.test_skypilot_files import submit
from tests.support.images import containers_conf_that_runs, import_image
from tests.support.kube_api import FakeKubeApi, running_kube_api
from tests.support.mesh import mesh_settings, running_mesh
from tests.support.registry import private_registry

__all__ = ["cluster", "kube_acme"]  # fixtures
pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[3]
State = job_pb2.Job.State
PASSWORD = "hunter2-registry-password"


def podman() -> str | None:
    path = shutil.which("podman")
    if path is None:
        return None
    try:
        done = subprocess.run([path, "info"], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if done.returncode == 0 else None


PODMAN = podman()
needs_podman = pytest.mark.skipif(PODMAN is None, reason="no working podman here (apt-get install podman)")


@contextlib.contextmanager
def silent_registry() -> Iterator[int]:
    """A TCP port that accepts connections and never answers: a registry that hangs."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1])
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # closed again: connections are refused


def run_helper(image: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`task_image` as the local backend's rank runs it, with this checkout on the path."""
    return subprocess.run(
        [sys.executable, "-m", "services.scheduler.backends.task_image", image, "--rm", "--", "true"],
        env={"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path), **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_references_are_written_out_as_docker_reads_them() -> None:
    assert reference("ubuntu:22.04") == "docker.io/library/ubuntu:22.04"
    assert reference("pytorch/pytorch:2.3.1") == "docker.io/pytorch/pytorch:2.3.1"
    assert reference("nvcr.io/nvidia/pytorch:24.01-py3") == "nvcr.io/nvidia/pytorch:24.01-py3"
    assert reference("localhost:5000/team/img:1") == "localhost:5000/team/img:1"
    assert reference("localhost/img") == "localhost/img"
    login = Login("alice", PASSWORD, "registry.acme.dev")
    # SkyPilot's DockerLoginConfig.format_image: the server in front, unless it is there.
    assert reference("team/trainer:1", login) == "registry.acme.dev/team/trainer:1"
    assert reference("registry.acme.dev/team/trainer:1", login) == "registry.acme.dev/team/trainer:1"
    assert PASSWORD not in repr(login)


def test_a_login_needs_all_three_variables() -> None:
    given = {"SKYPILOT_DOCKER_USERNAME": "alice", "SKYPILOT_DOCKER_PASSWORD": PASSWORD}
    assert task_image.login_from(given) is None
    given["SKYPILOT_DOCKER_SERVER"] = "registry.acme.dev"
    assert task_image.login_from(given) == Login("alice", PASSWORD, "registry.acme.dev")


def test_the_login_goes_to_a_private_auth_file_and_the_password_through_stdin(tmp_path: Path) -> None:
    login = Login("alice", PASSWORD, "registry.acme.dev")
    auth = tmp_path / "private" / "auth.json"
    argv, extra = login_command("/usr/bin/podman", login, auth)
    assert argv == [
        "/usr/bin/podman",
        *("login", "--username", "alice", "--password-stdin", "--authfile", str(auth)),
        "registry.acme.dev",
    ]
    assert extra == {}
    assert pull_command("/usr/bin/podman", "registry.acme.dev/t:1", auth)[0] == [
        *("/usr/bin/podman", "pull", "--authfile", str(auth)),
        "registry.acme.dev/t:1",
    ]
    argv, extra = login_command("/usr/bin/docker", login, auth)
    assert argv == [
        *("/usr/bin/docker", "login", "--username", "alice", "--password-stdin"),
        "registry.acme.dev",
    ]
    assert extra == {"DOCKER_CONFIG": str(auth.parent)}  # docker's config.json there, not ~/.docker
    assert pull_command("/usr/bin/docker", "registry.acme.dev/t:1", auth) == (
        ["/usr/bin/docker", "pull", "registry.acme.dev/t:1"],
        {"DOCKER_CONFIG": str(auth.parent)},
    )
    assert pull_command("/usr/bin/docker", "registry.acme.dev/t:1", None) == (
        ["/usr/bin/docker", "pull", "registry.acme.dev/t:1"],
        {},
    )
    assert not any(PASSWORD in word for word in argv)


def test_a_missing_runtime_is_a_precheck_exit(tmp_path: Path) -> None:
    done = run_helper("ubuntu:22.04", {}, tmp_path)
    assert done.returncode == task_image.PRECHECK_EXIT == expand.SETUP_FAILED_EXIT
    assert "TANDEM_CONTAINER_RUNTIME is not set" in done.stderr


@needs_podman
def test_a_registry_that_refuses_is_a_precheck_exit_naming_the_image(tmp_path: Path) -> None:
    assert PODMAN is not None
    image = f"127.0.0.1:{closed_port()}/none:latest"
    env = {task_image.RUNTIME_ENV: PODMAN, task_image.PULL_TIMEOUT_ENV: "60"}
    done = run_helper(image, env, tmp_path)
    assert done.returncode == task_image.PRECHECK_EXIT, done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("[tandem]")]
    assert line.startswith(f"[tandem] the image {image} could not be pulled in 60 s (exit 125): ")
    assert "connection refused" in line


@needs_podman
def test_a_registry_that_hangs_is_stopped_at_the_bound(tmp_path: Path) -> None:
    assert PODMAN is not None
    with silent_registry() as port:
        image = f"127.0.0.1:{port}/team/trainer:1"
        env = {task_image.RUNTIME_ENV: PODMAN, task_image.PULL_TIMEOUT_ENV: "2"}
        done = run_helper(image, env, tmp_path)
    assert done.returncode == task_image.PRECHECK_EXIT, done.stderr
    assert f"[tandem] the image {image} could not be pulled in 2 s (the pull was stopped)" in done.stderr


@needs_podman
def test_a_login_that_fails_says_so_and_leaves_no_auth_file(tmp_path: Path) -> None:
    assert PODMAN is not None
    server = f"127.0.0.1:{closed_port()}"
    private = tmp_path / "attempt"
    private.mkdir(mode=0o700)
    env = {
        task_image.RUNTIME_ENV: PODMAN,
        task_image.PULL_TIMEOUT_ENV: "60",
        task_image.ATTEMPT_DIR_ENV: str(private),
        "SKYPILOT_DOCKER_USERNAME": "alice",
        "SKYPILOT_DOCKER_PASSWORD": PASSWORD,
        "SKYPILOT_DOCKER_SERVER": server,
    }
    done = run_helper("team/trainer:1", env, tmp_path)
    assert done.returncode == task_image.PRECHECK_EXIT, done.stderr
    assert (
        f"the image {server}/team/trainer:1 could not be pulled in 60 s: logging in to {server} as alice "
        "failed (exit 125)"
    ) in done.stderr
    assert PASSWORD not in done.stderr + done.stdout
    assert list(private.iterdir()) == []  # the auth folder went with the pull


@needs_podman
def test_a_private_registry_is_logged_in_to_and_pulled_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert PODMAN is not None
    files = {"etc/tandem-image": b"from the private registry\n"}
    with private_registry(tmp_path, "alice", PASSWORD, files) as registry:
        monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(registry.conf))  # plain HTTP, for the test
        try:
            anonymous = pytest.raises(
                task_image.PullFailed, match="could not be pulled in 60 s \\(exit 125\\)"
            )
            with anonymous:
                task_image.pull(PODMAN, registry.image, timeout_s=60, private_dir=tmp_path)
            wrong = Login("alice", "not-the-password", registry.host)
            with pytest.raises(task_image.PullFailed, match=f"logging in to {registry.host} as alice failed"):
                task_image.pull(PODMAN, registry.image, timeout_s=60, login=wrong, private_dir=tmp_path)
            assert registry.pulled == []
            login = Login("alice", PASSWORD, registry.host)
            assert task_image.pull(PODMAN, registry.image, timeout_s=60, login=login, private_dir=tmp_path)
            assert len(set(registry.pulled)) == 2  # the config and the layer, with the credentials
            assert task_image.has_image(PODMAN, registry.image, 30)
            # An image the runtime has is not pulled again, with or without credentials.
            assert not task_image.pull(PODMAN, registry.image, timeout_s=60, private_dir=tmp_path)
            assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".registry-auth-")] == []
        finally:
            subprocess.run([PODMAN, "rmi", "-f", registry.image], capture_output=True, check=False)


# ---- through the scheduler, on the local backend ------------------------------------------------------


@pytest.fixture
async def acme_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Clients]:
    from mesh.identity import TokenSigner, load_signing_key  # noqa: PLC0415

    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CPUS", "2")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CONTAINER_RUNTIMES", '["podman"]')
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__IMAGE_PULL_TIMEOUT_S", "3")
    async with running_mesh(
        mesh_settings(tmp_path / "mesh"), services=["events", "vault", "taskapp_proxy", "scheduler"]
    ) as mesh:
        signer = TokenSigner(load_signing_key("", mesh.settings.state_dir))
        clients = Clients(mesh, signer.issue("user", "alice", org="acme", ttl_s=600))
        yield clients
        await clients.close()


async def failed_before_run(clients: Clients, text: str, folder: Path) -> tuple[job_pb2.Job, str]:
    path = folder / "task.yaml"
    path.write_text(textwrap.dedent(text))
    job = await submit(clients, load_yaml(path))
    done = await wait_for(clients, job.name, *TERMINAL, within_s=120)
    logs = await log_text(clients, job.name)
    assert done.state == State.STATE_FAILED, logs
    assert done.failure.failure_class == job_pb2.Failure.CLASS_PRECHECK, done.failure
    assert "ran-the-task" not in logs.replace("echo ran-the-task", "")
    return done, logs


@needs_podman
async def test_an_image_whose_pull_hangs_fails_the_task_at_the_bound(
    acme_local: Clients, tmp_path: Path
) -> None:
    with silent_registry() as port:
        image = f"127.0.0.1:{port}/team/trainer:1"
        text = f"""\
            envs:
              PYTHONPATH: {ROOT}
            resources:
              image_id: docker:{image}
            run: echo ran-the-task
            """
        done, _ = await failed_before_run(acme_local, text, tmp_path)
    assert f"the image {image} could not be pulled in 3 s (the pull was stopped)" in done.failure.message


@needs_podman
async def test_the_registry_login_comes_from_the_vault(acme_local: Clients, tmp_path: Path) -> None:
    server = f"127.0.0.1:{closed_port()}"
    await put_secret(acme_local, "skypilot-docker-username", b"alice")
    await put_secret(acme_local, "skypilot-docker-password", PASSWORD.encode())
    await put_secret(acme_local, "skypilot-docker-server", server.encode())
    text = f"""\
        envs:
          PYTHONPATH: {ROOT}
        secrets:
          SKYPILOT_DOCKER_USERNAME: null
          SKYPILOT_DOCKER_PASSWORD: null
          SKYPILOT_DOCKER_SERVER: null
        resources:
          image_id: docker:team/trainer:1
        run: echo ran-the-task
        """
    done, logs = await failed_before_run(acme_local, text, tmp_path)
    assert (
        f"the image {server}/team/trainer:1 could not be pulled in 3 s: logging in to {server} as alice"
        in (done.failure.message)
    )
    assert PASSWORD not in done.failure.message + logs
    attempts = list((tmp_path / "mesh").rglob(".registry-auth-*"))
    assert attempts == []  # nothing of the login is left on the machine


@pytest.fixture
def runnable_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An image made here (bash, busybox, a file of its own) that podman runs; where this machine's podman
    needs a containers.conf for that, CONTAINERS_CONF names it for the scheduler about to start."""
    assert PODMAN is not None
    image = import_image(
        PODMAN,
        tmp_path,
        f"localhost/tandem-task-test:{os.getpid()}",
        {"etc/tandem-image": b"only in the image\n"},
    )
    try:
        try:
            conf = containers_conf_that_runs(PODMAN, image, tmp_path)
        except RuntimeError as exc:
            pytest.skip(str(exc))
        if conf is not None:
            monkeypatch.setenv("CONTAINERS_CONF", str(conf))
        yield image
    finally:
        subprocess.run([PODMAN, "rmi", "-f", image], capture_output=True, check=False)


@needs_podman
async def test_a_task_runs_in_its_image(
    runnable_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole way: a job file's `image_id` through CreateJob to the local backend, whose task runs in that
    image under podman, as the caller's uid, in its working directory and with its variables."""
    from mesh.identity import TokenSigner, load_signing_key  # noqa: PLC0415

    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CPUS", "2")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CONTAINER_RUNTIMES", '["podman"]')
    path = tmp_path / "task.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            envs:
              PYTHONPATH: {ROOT}
              GREETING: from-the-job-file
            resources:
              image_id: docker:{runnable_image}
            run: |
              cat /etc/tandem-image
              test ! -e /etc/debian_version && echo not-the-hosts-root
              echo "uid=$(id -u) greeting=$GREETING"
              echo written-in-the-image > made-here.txt
            """
        )
    )
    async with running_mesh(
        mesh_settings(tmp_path / "mesh"), services=["events", "vault", "taskapp_proxy", "scheduler"]
    ) as mesh:
        signer = TokenSigner(load_signing_key("", mesh.settings.state_dir))
        clients = Clients(mesh, signer.issue("user", "alice", org="acme", ttl_s=600))
        job = await submit(clients, load_yaml(path))
        done = await wait_for(clients, job.name, *TERMINAL, within_s=180)
        logs = await log_text(clients, job.name)
        await clients.close()
    assert done.state == State.STATE_SUCCEEDED, (done.failure.message, logs)
    assert "only in the image" in logs
    assert "not-the-hosts-root" in logs
    assert f"uid={os.getuid()} greeting=from-the-job-file" in logs
    # The working directory is the task's folder on the host, at its own path.
    assert [p.read_text() for p in (tmp_path / "mesh").rglob("made-here.txt")] == ["written-in-the-image\n"]


# ---- Slurm: the batch shell opens the login for pyxis/enroot or Apptainer ----------------------------

LOGIN_SECRETS = {
    "SKYPILOT_DOCKER_USERNAME": "orgs/acme/secrets/skypilot-docker-username",
    "SKYPILOT_DOCKER_PASSWORD": "orgs/acme/secrets/skypilot-docker-password",
    "SKYPILOT_DOCKER_SERVER": "orgs/acme/secrets/skypilot-docker-server",
}


def slurm_spec(tmp_path: Path, **overrides: object) -> LaunchSpec:
    values: dict[str, object] = {
        "key": "orgs-acme-jobs-j1.train.0",
        "job": "orgs/acme/jobs/j1",
        "task": "train",
        "attempt": 0,
        "command": "echo in-the-image",
        "env": {"TANDEM_JOB": "orgs/acme/jobs/j1"},
        "log_dir": tmp_path / "logs",
        "workdir": tmp_path / "work",
        "image": "team/trainer:1",
        "secret_env": {**LOGIN_SECRETS, "HF_TOKEN": "orgs/acme/secrets/hf-token"},
    }
    values.update(overrides)
    return LaunchSpec(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_the_slurm_batch_shell_opens_the_registry_login_before_the_step(tmp_path: Path, runtime: str) -> None:
    script = SlurmBackend(container_runtime=runtime).batch_script(slurm_spec(tmp_path))
    lines = script.splitlines()
    [made] = [line for line in lines if line.startswith("tandem_registry=")]
    assert made == f"tandem_registry=$(mktemp -d {tmp_path / 'work'}/.tandem-registry-XXXXXX) || exit 223"
    assert """trap 'rm -rf "$tandem_registry"' EXIT""" in lines  # gone when the batch job ends
    step = script.split("""\ntrap 'rm -rf "$tandem_registry"' EXIT\n""", 1)[1].rsplit("\ncode=$?", 1)[0]
    words = shlex.split(step.replace('"$tandem_registry"', "FOLDER"))
    helper = words[: words.index("--")]
    assert helper[1:] == [
        *("-m", "services.scheduler.backends.task_image", "--slurm", runtime),
        *("--secrets", format_secrets(LOGIN_SECRETS), "--folder", "FOLDER", "--image", "team/trainer:1"),
    ]
    assert words[words.index("--") + 1] == "srun"  # the names of the secrets only, never a value
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0
    plain = SlurmBackend().batch_script(slurm_spec(tmp_path, secret_env={"HF_TOKEN": "orgs/acme/secrets/x"}))
    assert "tandem_registry" not in plain and "task_image" not in plain
    assert "task_image" not in SlurmBackend().batch_script(slurm_spec(tmp_path, image=""))


def test_enroot_gets_a_private_credentials_file_and_the_servers_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKYPILOT_DOCKER_USERNAME", "alice")
    monkeypatch.setenv("SKYPILOT_DOCKER_PASSWORD", PASSWORD)
    monkeypatch.setenv("SKYPILOT_DOCKER_SERVER", "registry.acme.dev:5000")
    folder = tmp_path / "registry"
    folder.mkdir(mode=0o700)
    srun = ["srun", "--container-image=team/trainer:1", "--container-workdir=/w", "bash", "-c", "x"]
    argv, extra = task_image.slurm_step("pyxis", folder, "team/trainer:1", srun)
    assert argv == ["srun", "--container-image=registry.acme.dev:5000#team/trainer:1", *srun[2:]]
    assert extra == {"ENROOT_CONFIG_PATH": str(folder)}
    credentials = folder / ".credentials"
    assert credentials.read_text() == f"machine registry.acme.dev login alice password {PASSWORD}\n"
    assert credentials.stat().st_mode & 0o777 == 0o600
    assert not any(PASSWORD in word for word in argv)
    hub = Login("alice", PASSWORD, "docker.io")
    assert task_image.enroot_credentials(hub).split("\n")[:2] == [
        f"machine auth.docker.io login alice password {PASSWORD}",
        f"machine registry-1.docker.io login alice password {PASSWORD}",
    ]


def test_apptainer_gets_the_login_in_its_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKYPILOT_DOCKER_USERNAME", "alice")
    monkeypatch.setenv("SKYPILOT_DOCKER_PASSWORD", PASSWORD)
    monkeypatch.setenv("SKYPILOT_DOCKER_SERVER", "registry.acme.dev")
    srun = ["srun", "apptainer", "exec", "--pwd", "/w", "docker://team/trainer:1", "bash"]
    argv, extra = task_image.slurm_step("apptainer", tmp_path, "team/trainer:1", srun)
    assert argv == [*srun[:5], "docker://registry.acme.dev/team/trainer:1", "bash"]
    assert extra["APPTAINER_DOCKER_USERNAME"] == "alice" and extra["APPTAINER_DOCKER_PASSWORD"] == PASSWORD
    assert extra["SINGULARITY_DOCKER_PASSWORD"] == PASSWORD  # the older name, for singularity
    assert list(tmp_path.iterdir()) == []  # no file at all
    monkeypatch.delenv("SKYPILOT_DOCKER_SERVER")
    with pytest.raises(task_image.PullFailed, match="the registry login lacks SKYPILOT_DOCKER_SERVER"):
        task_image.slurm_step("apptainer", tmp_path, "team/trainer:1", srun)


# ---- Kubernetes: a pull Secret of the attempt's, opened by the engine from the vault ------------------


def test_the_pull_secret_is_the_attempts_own_and_goes_with_its_job(tmp_path: Path) -> None:
    with running_kube_api() as api:
        backend = KubernetesBackend(
            namespace="tandem-jobs",
            image="tandem-trainer:test",
            image_pull_secrets=["deployment-pull"],
            configuration=k8s.Configuration(host=api.url),
            manage_priority_classes=False,
        )
        login = Login("alice", PASSWORD, "registry.acme.dev")
        spec = slurm_spec(tmp_path, registry_login=login, secret_env=LOGIN_SECRETS, workdir=None)
        handle = asyncio.run(backend.launch(spec))
        name = handle["job"]
        secret = api.objects[("secrets", "tandem-jobs", name)]
        assert secret["type"] == "kubernetes.io/dockerconfigjson"
        [owner] = secret["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Job", name, handle["uid"])
        config = json.loads(base64.b64decode(secret["data"][".dockerconfigjson"]))
        auth = base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
        assert config == {
            "auths": {"registry.acme.dev": {"username": "alice", "password": PASSWORD, "auth": auth}}
        }
        pod = api.objects[("jobs", "tandem-jobs", name)]["spec"]["template"]["spec"]
        assert pod["imagePullSecrets"] == [{"name": "deployment-pull"}, {"name": name}]
        assert pod["containers"][0]["image"] == "registry.acme.dev/team/trainer:1"  # SkyPilot's format_image
        assert PASSWORD not in json.dumps(pod)  # the pod spec names the Secret, never holds the value
        assert asyncio.run(backend.launch(spec)) == handle  # a second launch of the key: the same objects
        api.remove_job("tandem-jobs", name)
        assert ("secrets", "tandem-jobs", name) not in api.objects  # deleted with the Job
        plain = backend.job_object(slurm_spec(tmp_path, secret_env={}, workdir=None))
        assert plain["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "deployment-pull"}]
        assert plain["spec"]["template"]["spec"]["containers"][0]["image"] == "team/trainer:1"
        hub = json.loads(docker_config(Login("alice", PASSWORD, "docker.io")))
        assert list(hub["auths"]) == ["https://index.docker.io/v1/"]


async def test_the_engine_opens_the_registry_login_for_kubernetes(
    kube_acme: Clients, cluster: FakeKubeApi, tmp_path: Path
) -> None:
    await put_secret(kube_acme, "skypilot-docker-username", b"alice")
    await put_secret(kube_acme, "skypilot-docker-password", PASSWORD.encode())
    await put_secret(kube_acme, "skypilot-docker-server", b"registry.acme.dev")
    path = tmp_path / "task.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            secrets:
              SKYPILOT_DOCKER_USERNAME: null
              SKYPILOT_DOCKER_PASSWORD: null
              SKYPILOT_DOCKER_SERVER: null
            resources:
              image_id: docker:team/trainer:1
            run: echo ran-in-the-pod
            """
        )
    )
    spec = load_yaml(path)
    spec.backend = job_spec_pb2.BACKEND_KUBERNETES
    job = await submit(kube_acme, spec)
    done = await wait_for(kube_acme, job.name, *TERMINAL, within_s=120)
    assert done.state == State.STATE_SUCCEEDED, done.failure.message
    [secret] = [o for (plural, _ns, _n), o in cluster.objects.items() if plural == "secrets"]
    config = json.loads(base64.b64decode(secret["data"][".dockerconfigjson"]))
    assert config["auths"]["registry.acme.dev"]["password"] == PASSWORD
    [created] = [o for (plural, _ns, _n), o in cluster.objects.items() if plural == "jobs"]
    pod = created["spec"]["template"]["spec"]
    assert {"name": secret["metadata"]["name"]} in pod["imagePullSecrets"]
    assert pod["containers"][0]["image"] == "registry.acme.dev/team/trainer:1"


async def test_a_registry_login_the_vault_will_not_open_is_a_precheck_failure(
    kube_acme: Clients, cluster: FakeKubeApi, tmp_path: Path
) -> None:
    await put_secret(kube_acme, "skypilot-docker-username", b"alice")
    await put_secret(kube_acme, "skypilot-docker-password", PASSWORD.encode())
    await put_secret(kube_acme, "skypilot-docker-server", b"registry.acme.dev")
    path = tmp_path / "task.yaml"
    path.write_text(
        "secrets: {SKYPILOT_DOCKER_USERNAME: null, SKYPILOT_DOCKER_PASSWORD: null, SKYPILOT_DOCKER_SERVER: null}\n"
        "resources: {image_id: 'docker:team/trainer:1'}\nrun: echo ran-the-task\n"
    )
    spec = load_yaml(path)
    spec.backend = job_spec_pb2.BACKEND_KUBERNETES
    # The password's only version is disabled: CreateJob finds the secret, the vault will not open it.
    await kube_acme.vault.DisableSecretVersion(
        vault_service_pb2.DisableSecretVersionRequest(
            name=f"{ORG}/secrets/skypilot-docker-password/versions/1"
        )
    )
    job = await submit(kube_acme, spec)
    done = await wait_for(kube_acme, job.name, *TERMINAL, within_s=120)
    assert done.state == State.STATE_FAILED
    assert done.failure.failure_class == job_pb2.Failure.CLASS_PRECHECK, done.failure
    assert "the image team/trainer:1 could not be pulled: opening its registry login" in done.failure.message
    assert not [key for key in cluster.objects if key[0] in ("jobs", "secrets")]


# ---- the job file -----------------------------------------------------------------------------------


def test_the_registry_login_is_the_vaults_and_comes_whole() -> None:
    def refusals(text: str) -> dict[str, str]:
        with pytest.raises(InvalidArgument) as caught:
            parse_yaml(textwrap.dedent(text))
        return {v.field: v.description for v in caught.value.violations}

    image = "resources: {image_id: 'docker:team/trainer:1'}\nrun: echo hi\n"
    found = refusals(f"envs: {{SKYPILOT_DOCKER_PASSWORD: {PASSWORD}}}\n{image}")
    assert "is a registry login in the job file" in found['envs["SKYPILOT_DOCKER_PASSWORD"]']
    found = refusals(f"secrets: {{SKYPILOT_DOCKER_USERNAME: null, SKYPILOT_DOCKER_PASSWORD: null}}\n{image}")
    assert found["secrets"] == (  # SkyPilot's own reason
        "Docker login variables must be specified together in secrets. "
        "Missing from secrets: ['SKYPILOT_DOCKER_SERVER']"
    )
    whole = "secrets:\n" + "".join(f"  {name}: null\n" for name in task_image.LOGIN_ENVS)
    spec = parse_yaml(whole + image)
    assert sorted(b.secret for b in spec.tasks[0].secrets) == [
        "skypilot-docker-password",
        "skypilot-docker-server",
        "skypilot-docker-username",
    ]


async def test_the_slurm_batch_shells_login_opens_from_the_vault(acme_local: Clients, tmp_path: Path) -> None:
    """The batch shell's half (`task_image --slurm`) run for real with a job's token: a local job with the
    three secrets stands in for the batch job, as the Slurm cluster here has no pyxis to pull with."""
    await put_secret(acme_local, "skypilot-docker-username", b"alice")
    await put_secret(acme_local, "skypilot-docker-password", PASSWORD.encode())
    await put_secret(acme_local, "skypilot-docker-server", b"registry.acme.dev")
    helper = [sys.executable, "-m", "services.scheduler.backends.task_image", "--slurm", "pyxis"]
    helper += ["--secrets", format_secrets(LOGIN_SECRETS), "--folder", "FOLDER", "--image", "team/trainer:1"]
    probe = (
        'echo "step: $1"; stat -c "mode %a" "$ENROOT_CONFIG_PATH/.credentials"; '
        'grep -c "^machine registry.acme.dev login alice password " "$ENROOT_CONFIG_PATH/.credentials"'
    )
    step = ["--", "bash", "-c", probe, "srun", "--container-image=team/trainer:1"]
    line = shlex.join([*helper, *step]).replace("FOLDER", '"$folder"')
    path = tmp_path / "task.yaml"
    path.write_text(
        "envs:\n"
        f"  PYTHONPATH: {ROOT}\n"
        "secrets: {SKYPILOT_DOCKER_USERNAME: null, SKYPILOT_DOCKER_PASSWORD: null, SKYPILOT_DOCKER_SERVER: null}\n"
        "run: |\n"
        '  folder=$(mktemp -d "$PWD/.tandem-registry-XXXXXX")\n'
        f"  {line}\n"
    )
    job = await submit(acme_local, load_yaml(path))
    done = await wait_for(acme_local, job.name, *TERMINAL, within_s=120)
    logs = await log_text(acme_local, job.name)
    assert done.state == State.STATE_SUCCEEDED, (done.failure.message, logs)
    assert "step: --container-image=registry.acme.dev#team/trainer:1" in logs
    assert "mode 600" in logs and "\n1\n" in logs
    assert PASSWORD not in logs

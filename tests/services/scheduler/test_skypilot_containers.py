"""SkyPilot's `image_id: docker:IMAGE` and `use_spot` on the host backends: the Slurm batch job carries
pyxis's `--container-image` (or runs each node under `apptainer exec`, by the scheduler's setting), and a
cluster without the one configured refuses the launch, checked on the real one-node cluster, which has
neither; the local backend runs the script through docker or podman and refuses the launch without one that
works."""

from __future__ import annotations

import itertools
import shlex
from pathlib import Path

import pytest
from tandem.common.v1 import types_pb2
from tandem.scheduler.v1 import job_spec_pb2 as js

from services.scheduler import expand
from services.scheduler.backends.base import LaunchRefused, LaunchSpec, Resources
from services.scheduler.backends.local import LocalBackend
from services.scheduler.backends.slurm import SlurmBackend, enroot_image
from tests.support.slurm import SlurmCluster

IMAGE = "nvcr.io/nvidia/pytorch:24.01-py3"


def spec(tmp_path: Path, **overrides: object) -> LaunchSpec:
    values: dict[str, object] = {
        "key": "orgs-acme-jobs-j1.train.0",
        "job": "orgs/acme/jobs/j1",
        "task": "train",
        "attempt": 0,
        "command": "echo in-the-image",
        "env": {"TANDEM_JOB": "orgs/acme/jobs/j1"},
        "log_dir": tmp_path / "logs",
        "workdir": tmp_path / "work",
        "image": IMAGE,
        "file_mounts": [(str(tmp_path / "data"), str(tmp_path / "data"), True)],
    }
    values.update(overrides)
    return LaunchSpec(**values)  # type: ignore[arg-type]


def srun_line(script: str) -> list[str]:
    """The batch script's srun step (its node shell argument spans lines), as words."""
    step = script.split("\nsrun ", 1)[1].rsplit("\ncode=$?", 1)[0]
    return shlex.split("srun " + step)


def test_enroot_writes_a_registry_host_apart() -> None:
    assert enroot_image(IMAGE) == "nvcr.io#nvidia/pytorch:24.01-py3"
    assert enroot_image("localhost:5000/team/img:1") == "localhost:5000#team/img:1"
    assert enroot_image("ubuntu:22.04") == "ubuntu:22.04"
    assert enroot_image("pytorch/pytorch:2.4.0-cuda12.1") == "pytorch/pytorch:2.4.0-cuda12.1"


def test_pyxis_puts_the_whole_step_in_the_image(tmp_path: Path) -> None:
    srun = srun_line(SlurmBackend().batch_script(spec(tmp_path)))
    assert f"--container-image={enroot_image(IMAGE)}" in srun
    assert f"--container-workdir={tmp_path / 'work'}" in srun
    [mounts] = [a for a in srun if a.startswith("--container-mounts=")]
    assert set(mounts.removeprefix("--container-mounts=").split(",")) == {
        str(tmp_path / "work"),
        str(tmp_path / "logs"),
        str(tmp_path / "data"),
    }
    assert srun.index(f"--container-image={enroot_image(IMAGE)}") < srun.index("bash")
    plain = srun_line(SlurmBackend().batch_script(spec(tmp_path, image="")))
    assert not [a for a in plain if a.startswith("--container")]


def test_apptainer_runs_each_node_under_apptainer_exec(tmp_path: Path) -> None:
    srun = srun_line(SlurmBackend(container_runtime="apptainer").batch_script(spec(tmp_path)))
    start = srun.index("apptainer")
    assert srun[start : start + 4] == ["apptainer", "exec", "--pwd", str(tmp_path / "work")]
    assert srun[srun.index(f"docker://{IMAGE}") + 1] == "bash"
    assert ["--bind", str(tmp_path / "data")] == srun[srun.index(str(tmp_path / "data")) - 1 :][:2]
    with pytest.raises(ValueError, match="container_runtime"):
        SlurmBackend(container_runtime="docker")


def test_disk_and_spot_reach_sbatch(tmp_path: Path) -> None:
    backend = SlurmBackend(qos="normal", preemptible_qos="scavenger")
    usual = backend.sbatch_args(spec(tmp_path, resources=Resources(disk_gib=1.5)))
    assert "--tmp=1536M" in usual and "--nice=1000" in usual and "--no-requeue" in usual
    assert "--qos=normal" in usual
    spot = backend.sbatch_args(spec(tmp_path, preemptible=True, priority=1000))
    assert "--nice=2001" in spot and "--requeue" in spot and "--qos=scavenger" in spot


@pytest.mark.slow
@pytest.mark.parametrize(("runtime", "words"), [("pyxis", "no pyxis plugin"), ("apptainer", "no Apptainer")])
async def test_a_cluster_without_the_runtime_refuses_the_launch(
    slurm_cluster: SlurmCluster, tmp_path: Path, runtime: str, words: str
) -> None:
    backend = SlurmBackend(env={"SLURM_CONF": str(slurm_cluster.conf)}, container_runtime=runtime)
    (tmp_path / "work").mkdir()
    with pytest.raises(LaunchRefused, match=words) as refused:
        await backend.launch(spec(tmp_path, key=f"orgs-acme-jobs-j1.train.{runtime}"))
    assert IMAGE in str(refused.value)
    assert await backend.find(f"orgs-acme-jobs-j1.train.{runtime}") is None  # nothing was submitted


def test_the_local_backend_refuses_an_image_without_a_working_runtime(tmp_path: Path) -> None:
    backend = LocalBackend(
        tmp_path / "local", gpus=0, cpus=1, memory_gib=1, container_runtimes=("no-such-cli",)
    )
    with pytest.raises(LaunchRefused, match="no container runtime that works") as refused:
        backend.container_runtime(IMAGE)
    assert "no-such-cli: not installed" in str(refused.value) and IMAGE in str(refused.value)


def test_the_local_backends_container_command(tmp_path: Path) -> None:
    task = js.TaskSpec(
        name="train",
        kind=js.TaskSpec.KIND_COMMAND,
        run="python train.py",
        resources=types_pb2.Resources(gpus="1", image=IMAGE),
        workdir=js.Workdir(path="/src/project"),
    )
    script = expand.command_for(task, job="orgs/acme/jobs/j1", gpus_granted=1)
    line = expand.in_container(
        task,
        script,
        image=IMAGE,
        env_names=["TANDEM_JOB", "HF_TOKEN", "PATH"],
        folders=["/data/set"],
        python="/venv/bin/python",
    )
    words = shlex.split(line.replace("$(id -u):$(id -g)", "U"))
    # task_image pulls the image within the bound, then runs `$TANDEM_CONTAINER_RUNTIME run OPTIONS IMAGE`.
    assert words[:8] == [
        *("exec", "/venv/bin/python", "-m", "services.scheduler.backends.task_image", IMAGE),
        *("--rm", "--init", "--network"),
    ]
    pairs = list(itertools.pairwise(words))
    assert ("--volume", "/data/set:/data/set") in pairs and ("--volume", "/src/project:/src/project") in pairs
    assert ("--env", "HF_TOKEN") in pairs and ("--env", "CUDA_VISIBLE_DEVICES") in pairs
    assert ("--env", "PATH") not in pairs  # the image's own
    assert ("--gpus", "device=$CUDA_VISIBLE_DEVICES") in pairs
    assert ("--user", "U") in pairs
    assert words[words.index("--") + 1 :] == ["bash", "-euo", "pipefail", "-c", script]

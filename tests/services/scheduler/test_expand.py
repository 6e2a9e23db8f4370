"""Task expansion: the scripts run for real under bash, the trainer launch and the environment a task gets."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tandem.scheduler.v1 import job_spec_pb2 as js

from services.scheduler import expand as X
from services.scheduler import spec as S

ROOT = Path(__file__).resolve().parents[3]
JOB = "orgs/acme/jobs/j1"


def one_task(text: str) -> js.TaskSpec:
    return S.parse_yaml("name: g\ntasks:\n" + textwrap.indent(textwrap.dedent(text), "  ")).tasks[0]


def run_script(script: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """As a backend runs `LaunchSpec.command`."""
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env={"PATH": os.environ["PATH"], **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_command_task_runs_setup_then_run(tmp_path: Path) -> None:
    task = one_task(
        """
        - name: main
          setup: |
            cd /  # does not reach run, as in SkyPilot
            echo set-up > "$OUT/setup.txt"
          run: |
            echo "ran in $(pwd) after $(cat "$OUT/setup.txt"), unset=${NOT_SET:-empty}"
            exit 3
        """
    )
    script = X.command_for(task, job=JOB, gpus_granted=0)
    done = run_script(script, tmp_path, {"OUT": str(tmp_path)})
    assert done.returncode == 3
    assert done.stdout.strip() == f"ran in {tmp_path} after set-up, unset=empty"


def test_a_failed_setup_exits_with_the_precheck_code_and_skips_run(tmp_path: Path) -> None:
    task = one_task("- name: main\n  setup: exit 5\n  run: touch ran\n")
    done = run_script(X.command_for(task, job=JOB, gpus_granted=0), tmp_path)
    assert done.returncode == X.SETUP_FAILED_EXIT
    assert not (tmp_path / "ran").exists()


def test_scripts_with_quotes_and_dollars_survive(tmp_path: Path) -> None:
    task = one_task("- name: main\n  run: |\n    printf '%s|' \"it's\" '$HOME' \"${X}\"\n")
    done = run_script(X.command_for(task, job=JOB, gpus_granted=0), tmp_path, {"X": "x"})
    assert done.stdout == "it's|$HOME|x|"


def test_a_service_task_knows_its_port(tmp_path: Path) -> None:
    task = one_task('- name: app\n  run: echo "port $TANDEM_SERVICE_PORT"\n  service: {port: 8001}\n')
    done = run_script(X.command_for(task, job=JOB, gpus_granted=0), tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "port 8001"


def test_an_online_rl_task_launches_the_trainer_with_its_placement() -> None:
    task = one_task(
        """
        - name: rl
          resources: {gpus: 'H100:8'}
          setup: echo setup
          file_mounts: {/ckpt: {volume: ckpt}}
          online_rl:
            config_path: /cfg/job.toml
            placement: {inference_gpus: 6, tensor_parallel_size: 2, reference_placement: stacked}
        """
    )
    output = X.output_dir_for(task, "/state/jobs/j1/rl")
    assert output == "/ckpt"
    script = X.command_for(task, job=JOB, gpus_granted=8, config_file="/ignored.toml", output_dir=output)
    lines = script.splitlines()
    assert lines[1] == f"bash -c 'echo setup' || exit {X.SETUP_FAILED_EXIT}"
    assert shlex.split(lines[-1]) == [
        "exec",
        "python",
        "-m",
        "trainer",
        "--config",
        "/cfg/job.toml",
        "--output",
        "/ckpt",
        "--gpus",
        "8",
        "--inference-gpus",
        "6",
        "--tensor-parallel-size",
        "2",
        "--reference",
        "stacked",
    ]


def test_an_inline_config_is_the_file_the_engine_wrote_and_auto_placement_adds_no_flags() -> None:
    spec = S.load_yaml(ROOT / "examples" / "jobs" / "rl-with-eval-watcher.yaml")
    trainer = spec.tasks[0]
    script = X.command_for(
        trainer,
        job=JOB,
        gpus_granted=0,
        config_file="/state/attempts/0/trainer.toml",
        output_dir=X.output_dir_for(trainer, "/unused"),
        python="/venv/bin/python",
    )
    assert shlex.split(script.splitlines()[-1])[1:] == [
        "/venv/bin/python",
        "-m",
        "trainer",
        "--config",
        "/state/attempts/0/trainer.toml",
        "--output",
        "/ckpt",
        "--gpus",
        "0",
    ]


def test_an_online_rl_run_replaces_the_launch_and_sees_its_pieces(tmp_path: Path) -> None:
    task = one_task(
        """
        - name: rl
          run: echo "$TANDEM_TRAINER_CONFIG $TANDEM_TRAINER_OUTPUT $TANDEM_TRAINER_ARGS"
          online_rl: {config_path: /c.toml, placement: {inference_gpus: 1}}
        """
    )
    script = X.command_for(task, job=JOB, gpus_granted=2, output_dir=str(tmp_path / "out"))
    done = run_script(script, tmp_path)
    assert done.stdout.strip() == f"/c.toml {tmp_path / 'out'} --gpus 2 --inference-gpus 1"


def test_an_online_rl_task_needs_its_config_and_output() -> None:
    task = js.TaskSpec(
        name="rl", kind=js.TaskSpec.KIND_ONLINE_RL, online_rl=js.OnlineRlOptions(config_toml="seed = 1")
    )
    with pytest.raises(ValueError, match="output_dir"):
        X.command_for(task, job=JOB, gpus_granted=0, config_file="/c.toml")
    with pytest.raises(ValueError, match="config_file"):
        X.command_for(task, job=JOB, gpus_granted=0, output_dir="/o")


def test_the_output_folder_is_the_first_writable_volume() -> None:
    task = one_task(
        "- name: rl\n  online_rl: {config_path: /c.toml}\n  file_mounts:\n"
        "    /models: {volume: models, read_only: true}\n    /host: /data\n    /ckpt: {volume: ckpt}\n"
    )
    assert X.output_dir_for(task, "/default") == "/ckpt"
    assert X.output_dir_for(one_task("- name: rl\n  online_rl: {config_path: /c.toml}\n"), "/d") == "/d"


def test_the_task_environment_has_the_tandem_and_skypilot_variables() -> None:
    task = one_task("- name: train\n  run: x\n  num_nodes: 2\n  envs: {OMP_NUM_THREADS: 8}\n")
    ips = ["10.0.0.1", "10.0.0.2"]
    env = X.task_env(
        task,
        job=JOB,
        attempt=2,
        node_ips=ips,
        resume_from="/ckpt/checkpoints/step-000040",
        job_token="t",
        gpus_per_node=4,
        task_index=1,
        group_size=3,
        backend="slurm",
        user="alice",
    )
    org, job_id = JOB.split("/")[1], JOB.split("/")[3]
    assert env == {
        "OMP_NUM_THREADS": "8",
        "TANDEM_JOB": JOB,
        "TANDEM_TASK": "train",
        "TANDEM_NUM_NODES": "2",
        "SKYPILOT_NUM_NODES": "2",
        "TANDEM_NODE_IPS": "10.0.0.1\n10.0.0.2",
        "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2",
        "SKYPILOT_SETUP_NODE_IPS": "10.0.0.1\n10.0.0.2",
        "SKYPILOT_NUM_GPUS_PER_NODE": "4",
        "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": "4",
        "SKYPILOT_TASK_ID": f"{org}_{job_id}-1",
        "SKYPILOT_TASK_IDS": f"{org}_{job_id}-0\n{org}_{job_id}-1\n{org}_{job_id}-2",
        "SKYPILOT_JOBGROUP_NAME": job_id,
        "SKYPILOT_CLUSTER_INFO": json.dumps(
            {"cluster_name": job_id, "cloud": "slurm", "region": None, "zone": None}
        ),
        "TANDEM_RESTART_COUNT": "2",
        "TANDEM_RESUME_FROM": "/ckpt/checkpoints/step-000040",
        "TANDEM_JOB_TOKEN": "t",
        "SKYPILOT_MANAGED_JOB_ID": job_id,
        "SKYPILOT_ROOT_JOB_ID": job_id,  # a group of three tasks, run in parallel: SkyPilot's job tree
        "SKYPILOT_USER": "alice",
        "SKYPILOT_USER_ID": "6384e2b2",  # the first 8 hex digits of MD5("alice")
    }
    # A plain one-task job and a pipeline's tasks are no job tree (sky/jobs/controller.py): no root id.
    for size, serial in ((1, False), (3, True)):
        plain = X.task_env(task, job=JOB, attempt=0, group_size=size, serial=serial, user="bob")
        assert plain["SKYPILOT_MANAGED_JOB_ID"] == job_id and "SKYPILOT_ROOT_JOB_ID" not in plain
        assert plain["SKYPILOT_USER_ID"] == X.user_id("bob") != X.user_id("alice")
    assert "SKYPILOT_USER" not in X.task_env(task, job=JOB, attempt=0)  # no known submitter
    # SkyPilot's SDK reads the task's index as what follows the last `-` (sky/jobs/client/sdk.py).
    assert env["SKYPILOT_TASK_ID"].rsplit("-", 1)[1] == "1"
    assert X.node_env(1) == {
        "TANDEM_NODE_RANK": "1",
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_SETUP_NODE_RANK": "1",
    }
    assert X.sibling_host("eval", 0, JOB) == f"eval-0.{job_id}"
    assert X.node_env(0, ips)["SKYPILOT_NODE_IPS"] == "10.0.0.1\n10.0.0.2"
    assert X.task_env(one_task("- name: a\n  run: x\n"), job=JOB, attempt=0)["TANDEM_NUM_NODES"] == "1"


def test_the_torchrun_example_reads_the_variables_a_node_gets(tmp_path: Path) -> None:
    spec = S.load_yaml(ROOT / "examples" / "jobs" / "torchrun-multinode.yaml")
    task = spec.tasks[0]
    run = task.run.replace("torchrun", "echo torchrun")  # the wiring, without torch
    script = X.command_for(js.TaskSpec(name=task.name, kind=task.kind, run=run), job=JOB, gpus_granted=8)
    ips = ["10.0.0.1", "10.0.0.2"]
    env = {**X.task_env(task, job=JOB, attempt=0, node_ips=ips), **X.node_env(1, ips)}
    done = run_script(script, tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert "--nnodes=2 --node_rank=1 --nproc_per_node=8 --master_addr=10.0.0.1" in done.stdout
    assert "--checkpoint-dir /ckpt/train" in done.stdout


def test_secrets_and_mounts_as_a_backend_takes_them() -> None:
    spec = S.load_yaml(ROOT / "examples" / "jobs" / "managed-taskapp-rl.yaml")
    app, trainer = spec.tasks
    assert X.secret_env(app) == {"ENVIRONMENT_API_KEY": "math-app-key"}
    assert X.file_mounts(trainer) == [("/models", "models", True), ("/ckpt", "math-rl-checkpoints", False)]
    assert X.file_mounts(one_task("- name: a\n  run: x\n  file_mounts: {/d: /data}\n")) == [
        ("/d", "/data", False)
    ]


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "jobs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_task_expands(path: Path) -> None:
    for task in S.load_yaml(path).tasks:
        script = X.command_for(
            task, job=JOB, gpus_granted=S.resources_of(task).gpus, config_file="/c.toml", output_dir="/o"
        )
        assert script.startswith(f"# tandem: job {JOB}, task {task.name}\n")
        assert subprocess.run(["bash", "-n", "-c", script], check=False, timeout=30).returncode == 0


def test_the_eval_watcher_reports_each_checkpoint_once_and_stops_on_sigterm(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"

    def checkpoint(step: int, reward: float) -> None:
        folder = root / f"step-{step:06d}"
        folder.mkdir(parents=True)
        meta = {
            "step": step,
            "weight_version": step,
            "trigger": "interval",
            "metrics": {"reward/mean": reward},
        }
        (folder / "tandem.json").write_text(json.dumps({**meta, "create_time": 0}))

    checkpoint(20, 0.25)
    (root / "step-000040.partial").mkdir()  # still being written: never reported
    script = ROOT / "examples" / "jobs" / "eval_watcher.py"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(script),
            str(root),
            "--interval",
            "0.05",
            "--log",
            str(tmp_path / "evals.jsonl"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline()) == {"watching": str(root), "interval_s": 0.05}
        first = json.loads(proc.stdout.readline())
        assert (first["checkpoint"], first["step"], first["reward_mean"]) == ("step-000020", 20, 0.25)
        checkpoint(40, 0.5)
        second = json.loads(proc.stdout.readline())
        assert (second["step"], second["trigger"]) == (40, "interval")
        proc.send_signal(signal.SIGTERM)
        rest = [json.loads(line) for line in proc.stdout]
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rest == [{"stopped": True, "checkpoints": 2}]
    logged = [json.loads(line)["step"] for line in (tmp_path / "evals.jsonl").read_text().splitlines()]
    assert logged == [20, 40]


def test_host_backends_turn_volumes_into_shared_folders_named_by_tandem_mount_variables() -> None:
    mounts = [("/ckpt", "rl-checkpoints", True), ("/data/shared-set", "/srv/data", False)]
    placed, env = X.host_mounts(mounts, lambda name: f"/var/tandem/volumes/acme/{name}")
    assert placed == [
        ("/var/tandem/volumes/acme/rl-checkpoints", "/var/tandem/volumes/acme/rl-checkpoints", True),
        ("/srv/data", "/srv/data", False),
    ]
    assert env == {
        "TANDEM_MOUNT_CKPT": "/var/tandem/volumes/acme/rl-checkpoints",
        "TANDEM_MOUNT_SHARED_SET": "/srv/data",
    }
    assert X.mount_env(mounts) == {
        "TANDEM_MOUNT_CKPT": "/ckpt",
        "TANDEM_MOUNT_SHARED_SET": "/data/shared-set",
    }

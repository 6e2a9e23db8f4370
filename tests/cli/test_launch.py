"""`tandem launch`, `queue`, `logs` and `cancel`, the commands a SkyPilot user reaches for, as real processes
against a real mesh behind the gateway: a SkyPilot task file with an env given at launch runs and its log
reads back, `--env NAME` takes the caller's value, a missing env is named (exit 2), `--dryrun` starts
nothing, and a running job is cancelled."""

from __future__ import annotations

import json
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cli import main
from tests.cli.test_cli import ROOT, Cli, cli, mesh

pytestmark = pytest.mark.timeout(120)
__all__ = ["cli", "mesh"]  # fixtures

TASK = """name: hello
resources:
  cpus: 1+
envs:
  GREETING: null
  WHO: null
run: echo "$GREETING $WHO from $SKYPILOT_TASK_ID on $SKYPILOT_NUM_NODES node(s), token ${#HF_TOKEN} long"
"""


async def test_launch_queue_logs_and_cancel(cli: Cli, tmp_path: Path) -> None:
    task = tmp_path / "task.yaml"
    task.write_text(TASK)
    code, _, err = await cli.run("launch", str(task), "--env", "GREETING=hi")
    assert code == 2 and "Traceback" not in err, err
    assert "WHO" in err, err

    code, out, err = await cli.run(
        "launch", str(task), "--env", "GREETING=hi", "--env", "WHO", "--dryrun", WHO="x"
    )
    assert code == 0, err
    dry = json.loads(out)
    assert dry["tasks"][0]["envs"] == {"GREETING": "hi", "WHO": "x"}
    overrides = (
        "--gpus",
        "A100:8",
        "--num-nodes",
        "2",
        "--infra",
        "slurm",
        "--secret",
        "HF_TOKEN",
        "--dryrun",
    )
    code, out, err = await cli.run("launch", str(task), "--env", "GREETING=a", "--env", "WHO=b", *overrides)
    assert code == 0, err
    dry = json.loads(out)
    assert (dry["backend"], dry["tasks"][0]["num_nodes"]) == ("BACKEND_SLURM", 2)
    assert dry["tasks"][0]["resources"]["gpus"] == "A100:8"
    assert dry["tasks"][0]["secrets"] == [{"secret": "hf-token", "env": "HF_TOKEN"}]
    code, _, err = await cli.run(
        "launch", str(task), "--env", "GREETING=a", "--env", "WHO=b", "--secret", "X=1"
    )
    assert code == 2 and "vault" in err, err
    code, out, err = await cli.run("queue", "--json")
    assert (code, json.loads(out)) == (0, []), err  # --dryrun started nothing

    code, _, err = await cli.run("secrets", "put", "hf-token", stdin=b"a-token-value")
    assert code == 0, err
    args = (
        "--env",
        "GREETING=hi",
        "--env",
        "WHO=alice",
        "--secret",
        "HF_TOKEN",
        "--job-id",
        "hello",
        "--json",
    )
    code, out, err = await cli.run("launch", str(task), *args)
    assert code == 0, err
    assert json.loads(out)["name"] == "orgs/acme/jobs/hello"
    code, out, err = await cli.run("logs", "hello", "hello", "--follow")
    assert code == 0, err
    assert "hi alice from acme_hello-0 on 1 node(s), token 13 long" in out, out  # the vault's value

    task.write_text(TASK.replace("run: echo", "run: sleep 600; echo"))
    code, out, err = await cli.run(
        "launch", str(task), "--env", "GREETING=a", "--env", "WHO=b", "--job-id", "sleeper"
    )
    assert code == 0, err
    code, out, err = await cli.run("cancel", "sleeper", "--json")
    assert code == 0, err
    assert json.loads(out)["name"] == "orgs/acme/jobs/sleeper"
    code, out, err = await cli.run("queue", "--json")
    assert code == 0, err
    assert [job["name"] for job in json.loads(out)] == ["orgs/acme/jobs/sleeper", "orgs/acme/jobs/hello"]

    code, _, err = await cli.run(
        "launch", str(task), "--env", "GREETING=a", "--env", "WHO=b", "--infra", "aws"
    )
    assert code == 2 and "--infra aws" in err, err
    code, _, err = await cli.run(
        "launch", str(task), "--env", "GREETING=a", "--env", "WHO=b", "--infra", "slurm/c/p/x"
    )
    assert code == 2 and "slurm/CLUSTER/PARTITION" in err, err


def test_launch_infra_names_the_slurm_cluster_and_partition_or_the_kubernetes_context(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    task = tmp_path / "task.yaml"
    task.write_text("run: echo hi\nbackend: slurm\nslurm: {qos: low}\n")
    assert main(["launch", str(task), "--infra", "slurm/tandemtest/debug", "--dryrun"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["backend"] == "BACKEND_SLURM"
    assert dry["slurm"] == {"cluster": "tandemtest", "partition": "debug", "qos": "low"}
    task.write_text("run: echo hi\n")
    assert main(["launch", str(task), "--infra", "k8s/kind-tandem", "--dryrun"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert (dry["backend"], dry["kubernetes"]) == ("BACKEND_KUBERNETES", {"context": "kind-tandem"})
    assert main(["launch", str(task), "--infra", "local/box", "--dryrun"]) == 2
    assert "--infra local/box" in capsys.readouterr().err


def test_the_launch_help_examples_run_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    examples = [
        line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("tandem ")
    ]
    assert len(examples) == 3
    for example in examples:
        words = shlex.split(example)[1:]
        words[1] = str(ROOT / words[1])
        assert main(words) == 0, example
        assert json.loads(capsys.readouterr().out)["tasks"]


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder under /tmp that a task's own user may write to (pytest's are the test user's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="tandem-secret-file-"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


async def test_a_managed_secret_with_a_mount_path_is_also_a_private_file(cli: Cli, open_folder: Path) -> None:
    folder = open_folder
    path = folder / "keys" / "wandb"
    task = folder / "task.yaml"
    task.write_text(
        f"""name: keyed
managed_secrets:
  - WANDB_API_KEY: {{mount_path: {path}}}
run: |
  echo "mode $(stat -c %a {path}), folder $(stat -c %a {path.parent})"
  test "$(cat {path})" = "$WANDB_API_KEY" && echo "the file holds the variable's value"
"""
    )
    code, _, err = await cli.run("secrets", "put", "wandb-api-key", stdin=b"wandb-value")
    assert code == 0, err
    code, out, err = await cli.run("launch", str(task), "--job-id", "keyed", "--json")
    assert code == 0, err
    code, out, err = await cli.run("logs", "keyed", "keyed", "--follow")
    assert code == 0, err
    assert "mode 600, folder 700" in out, out
    assert "the file holds the variable's value" in out, out
    code, out, err = await cli.run("launch", str(task), "--dryrun")
    assert json.loads(out)["tasks"][0]["secrets"] == [{"secret": "wandb-api-key", "file": str(path)}]


async def test_a_volumes_sub_path_is_that_folder_of_the_volume(cli: Cli, tmp_path: Path) -> None:
    group = tmp_path / "group.yaml"
    group.write_text(
        """name: runs
execution: serial
---
name: writer
volumes:
  /ckpt: {name: shared, sub_path: runs/r1}
run: echo weights > "$TANDEM_MOUNT_CKPT/step-1.bin"
---
name: reader
volumes:
  /all: shared
run: cat "$TANDEM_MOUNT_ALL/runs/r1/step-1.bin"
"""
    )
    code, out, err = await cli.run("launch", str(group), "--job-id", "runs", "--json")
    assert code == 0, err
    code, out, err = await cli.run("logs", "runs", "reader", "--follow")
    assert code == 0, err
    assert "weights" in out, out


def test_a_secret_given_at_launch_takes_the_place_of_the_files_own(tmp_path: Path) -> None:
    # SkyPilot's empty secret (`HF_TOKEN: ""`) is the variable set empty until `--secret HF_TOKEN` names the
    # vault's; an env or a secret of the same variable in the file gives way the same way
    import argparse  # noqa: PLC0415

    from gateway.cli import launch_spec  # noqa: PLC0415
    from services.scheduler.spec import secret_env_name  # noqa: PLC0415

    task = tmp_path / "task.yaml"
    task.write_text("envs: {WANDB_API_KEY: x}\nsecrets: {HF_TOKEN: '', GH_TOKEN: null}\nrun: x\n")
    args = argparse.Namespace(file=str(task), env=[], gpus="", num_nodes=0, infra="", secret=[])
    [plain] = launch_spec(args).tasks
    assert dict(plain.envs) == {"WANDB_API_KEY": "x", "HF_TOKEN": ""}
    args.secret = ["HF_TOKEN", "WANDB_API_KEY", "GH_TOKEN"]
    [given] = launch_spec(args).tasks
    assert dict(given.envs) == {}
    bindings = {secret_env_name(b): b.secret for b in given.secrets}
    assert bindings == {"HF_TOKEN": "hf-token", "WANDB_API_KEY": "wandb-api-key", "GH_TOKEN": "gh-token"}

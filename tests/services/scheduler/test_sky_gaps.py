"""SkyPilot files that SkyPilot's loader accepts and `load_yaml` used to refuse or misread: tasks without `run`,
storage mounts whose `name` is null, names outside Tandem's task-name shape, `workdir`'s ignore files and mounts
under `~/`. SkyPilot's own loader (in .venv-sky) is the oracle where it says what a file means; the tasks run
through CreateJob on the local backend and the real one-node Slurm cluster (tests/support/slurm.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from tandem.scheduler.v1 import job_pb2
from tandem.scheduler.v1 import job_spec_pb2 as js

from mesh.errors import InvalidArgument
from services.scheduler import bucket_uploads
from services.scheduler import spec as S
from services.scheduler.backends import task_workdir
from tests.services.scheduler.test_scheduler import TERMINAL, log_text, wait_for
from tests.services.scheduler.test_skypilot import needs_skypilot
from tests.services.scheduler.test_skypilot_files import (
    ROOT,
    Acme,
    acme,
    dataset_bucket,
    submit,
    write_job,
)
from tests.services.scheduler.test_skypilot_keys import parse, refusals
from tests.services.scheduler.test_skypilot_keys import skypilot_reads as skypilot
from tests.support.s3 import S3Server, s3_server

__all__ = ["acme", "s3_server"]
pytestmark = pytest.mark.timeout(300)
State = job_pb2.Job.State


@pytest.fixture(autouse=True)
def own_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The HOME the local backend's tasks inherit: this test's, so links under ~/ land nowhere else."""
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


async def ran(clients: Acme, spec: js.JobSpec) -> tuple[job_pb2.Job, str]:
    """The job of `spec` once it ended, and its log."""
    job = await submit(clients, spec)
    done = await wait_for(clients, job.name, *TERMINAL, within_s=180)
    return done, await log_text(clients, job.name)


# -- tasks without run ---------------------------------------------------------------------------------------

WITHOUT_RUN = {
    "setup only": "name: prepare\nsetup: echo prepared > made-by-setup\n",
    "nothing": "name: nothing\n",
}

READ_RUN = """
import json, sys
import sky
task = sky.Task.from_yaml(sys.argv[1])
print(json.dumps({"name": task.name, "setup": task.setup, "run": task.run}))
"""


@needs_skypilot
@pytest.mark.parametrize("text", WITHOUT_RUN.values(), ids=WITHOUT_RUN.keys())
def test_skypilot_takes_a_task_without_run_and_so_does_tandem(text: str, tmp_path: Path) -> None:
    path = tmp_path / "task.yaml"
    path.write_text(text)
    sky = skypilot(READ_RUN, path)
    (task,) = S.load_yaml(path).tasks
    assert sky["run"] is None
    assert (task.name, task.setup or None, task.run) == (sky["name"], sky["setup"], "")
    assert task.kind == js.TaskSpec.KIND_COMMAND


def test_a_service_task_still_needs_run() -> None:
    found = refusals("tasks:\n  - name: web\n    service: {port: 8080}\n")
    assert found == {"tasks[0].run": "is required for service tasks"}


async def test_tasks_without_run_succeed(acme: Acme, tmp_path: Path) -> None:
    for label, text in WITHOUT_RUN.items():
        done, logs = await ran(acme, S.load_yaml(write_job(tmp_path, text)))
        assert done.state == State.STATE_SUCCEEDED, (label, done.failure.message, logs)


# -- a bucket's name: null -----------------------------------------------------------------------------------

VALIDATE_STORAGE = """
import json, sys
import sky
task = sky.Task.from_yaml(sys.argv[1])
out = {}
for path, storage in task.storage_mounts.items():
    try:
        storage._validate_storage_spec(storage.name)
        out[path] = ["ok", storage.name]
    except Exception as exc:
        out[path] = ["refused", str(exc)]
print(json.dumps(out))
"""

NAMELESS = {
    "/from-source": "{name: null, source: 's3://datasets/gsm8k', mode: COPY}",
    "/empty-name": "{name: '', source: 's3://evals'}",
    "/nothing": "{name: null, mode: MOUNT}",
    "/copy-nothing": "{name: null, mode: COPY}",
    "/local": "{name: null, source: ./data}",
}


@needs_skypilot
def test_a_null_bucket_name_is_no_name_and_refusals_are_skypilots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "data").mkdir()
    mounts = "".join(f"  {where}: {value}\n" for where, value in NAMELESS.items())
    sky = skypilot(VALIDATE_STORAGE, write_job(tmp_path, f"run: x\nfile_mounts:\n{mounts}"))
    monkeypatch.chdir(tmp_path)
    for where, value in NAMELESS.items():
        text = f"run: x\nfile_mounts:\n  {where}: {value}\n"
        verdict, said = sky[where]
        if verdict == "ok":
            (mount,) = S.load_yaml(write_job(tmp_path, text)).tasks[0].file_mounts
            assert mount.bucket.url.split("/")[2] == said and not mount.bucket.create, where
        else:
            with pytest.raises(InvalidArgument) as caught:
                S.load_yaml(write_job(tmp_path, text))
            (violation,) = caught.value.violations
            assert violation.field.startswith(f'file_mounts["{where}"]'), where
            assert violation.description == said, where


# -- task names outside Tandem's shape -----------------------------------------------------------------------

NAMED_GROUP = """\
name: rl
execution: parallel
primary_tasks: [Policy_Trainer]
termination_delay: {Rollout_Server: 10s}
---
name: Policy_Trainer
run: |
  for host in Rollout_Server-0 rollout-server-0; do
    if getent hosts "$host.$SKYPILOT_JOBGROUP_NAME" >/dev/null; then echo "found $host"; fi
  done
---
name: Rollout_Server
run: echo "serving as $TANDEM_TASK_DISPLAY_NAME"
"""

READ_NAMES = """
import json, sys
from sky.utils import dag_utils
dag = dag_utils.load_dag_from_yaml(sys.argv[1])
print(json.dumps([task.name for task in dag.tasks]))
"""


@needs_skypilot
def test_skypilots_task_names_are_kept_beside_their_normal_form(tmp_path: Path) -> None:
    path = tmp_path / "group.yaml"
    path.write_text(NAMED_GROUP)
    written = skypilot(READ_NAMES, path)
    spec = S.load_yaml(path)
    assert [t.display_name for t in spec.tasks] == written == ["Policy_Trainer", "Rollout_Server"]
    assert [t.name for t in spec.tasks] == ["policy-trainer", "rollout-server"]
    trainer, server = spec.tasks
    assert (trainer.role, server.role) == (js.TaskSpec.ROLE_PRIMARY, js.TaskSpec.ROLE_AUXILIARY)
    assert server.termination_delay.seconds == 10
    S.check_spec(spec)  # the proto form passes the contract's rules too


READ_OR_REFUSE = """
import json, sys
from sky.utils import dag_utils
try:
    print(json.dumps([task.name for task in dag_utils.load_dag_from_yaml(sys.argv[1]).tasks]))
except ValueError as error:
    print(json.dumps(str(error)))
"""


@needs_skypilot
def test_dots_are_refused_in_a_job_group_as_skypilot_refuses_them(tmp_path: Path) -> None:
    dotted = NAMED_GROUP.replace("Rollout_Server", "Rollout.Server")
    group, pipeline = tmp_path / "group.yaml", tmp_path / "pipeline.yaml"
    group.write_text(dotted)
    pipeline.write_text(
        dotted.replace("execution: parallel", "execution: serial").replace(
            "primary_tasks: [Policy_Trainer]\ntermination_delay: {Rollout.Server: 10s}\n", ""
        )
    )
    said = skypilot(READ_OR_REFUSE, group)
    with pytest.raises(InvalidArgument) as caught:
        S.load_yaml(group)
    assert {v.field: v.description for v in caught.value.violations} == {"tasks[1].name": said}
    assert [t.display_name for t in S.load_yaml(pipeline).tasks] == skypilot(READ_OR_REFUSE, pipeline)


def test_a_name_already_in_tandems_shape_has_no_display_name() -> None:
    (task,) = parse("tasks:\n  - name: trainer\n    run: x\n").tasks
    assert (task.name, task.display_name) == ("trainer", "")
    (single,) = parse("name: My_Job\nrun: x\n").tasks
    assert (single.name, single.display_name) == ("my-job", "My_Job")
    (spaced,) = parse("name: my job\nrun: x\n").tasks  # not a SkyPilot task name: the job's only
    assert (spaced.name, spaced.display_name) == ("my-job", "")


def test_two_names_with_one_normal_form_are_refused_naming_both() -> None:
    found = refusals("tasks:\n  - name: My_Task\n    run: x\n  - name: my-task\n    run: y\n")
    assert set(found) == {"tasks[1].name"}
    assert "'my-task' and tasks[0]'s 'My_Task' are both the task name 'my-task'" in found["tasks[1].name"]
    found = refusals("tasks:\n  - name: My_Task\n    run: x\n  - name: my.task\n    run: y\n")
    assert "'my.task' and tasks[0]'s 'My_Task'" in found["tasks[1].name"]


def test_a_name_skypilot_refuses_too_is_refused() -> None:
    assert "tasks[0].name" in refusals("tasks:\n  - name: 'my task'\n    run: x\n")
    assert "tasks[0].name" in refusals("tasks:\n  - name: _hidden\n    run: x\n")


def test_a_proto_display_name_must_normalise_to_the_name() -> None:
    def problems(task: js.TaskSpec) -> dict[str, str]:
        return {v.field: v.description for v in S.spec_violations(js.JobSpec(tasks=[task]))}

    good = js.TaskSpec(name="my-task", display_name="My_Task", kind=js.TaskSpec.KIND_COMMAND, run="x")
    assert problems(good) == {}
    other = js.TaskSpec(name="other", display_name="My_Task", kind=js.TaskSpec.KIND_COMMAND, run="x")
    assert "'my-task'" in problems(other)["tasks[0].display_name"]
    long = js.TaskSpec(name="t", display_name="T" * 129, kind=js.TaskSpec.KIND_COMMAND, run="x")
    assert "tasks[0].display_name" in problems(long)


async def test_siblings_answer_to_both_names(acme: Acme, tmp_path: Path) -> None:
    job = await submit(acme, S.load_yaml(write_job(tmp_path, NAMED_GROUP)))
    done = await wait_for(acme, job.name, *TERMINAL, within_s=120)
    trainer = await log_text(acme, job.name, "policy-trainer")
    assert done.state == State.STATE_SUCCEEDED, (done.failure.message, trainer)
    assert "found Rollout_Server-0" in trainer and "found rollout-server-0" in trainer, trainer
    assert "serving as Rollout_Server" in await log_text(acme, job.name, "rollout-server")


# -- workdir's .skyignore / .gitignore -----------------------------------------------------------------------


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def copied(source: Path, dest: Path) -> set[str]:
    task_workdir.copy_workdir(source, dest)
    return {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file() and ".git/" not in str(p)}


PROJECT = {
    "train.py": "",
    "data/big.bin": "",
    "data/keep.txt": "",
    "logs/run.log": "",
    "src/model.py": "",
    "src/model.pyc": "",
    "src/cache/x": "",
    "notes.tmp": "",
}

EXCLUDED = """
import json, sys
from sky.data import storage_utils
print(json.dumps(storage_utils.get_excluded_files(sys.argv[1])))
"""


@needs_skypilot
def test_a_skyignore_leaves_out_what_skypilot_leaves_out(tmp_path: Path) -> None:
    source = tree(
        tmp_path / "project", {**PROJECT, ".skyignore": "*.tmp\n/logs\ndata/*.bin\n*.pyc\ncache/\n"}
    )
    (source / ".gitignore").write_text("train.py\n")  # not read: the .skyignore is
    probe = tmp_path / "probe.yaml"
    probe.write_text(f"workdir: {source}\nrun: x\n")
    excluded = {e.rstrip("/") for e in skypilot(EXCLUDED.replace("sys.argv[1]", repr(str(source))), probe)}
    expected = {
        name
        for name in [*PROJECT, ".skyignore", ".gitignore"]
        if not any(name == e or name.startswith(e + "/") for e in excluded)
    }
    assert copied(source, tmp_path / "task") == expected
    assert expected == {"train.py", "data/keep.txt", "src/model.py", ".skyignore", ".gitignore"}


def test_a_gitignore_counts_as_git_reads_it_nested_and_with_info_exclude(tmp_path: Path) -> None:
    source = tree(tmp_path / "repo", {**PROJECT, ".gitignore": "*.tmp\nlogs/\n", "src/.gitignore": "*.pyc\n"})
    subprocess.run(["git", "init", "-q", str(source)], check=True)
    (source / ".git" / "info" / "exclude").write_text("data/big.bin\n")
    ignored = subprocess.run(
        ["git", "-C", str(source), "ls-files", "--others", "--ignored", "--exclude-standard", "--directory"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    expected = {
        name
        for name in [*PROJECT, ".gitignore", "src/.gitignore"]
        if not any(name == e.rstrip("/") or name.startswith(e) for e in ignored)
    }
    assert copied(source, tmp_path / "task") == expected
    assert "src/model.pyc" not in expected and "data/keep.txt" in expected
    assert (tmp_path / "task" / ".git" / "HEAD").is_file()  # .git is copied, as SkyPilot's sync copies it


def test_a_nested_skyignore_adds_rules_for_its_folder(tmp_path: Path) -> None:
    source = tree(
        tmp_path / "project", {**PROJECT, ".skyignore": "*.tmp\n", "src/.skyignore": "/cache\n*.pyc\n"}
    )
    (source / "link").symlink_to("train.py")
    dest = tmp_path / "task"
    assert copied(source, dest) == set(PROJECT) - {"notes.tmp", "src/cache/x", "src/model.pyc"} | {
        ".skyignore",
        "src/.skyignore",
        "link",
    }
    assert (dest / "link").is_symlink()


def test_bucket_uploads_read_the_same_top_rules(tmp_path: Path) -> None:
    source = tree(
        tmp_path / "project", {**PROJECT, ".skyignore": "*.tmp\nlogs/\n", "src/.skyignore": "*.pyc\n"}
    )
    sent = {relative for _path, relative in bucket_uploads.files_of(source)}
    assert sent == set(PROJECT) - {"notes.tmp", "logs/run.log"} | {".skyignore", "src/.skyignore"}


async def test_a_workdir_is_copied_without_what_its_skyignore_names(
    acme: Acme, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree(tmp_path / "project", {**PROJECT, ".skyignore": "*.tmp\n/logs\ndata/*.bin\n"})
    job_file = write_job(
        tmp_path,
        f"""\
        name: synced
        workdir: project
        envs: {{PYTHONPATH: {ROOT}}}
        run: find . -type f ! -path './.tandem*' | sort
        """,
    )
    monkeypatch.chdir(tmp_path)
    done, logs = await ran(acme, S.load_yaml(job_file))
    assert done.state == State.STATE_SUCCEEDED, (done.failure.message, logs)
    assert "./train.py" in logs and "./data/keep.txt" in logs and "./src/model.py" in logs, logs
    assert "notes.tmp" not in logs.split("attempt 0")[-1] and "run.log" not in logs and "big.bin" not in logs


# -- mounts under ~/ -----------------------------------------------------------------------------------------

READ_MOUNTS = """
import json, sys
import sky
task = sky.Task.from_yaml(sys.argv[1])
print(json.dumps({
    "file_mounts": task.file_mounts or {},
    "storage": {path: storage.source for path, storage in task.storage_mounts.items()},
}))
"""


@needs_skypilot
def test_skypilot_mounts_under_home_read_as_tandem_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "models").mkdir()
    path = write_job(
        tmp_path,
        "run: x\nfile_mounts:\n  ~/.cache/models: ./models\n  ~/data: s3://datasets/gsm8k\n"
        "  ~/ckpt: {name: run-ckpts, mode: MOUNT}\n",
    )
    sky = skypilot(READ_MOUNTS, path)
    monkeypatch.chdir(tmp_path)
    mounts = {m.path: m for m in S.load_yaml(path).tasks[0].file_mounts}
    assert set(mounts) == {*sky["file_mounts"], *sky["storage"]} == {"~/.cache/models", "~/data", "~/ckpt"}
    assert mounts["~/.cache/models"].local_path == str(tmp_path / "models")
    assert mounts["~/data"].bucket.url == sky["file_mounts"]["~/data"] == "s3://datasets/gsm8k"
    assert mounts["~/ckpt"].bucket.url == "s3://run-ckpts" and mounts["~/ckpt"].bucket.create


def test_another_users_home_and_the_home_itself_are_refused() -> None:
    found = refusals("run: x\nfile_mounts:\n  ~alice/data: /shared/data\n  '~': /shared\n  ~/: /shared\n")
    assert "~alice is another user's home" in found['file_mounts["~alice/data"]']
    assert "the task's home itself" in found['file_mounts["~"]']
    assert "the task's home itself" in found['file_mounts["~/"]']
    proto = js.JobSpec(
        tasks=[
            js.TaskSpec(
                name="t",
                kind=js.TaskSpec.KIND_COMMAND,
                run="x",
                file_mounts=[
                    js.FileMount(path="~bob/x", local_path="/d"),
                    js.FileMount(path="~/../x", local_path="/d"),
                ],
            )
        ]
    )
    problems = {v.field: v.description for v in S.spec_violations(proto)}
    assert "another user's home" in problems["tasks[0].file_mounts[0].path"]
    assert "'..'" in problems["tasks[0].file_mounts[1].path"]


async def test_mounts_under_home_are_linked_from_the_tasks_home(
    acme: Acme, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await dataset_bucket(acme, s3_server, {"gsm/train.jsonl": b'{"q": "1+1"}\n'})
    tree(tmp_path / "models", {"m.txt": "weights of the model\n"})
    job_file = write_job(
        tmp_path,
        f"""\
        name: home-mounts
        envs:
          AWS_ENDPOINT_URL: {s3_server.endpoint}
          PYTHONPATH: {ROOT}
        secrets: {{AWS_ACCESS_KEY_ID: null, AWS_SECRET_ACCESS_KEY: null}}
        file_mounts:
          ~/.cache/models: ./models
          ~/data: s3://datasets/gsm
        setup: test -f ~/.cache/models/m.txt
        run: |
          cat ~/.cache/models/m.txt ~/data/train.jsonl
          test "$TANDEM_MOUNT_DATA" -ef ~/data && echo "same folder"
        """,
    )
    monkeypatch.chdir(tmp_path)
    done, logs = await ran(acme, S.load_yaml(job_file))
    assert done.state == State.STATE_SUCCEEDED, (done.failure.message, logs)
    assert "weights of the model" in logs and '{"q": "1+1"}' in logs and "same folder" in logs, logs


async def test_something_else_at_the_home_path_is_a_precheck_failure(
    acme: Acme, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = Path(os.environ["HOME"])
    (home / "taken").mkdir(parents=True, exist_ok=True)
    tree(tmp_path / "models", {"m.txt": ""})
    monkeypatch.chdir(tmp_path)
    job_file = write_job(tmp_path, "name: clash\nfile_mounts:\n  ~/taken: ./models\nrun: echo run-started\n")
    done, logs = await ran(acme, S.load_yaml(job_file))
    assert done.state == State.STATE_FAILED, logs
    assert done.failure.failure_class == job_pb2.Failure.CLASS_PRECHECK, done.failure
    assert "cannot link ~/taken" in logs and "run-started" not in logs, logs
    assert (home / "taken").is_dir() and not (home / "taken").is_symlink()  # left as it was

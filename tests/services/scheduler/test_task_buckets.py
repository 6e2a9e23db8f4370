"""The in-task half of bucket mounts (services/scheduler/backends/task_buckets.py), run as a task runs it, as a
wrapper process around a real command, against a real S3-compatible server (moto's, signatures checked)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.scheduler import expand
from services.scheduler.backends.task_buckets import (
    BUCKETS_ENV,
    PRECHECK_EXIT,
    BucketMount,
    bucket_plan,
    fetch_new,
    pull,
    push,
    read_plan,
)
from tests.support.s3 import S3Server, s3_server

__all__ = ["s3_server"]
pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[3]
CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def wrapped(script: str, plan: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return subprocess.run(
        [sys.executable, "-m", "services.scheduler.backends.task_buckets", "bash", "-c", script],
        env={**base, **(env or {}), BUCKETS_ENV: plan, "PYTHONPATH": os.pathsep.join(sys.path)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def started(script: str, plan: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """The wrapper around `script`, running, its stdout piped: for a test that acts while the task runs."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.scheduler.backends.task_buckets", "bash", "-c", script],
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
            **env,
            BUCKETS_ENV: plan,
            "PYTHONPATH": os.pathsep.join(sys.path),
        },
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def cached_mount_plan(s3: S3Server, url: str, folder: Path) -> str:
    """One MOUNT_CACHED bucket at `folder`, synced every 0.2 s, with the task's key."""
    return bucket_plan(
        [BucketMount(url, str(folder), mode="mount_cached")],
        credentials=CREDENTIALS,
        endpoint_url=s3.endpoint,
        sync_interval_s=0.2,
    )


def secrets(s3: S3Server) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": s3.key_id, "AWS_SECRET_ACCESS_KEY": s3.secret}


def test_the_precheck_exit_is_the_failed_setup_code() -> None:
    assert PRECHECK_EXIT == expand.SETUP_FAILED_EXIT


def test_copy_brings_the_objects_down_and_never_writes_back(s3_server: S3Server, tmp_path: Path) -> None:
    store = s3_server.store()
    store.mkdir("data")
    store.pipe_file("data/set/train.jsonl", b'{"x": 1}\n')
    store.pipe_file("data/set/sub/eval.jsonl", b'{"x": 2}\n')
    store.pipe_file("data/other.txt", b"not under the prefix")
    folder = tmp_path / "data"
    plan = bucket_plan(
        [BucketMount("s3://data/set", str(folder), mode="copy")],
        credentials=CREDENTIALS,
        endpoint_url=s3_server.endpoint,
    )
    script = f"cat {folder}/train.jsonl {folder}/sub/eval.jsonl; echo new > {folder}/written.txt"
    done = wrapped(script, plan, secrets(s3_server))
    assert done.returncode == 0, done.stderr
    assert done.stdout == '{"x": 1}\n{"x": 2}\n'
    assert not (folder / "other.txt").exists()
    assert not store.exists("data/set/written.txt")


def test_mount_uploads_new_and_changed_files_while_running_and_at_the_end(
    s3_server: S3Server, tmp_path: Path
) -> None:
    store = s3_server.store()
    store.mkdir("ckpt")
    store.pipe_file("ckpt/run/kept.txt", b"as it was")
    store.pipe_file("ckpt/run/changed.txt", b"old")
    folder = tmp_path / "ckpt"
    plan = cached_mount_plan(s3_server, "s3://ckpt/run", folder)
    # The task waits until its first file is in the bucket: the periodic upload put it there, not the last.
    probe = (
        f"{sys.executable} -c \"import s3fs,sys; fs=s3fs.S3FileSystem(key='{s3_server.key_id}', "
        f"secret='{s3_server.secret}', client_kwargs={{'endpoint_url': '{s3_server.endpoint}'}}); "
        "sys.exit(0 if fs.exists('ckpt/run/step-1/model.bin') else 1)\""
    )
    script = (
        f"mkdir -p {folder}/step-1 && echo weights > {folder}/step-1/model.bin\n"
        f"until {probe}; do sleep 0.1; done\n"
        f"echo new > {folder}/changed.txt\necho done > {folder}/final.txt\nexit 3\n"
    )
    done = wrapped(script, plan, secrets(s3_server))
    assert done.returncode == 3, done.stderr  # the command's own exit, after the last upload
    assert store.cat_file("ckpt/run/step-1/model.bin") == b"weights\n"
    assert store.cat_file("ckpt/run/changed.txt") == b"new\n"
    assert store.cat_file("ckpt/run/final.txt") == b"done\n"
    assert store.cat_file("ckpt/run/kept.txt") == b"as it was"


def test_a_named_bucket_is_created_when_missing(s3_server: S3Server, tmp_path: Path) -> None:
    folder = tmp_path / "out"
    plan = bucket_plan(
        [BucketMount("s3://fresh-bucket", str(folder), create=True)],
        credentials=CREDENTIALS,
        endpoint_url=s3_server.endpoint,
    )
    done = wrapped(f"echo hi > {folder}/hello.txt", plan, secrets(s3_server))
    assert done.returncode == 0, done.stderr
    assert s3_server.store().cat_file("fresh-bucket/hello.txt") == b"hi\n"


def test_tasks_creating_one_bucket_at_once_all_start(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group's tasks share a named bucket: each finds it missing and creates it; the one that loses the race
    finds it made, not a failure (S3 answers BucketAlreadyOwnedByYou)."""
    store = s3_server.store()
    mounts = [BucketMount("s3://shared-bucket", str(tmp_path / f"t{i}"), create=True) for i in range(2)]
    missing = store.exists  # both tasks look before either creates: the race, made certain
    monkeypatch.setattr(store, "exists", lambda path: False if path == "shared-bucket" else missing(path))
    for mount in mounts:
        pull(store, mount)
    assert missing("shared-bucket")


def test_credentials_come_only_from_the_tasks_secrets(s3_server: S3Server, tmp_path: Path) -> None:
    s3_server.store().mkdir("private")
    folder = tmp_path / "p"
    anonymous = bucket_plan([BucketMount("s3://private", str(folder))], endpoint_url=s3_server.endpoint)
    # Valid keys in the environment, but not named by the plan (not the task's vault secrets): not used.
    done = wrapped("echo ran", anonymous, secrets(s3_server))
    assert done.returncode == PRECHECK_EXIT and "ran" not in done.stdout
    assert "cannot copy the task's buckets down" in done.stderr
    wrong = bucket_plan(
        [BucketMount("s3://private", str(folder))], credentials=CREDENTIALS, endpoint_url=s3_server.endpoint
    )
    done = wrapped("echo ran", wrong, {"AWS_ACCESS_KEY_ID": "AKIAUNKNOWN", "AWS_SECRET_ACCESS_KEY": "x"})
    assert done.returncode == PRECHECK_EXIT and "ran" not in done.stdout


def test_a_malformed_plan_is_refused() -> None:
    with pytest.raises(ValueError, match="not a bucket plan"):
        read_plan("{}")
    with pytest.raises(ValueError, match="not an S3 mount"):
        read_plan(bucket_plan([BucketMount("gs://b", "/tmp/x")]))
    done = wrapped("echo ran", "not json")
    assert done.returncode == PRECHECK_EXIT and "ran" not in done.stdout


def test_mount_copies_down_what_others_write_while_running_and_keeps_its_own_files(
    s3_server: S3Server, tmp_path: Path
) -> None:
    store = s3_server.store()
    store.mkdir("shared")
    store.pipe_file("shared/run/mine.txt", b"the bucket's")
    folder = tmp_path / "shared"
    plan = cached_mount_plan(s3_server, "s3://shared/run", folder)
    # Another writer's object appears after the task started: the task waits until it is in its folder.
    script = (
        f"echo local > {folder}/mine.txt\n"
        f"until [ -f {folder}/later/step-2.json ]; do sleep 0.1; done\n"
        f"cat {folder}/later/step-2.json\n"
    )
    task = started(script, plan, secrets(s3_server))
    while not (folder / "mine.txt").exists() or (folder / "mine.txt").read_text() != "local\n":
        assert task.poll() is None
        time.sleep(0.05)
    store.pipe_file("shared/run/later/step-2.json", b'{"step": 2}')
    out, _ = task.communicate(timeout=60)
    assert task.returncode == 0
    assert out == '{"step": 2}'
    assert store.cat_file("shared/run/mine.txt") == b"local\n"  # the task's own write, not replaced
    assert not list(folder.rglob(".*tandem-part"))


def test_mount_deletes_both_ways(s3_server: S3Server, tmp_path: Path) -> None:
    """A file the task deletes is deleted from the bucket; an object someone else deletes while the task runs
    is deleted from its folder."""
    store = s3_server.store()
    store.mkdir("sync")
    for name in ("dropped-here.txt", "dropped-there.txt", "kept.txt"):
        store.pipe_file(f"sync/run/{name}", b"first")
    folder = tmp_path / "sync"
    plan = cached_mount_plan(s3_server, "s3://sync/run", folder)
    # The task deletes a file, says so, and waits until the other writer's deletion reached its folder.
    script = (
        f"rm {folder}/dropped-here.txt && touch {tmp_path}/ready\n"
        f"until [ ! -e {folder}/dropped-there.txt ]; do sleep 0.1; done\n"
        f"ls {folder}\n"
    )
    task = started(script, plan, secrets(s3_server))
    while not (tmp_path / "ready").exists():
        assert task.poll() is None
        time.sleep(0.05)
    store.rm_file("sync/run/dropped-there.txt")
    out, _ = task.communicate(timeout=60)
    assert task.returncode == 0
    assert out.split() == ["kept.txt"]
    store.invalidate_cache()
    assert store.ls("sync/run", detail=False) == ["sync/run/kept.txt"]


def test_a_file_the_task_changed_outlives_its_objects_deletion(s3_server: S3Server, tmp_path: Path) -> None:
    """Deleted in the bucket after the task rewrote it but before that was uploaded: the task's write wins,
    and the next upload puts it back; a file the task deleted is not copied down again before its push."""
    store = s3_server.store()
    store.mkdir("race")
    store.pipe_file("race/run/rewritten.txt", b"first")
    store.pipe_file("race/run/deleted-here.txt", b"first")
    mount = BucketMount("s3://race/run", str(tmp_path / "race"), mode="mount")
    seen = pull(store, mount)
    (tmp_path / "race" / "rewritten.txt").write_text("second")
    (tmp_path / "race" / "deleted-here.txt").unlink()
    store.rm_file("race/run/rewritten.txt")
    seen = fetch_new(store, mount, seen)
    assert (tmp_path / "race" / "rewritten.txt").read_text() == "second"
    assert not (tmp_path / "race" / "deleted-here.txt").exists()
    push(store, mount, seen)
    store.invalidate_cache()
    assert store.ls("race/run", detail=False) == ["race/run/rewritten.txt"]
    assert store.cat_file("race/run/rewritten.txt") == b"second"

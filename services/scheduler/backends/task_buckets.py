"""Copy a task's bucket mounts down, run its command, copy what it wrote back up: the in-task half of SkyPilot's
storage mounts (`file_mounts: {/data: {source: s3://..., mode: MOUNT}}`).

    python -m services.scheduler.backends.task_buckets bash -euo pipefail -c '<the task's script>'

The scheduler starts a task that mounts buckets through this module (inside the secrets wrapper, so the
task's vault secrets are already in the environment). It reads `TANDEM_BUCKETS`, a JSON list written by
`bucket_plan`: for each bucket its URL, the folder it lands in, its mode and whether to create it, plus the
S3 endpoint and the names of the credential variables that came from the vault. Then:

1. For every bucket (created first when asked): each object under the URL is copied to the same relative
   path under the folder. A bucket that cannot be read exits with `PRECHECK_EXIT` (223, the code of a failed
   `setup`), which the scheduler classifies as a PRECHECK failure, never recovered.
2. The command runs as a child; SIGTERM and SIGINT are passed on to it.
3. For MOUNT and MOUNT_CACHED buckets that are not read-only, files that are new or changed since the copy
   down (size or modification time) are uploaded every `sync_interval_s` while the command runs and once more
   when it ends, and files the task deletes are deleted from the bucket. At each interval the folder also
   takes what others did to the bucket: objects new there are copied down, and a file whose object was
   deleted is deleted, unless the task changed it since (the task's own writes win). An upload that fails
   at the end turns a successful exit into 1, with the reason on stderr.

There is no FUSE on the nodes here, so nothing streams: that is the difference from SkyPilot's MOUNT, whose
reads fetch objects on demand and whose writes reach the bucket on close (see SPEC.md).

Credentials: only the variables the task's own secrets set (`credentials` in the plan, e.g.
`AWS_ACCESS_KEY_ID`); without them the bucket is opened anonymously. Every other `AWS_*` variable is removed
from this process before the client is made, so no credential, profile or endpoint of the machine the task
runs on is ever used. The command's own environment is left as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUCKETS_ENV = "TANDEM_BUCKETS"
PRECHECK_EXIT = 223  # services.scheduler.expand.SETUP_FAILED_EXIT: a PRECHECK failure
MODES = ("mount", "copy", "mount_cached")
CREDENTIAL_ENVS = {
    "key": "AWS_ACCESS_KEY_ID",
    "secret": "AWS_SECRET_ACCESS_KEY",
    "token": "AWS_SESSION_TOKEN",
}
Snapshot = dict[str, tuple[int, int]]  # relative path -> (size, mtime_ns)
# The object a bucket made for a job holds at its root: the job's name. The scheduler deletes a bucket of a
# `persistent: false` mount when the job ends only if it holds this job's name (`delete_made_bucket`). Never
# copied down, so no task sees it.
MADE_BY = ".tandem-made-by"


@dataclass(frozen=True)
class BucketMount:
    url: str  # s3://bucket[/prefix]
    folder: str  # where its objects land on the node
    mode: str = "mount"  # one of MODES
    create: bool = False
    read_only: bool = False

    @property
    def uploads(self) -> bool:
        return self.mode != "copy" and not self.read_only


def bucket_plan(
    mounts: Sequence[BucketMount],
    *,
    credentials: Sequence[str] = (),
    endpoint_url: str = "",
    region: str = "",
    sync_interval_s: float = 30.0,
) -> str:
    """`TANDEM_BUCKETS`'s value: the mounts, the credential variables the vault provides, the endpoint."""
    return json.dumps(
        {
            "mounts": [m.__dict__ for m in mounts],
            "credentials": sorted(credentials),
            "endpoint_url": endpoint_url,
            "region": region,
            "sync_interval_s": sync_interval_s,
        },
        sort_keys=True,
    )


def read_plan(text: str) -> tuple[list[BucketMount], dict[str, Any]]:
    """The mounts and the client settings of a `bucket_plan`; ValueError when it is malformed."""
    try:
        plan = json.loads(text)
        mounts = [BucketMount(**m) for m in plan["mounts"]]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{BUCKETS_ENV} is not a bucket plan: {exc}") from None
    for mount in mounts:
        if not mount.url.startswith("s3://") or mount.mode not in MODES:
            raise ValueError(f"{BUCKETS_ENV}: {mount.url!r} in mode {mount.mode!r} is not an S3 mount")
    return mounts, plan


def open_store(plan: Mapping[str, Any], environ: Mapping[str, str]) -> Any:
    """An s3fs filesystem with only the plan's credentials (from `environ`, the vault's values)."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        del os.environ[name]  # nothing of the node's own: no profile, key, region or endpoint
    given = {
        field: environ.get(env, "") for field, env in CREDENTIAL_ENVS.items() if env in plan["credentials"]
    }
    return store_with(given, plan.get("endpoint_url", ""), plan.get("region", ""))


def store_with(given: Mapping[str, str], endpoint_url: str, region: str) -> Any:
    """An s3fs filesystem with exactly these credentials (`key`, `secret`, `token`), else anonymous."""
    import s3fs  # noqa: PLC0415 - only tasks with buckets need it (the `storage` extra)

    client: dict[str, str] = {}
    if endpoint_url:
        client["endpoint_url"] = endpoint_url
    if region:
        client["region_name"] = region
    if given.get("key") and given.get("secret"):
        return s3fs.S3FileSystem(
            key=given["key"],
            secret=given["secret"],
            token=given.get("token") or None,
            client_kwargs=client,
            skip_instance_cache=True,
        )
    return s3fs.S3FileSystem(anon=True, client_kwargs=client, skip_instance_cache=True)


def delete_made_bucket(store: Any, url: str, job: str) -> bool:
    """SkyPilot's `persistent: false` at the job's end: delete the bucket with everything in it if `job` made
    it (its MADE_BY object says so); True when deleted, False when it is not this job's (kept)."""
    bucket = _root(url).split("/", 1)[0]
    try:
        made_by = store.cat_file(f"{bucket}/{MADE_BY}").decode()
    except FileNotFoundError:
        return False
    if made_by != job:
        return False
    for key in store.find(bucket):
        store.rm_file(key)
    store.rmdir(bucket)
    return True


def _root(url: str) -> str:
    return url.removeprefix("s3://").rstrip("/")


def pull(store: Any, mount: BucketMount) -> Snapshot:
    """Copy every object under the mount's URL into its folder; the snapshot of what is there after."""
    folder = Path(mount.folder)
    folder.mkdir(parents=True, exist_ok=True)
    root = _root(mount.url)
    bucket = root.split("/", 1)[0]
    if mount.create and not store.exists(bucket):
        with contextlib.suppress(FileExistsError):  # another task of the group made it a moment ago
            store.mkdir(bucket)
            store.pipe_file(f"{bucket}/{MADE_BY}", os.environ.get("TANDEM_JOB", "").encode())
    for key in store.find(root):
        if key == f"{bucket}/{MADE_BY}":
            continue
        relative = key[len(root) :].lstrip("/")
        if not relative:  # the URL names one object: it lands in the folder under its own name
            relative = root.rsplit("/", 1)[-1]
        target = folder / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        store.get_file(key, str(target))
    return snapshot(folder)


def snapshot(folder: Path) -> Snapshot:
    out: Snapshot = {}
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            stat = path.stat()
            out[path.relative_to(folder).as_posix()] = (stat.st_size, stat.st_mtime_ns)
    return out


def push(store: Any, mount: BucketMount, before: Snapshot) -> Snapshot:
    """Upload the files that are new or changed since `before` and delete the objects of the files gone since;
    the snapshot this was done from. On an error nothing is remembered: the next push tries it all again."""
    folder = Path(mount.folder)
    now = snapshot(folder)
    root = _root(mount.url)
    for relative, seen in sorted(now.items()):
        if before.get(relative) != seen:
            store.put_file(str(folder / relative), f"{root}/{relative}")
    for relative in sorted(before.keys() - now.keys()):
        with contextlib.suppress(FileNotFoundError):  # someone else deleted it too
            store.rm_file(f"{root}/{relative}")
    return now


def fetch_new(store: Any, mount: BucketMount, seen: Snapshot) -> Snapshot:
    """Bring what others did to the bucket since `seen` into the mount's folder: objects it does not have
    yet are copied down, and files whose objects are gone are deleted where the task has not changed them
    since. `seen` is updated to match, so neither is uploaded or deleted back. Files the task wrote, or
    deleted without a push since, are left as they are: the task's own writes win."""
    folder = Path(mount.folder)
    root = _root(mount.url)
    added = dict(seen)
    store.invalidate_cache(root)  # the listing, not one remembered from the last look
    bucket = root.split("/", 1)[0]
    listed = {key[len(root) :].lstrip("/") for key in store.find(root) if key != f"{bucket}/{MADE_BY}"}
    if "" in listed:  # the URL names one object, copied down at the start: nothing more comes of it
        return added
    for relative in sorted(seen.keys() - listed):
        target = folder / relative
        with contextlib.suppress(FileNotFoundError):
            stat = target.stat()
            if (stat.st_size, stat.st_mtime_ns) != seen[relative]:
                continue  # changed by the task since: its write wins, and the next push uploads it
            target.unlink()
        del added[relative]
    for relative in sorted(listed):
        target = folder / relative
        if relative in seen or target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.tandem-part")
        store.get_file(f"{root}/{relative}", str(partial))
        partial.replace(target)  # whole, or not there: a reader never sees half a file
        stat = target.stat()
        added[relative] = (stat.st_size, stat.st_mtime_ns)
    return added


def main(argv: Sequence[str]) -> int:
    if not argv:
        print("usage: python -m services.scheduler.backends.task_buckets COMMAND [ARG...]", file=sys.stderr)
        return 2
    child_env = dict(os.environ)
    child_env.pop(BUCKETS_ENV, None)
    try:
        mounts, plan = read_plan(os.environ.get(BUCKETS_ENV, ""))
        store = open_store(plan, child_env)
        seen = {m.folder: pull(store, m) for m in mounts}
    except Exception as exc:  # any failure to reach a bucket is the task's PRECHECK failure
        print(f"[tandem] cannot copy the task's buckets down: {type(exc).__name__}: {exc}", file=sys.stderr)
        return PRECHECK_EXIT
    uploading = [m for m in mounts if m.uploads]
    child = subprocess.Popen(list(argv), env=child_env)  # the task's own command
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, _f: child.send_signal(s))
    interval = float(plan.get("sync_interval_s") or 30.0)
    code: int | None = None
    while code is None:
        try:
            code = child.wait(timeout=interval if uploading else None)
        except subprocess.TimeoutExpired:
            for mount in uploading:
                try:
                    seen[mount.folder] = push(store, mount, seen[mount.folder])
                except Exception as exc:  # a failed periodic upload is retried next time
                    print(f"[tandem] upload to {mount.url} failed, retrying: {exc}", file=sys.stderr)
                try:
                    seen[mount.folder] = fetch_new(store, mount, seen[mount.folder])
                except Exception as exc:  # and so is a failed look for what others wrote
                    print(f"[tandem] reading {mount.url} failed, retrying: {exc}", file=sys.stderr)
    failed = False
    for mount in uploading:
        for tries in range(3):
            try:
                push(store, mount, seen[mount.folder])
                break
            except Exception as exc:  # reported, and the exit says so
                print(f"[tandem] upload to {mount.url} failed: {exc}", file=sys.stderr)
                failed = failed or tries == 2
                time.sleep(1.0)
    code = 128 - code if code < 0 else code  # killed by a signal: 128 + its number, as a shell says
    return 1 if failed and code == 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

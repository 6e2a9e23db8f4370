"""Fill a bucket from local folders before a job is created: the client's half of SkyPilot's storage mounts
with a local `source` (`/data: {name: my-data, source: ./data, mode: MOUNT}`).

`tandem launch` reads the job file with `load_yaml(..., uploads=[...])`, which records each such bucket as a
`spec.BucketUpload` and leaves the task with the bucket alone (`s3://my-data`, created when missing). Before the
job is submitted the client uploads, as `sky launch` does from the machine it runs on:

- **What:** a folder's files land at the bucket's root; with a list of sources, each lands under its own name
  (a folder's files under `NAME/`, a file as `NAME`). `.git/` is left out, and so is what the folder's
  `.skyignore` names, else what its `.gitignore` names (git's pattern rules), as SkyPilot does.
- **Which:** a file whose object is missing or has another size, or is older than the file, is uploaded; the
  rest are left as they are, and nothing in the bucket is deleted (`aws s3 sync`'s rules, which SkyPilot runs).
- **With what:** the client's own credentials, found as boto finds them (`AWS_ACCESS_KEY_ID`, a profile, ...):
  the vault holds the task's, and the client uploads as the researcher it runs for. The endpoint and region are
  the task's `AWS_ENDPOINT_URL` / `AWS_REGION` envs when it has them, so the upload goes where the task reads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.scheduler.backends.task_workdir import files_of
from services.scheduler.spec import BucketUpload

__all__ = ["Uploaded", "files_of", "open_client_store", "upload"]


@dataclass(frozen=True)
class Uploaded:
    url: str
    uploaded: int  # files sent
    unchanged: int  # files the bucket already had as they are


def open_client_store(upload: BucketUpload) -> Any:
    """An s3fs filesystem with the client's own credentials, at the task's endpoint and region when it has
    them (else the client's)."""
    try:
        import s3fs  # noqa: PLC0415 - only a launch that uploads needs it (the `storage` extra)
    except ImportError:
        raise RuntimeError("uploading into a bucket needs s3fs: pip install 'tandem[storage]'") from None
    client: dict[str, str] = {}
    if upload.endpoint_url:
        client["endpoint_url"] = upload.endpoint_url
    if upload.region:
        client["region_name"] = upload.region
    return s3fs.S3FileSystem(client_kwargs=client)


def upload(store: Any, plan: BucketUpload) -> Uploaded:
    """Create the bucket when missing and upload what is new or changed; see the module's rules."""
    root = plan.url.removeprefix("s3://").rstrip("/")
    bucket = root.split("/", 1)[0]
    if not store.exists(bucket):
        with contextlib.suppress(FileExistsError):  # made a moment ago by someone else
            store.mkdir(bucket)
    sent = kept = 0
    for text in plan.sources:
        source = Path(text)
        prefix = f"{source.name}/" if plan.listed and source.is_dir() else ""
        for path, relative in files_of(source):
            key = f"{root}/{prefix}{relative}"
            if _unchanged(store, path, key):
                kept += 1
                continue
            store.put_file(str(path), key)
            sent += 1
    return Uploaded(plan.url, sent, kept)


def _unchanged(store: Any, path: Path, key: str) -> bool:
    try:
        info = store.info(key)
    except FileNotFoundError:
        return False
    stat = path.stat()
    modified = info.get("LastModified")
    # in whole seconds: stores keep LastModified to the second, so a file written just before its upload
    # is not newer than its object
    newer = modified is not None and int(stat.st_mtime) > modified.timestamp()
    return int(info.get("size", -1)) == stat.st_size and not newer

"""SkyPilot's buckets filled from local folders (`{name, source: ./data}`): what `load_yaml` records, what
`bucket_uploads.upload` sends (against moto's S3 server, signatures checked; tests/support/s3.py), and
`tandem launch` uploading before the job is created (a real mesh behind the gateway)."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from mesh.errors import InvalidArgument
from services.scheduler import bucket_uploads
from services.scheduler import spec as S
from tests.cli.test_cli import Cli, cli, mesh
from tests.support.s3 import S3Server, s3_server

__all__ = ["cli", "mesh", "s3_server"]  # fixtures


def read(text: str, tmp_path: Path) -> tuple[S.JobSpec, list[S.BucketUpload]]:
    path = tmp_path / "task.yaml"
    path.write_text(textwrap.dedent(text))
    uploads: list[S.BucketUpload] = []
    return S.load_yaml(path, uploads=uploads), uploads


def test_a_named_bucket_with_local_sources_is_recorded_for_the_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "notes.txt").write_text("n")
    monkeypatch.chdir(tmp_path)
    spec, uploads = read(
        """\
        envs: {AWS_ENDPOINT_URL: "http://store:9000", AWS_REGION: eu-west-1}
        file_mounts:
          /data: {name: my-data, source: ./data, mode: MOUNT}
          /both: {name: my-both, source: [data, notes.txt]}
        run: ls /data
        """,
        tmp_path,
    )
    buckets = {m.path: m.bucket for m in spec.tasks[0].file_mounts}
    assert (buckets["/data"].url, buckets["/data"].create) == ("s3://my-data", True)
    assert buckets["/both"].url == "s3://my-both"
    assert uploads == [
        S.BucketUpload("s3://my-data", (str(tmp_path / "data"),), False, "http://store:9000", "eu-west-1"),
        S.BucketUpload(
            "s3://my-both",
            (str(tmp_path / "data"), str(tmp_path / "notes.txt")),
            True,
            "http://store:9000",
            "eu-west-1",
        ),
    ]


def test_local_sources_that_cannot_be_uploaded_say_why(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    with pytest.raises(InvalidArgument) as caught:
        S.parse_yaml(f"file_mounts: {{/d: {{name: my-data, source: {tmp_path}/data}}}}\nrun: x\n")
    (violation,) = caught.value.violations
    assert violation.field == 'file_mounts["/d"].source' and "tandem launch" in violation.description
    with pytest.raises(InvalidArgument) as caught:
        read(f"file_mounts: {{/d: {{name: my-data, source: [{tmp_path}/gone]}}}}\nrun: x\n", tmp_path)
    assert "is not a local file or folder" in str(caught.value)
    with pytest.raises(InvalidArgument) as caught:
        read(f"file_mounts: {{/d: {{mode: COPY, source: [{tmp_path}/data]}}}}\nrun: x\n", tmp_path)
    assert "Storage name must be specified if the source is local." in str(caught.value)


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_upload_sends_what_is_new_or_changed_and_leaves_ignored_files_out(
    s3_server: S3Server, tmp_path: Path
) -> None:
    data = tree(
        tmp_path / "data",
        {
            "train.jsonl": "a\n",
            "sub/eval.jsonl": "b\n",
            "cache/big.bin": "x",
            "scratch.tmp": "t",
            ".git/HEAD": "ref",
            ".skyignore": "cache/\n*.tmp\n",
            ".gitignore": "train.jsonl\n",  # not read: .skyignore comes first
        },
    )
    store = s3_server.store()
    plan = S.BucketUpload("s3://my-data", (str(data),), endpoint_url=s3_server.endpoint)
    done = bucket_uploads.upload(store, plan)
    assert sorted(store.find("my-data")) == [
        "my-data/.gitignore",
        "my-data/.skyignore",
        "my-data/sub/eval.jsonl",
        "my-data/train.jsonl",
    ]
    assert (done.uploaded, done.unchanged) == (4, 0)
    again = bucket_uploads.upload(store, plan)
    assert (again.uploaded, again.unchanged) == (0, 4)
    (data / "train.jsonl").write_text("a longer line\n")
    store.rm_file("my-data/sub/eval.jsonl")
    (data / "sub" / "eval.jsonl").unlink()
    third = bucket_uploads.upload(store, plan)
    assert (third.uploaded, third.unchanged) == (1, 2)
    assert store.cat_file("my-data/train.jsonl") == b"a longer line\n"


def test_a_list_of_sources_lands_under_their_names_and_gitignore_is_read_without_skyignore(
    s3_server: S3Server, tmp_path: Path
) -> None:
    code = tree(tmp_path / "code", {"main.py": "print()", "out/log.txt": "l", ".gitignore": "out/\n"})
    notes = tree(tmp_path, {"notes.txt": "n"}) / "notes.txt"
    store = s3_server.store()
    plan = S.BucketUpload("s3://my-both", (str(code), str(notes)), listed=True)
    bucket_uploads.upload(store, plan)
    assert sorted(store.find("my-both")) == [
        "my-both/code/.gitignore",
        "my-both/code/main.py",
        "my-both/notes.txt",
    ]


@pytest.mark.timeout(120)
async def test_launch_uploads_before_the_job_is_created(
    cli: Cli, s3_server: S3Server, tmp_path: Path
) -> None:
    data = tree(tmp_path / "data", {"train.jsonl": "row\n"})
    task = tmp_path / "task.yaml"
    task.write_text(
        textwrap.dedent(
            f"""\
            name: filled
            envs: {{AWS_ENDPOINT_URL: "{s3_server.endpoint}"}}
            file_mounts:
              /data: {{name: launch-data, source: {data}, mode: COPY}}
            run: cat /data/train.jsonl
            """
        )
    )
    store = s3_server.store()
    creds = {"AWS_ACCESS_KEY_ID": s3_server.key_id, "AWS_SECRET_ACCESS_KEY": s3_server.secret}
    code, out, err = await cli.run("launch", str(task), "--dryrun", **creds)
    assert code == 0, err
    assert f"would upload {data} to s3://launch-data" in err
    assert json.loads(out)["tasks"][0]["file_mounts"][0]["bucket"]["url"] == "s3://launch-data"
    assert not store.exists("launch-data")  # a dry run sends nothing
    code, out, err = await cli.run("launch", str(task), "--json", **{**creds, "AWS_ACCESS_KEY_ID": "wrong"})
    assert code == 1 and "cannot upload" in err and "Traceback" not in err, err
    code, out, err = await cli.run("launch", str(task), "--json", **creds)
    assert code == 0, err
    name = json.loads(out)["name"]
    assert store.cat_file("launch-data/train.jsonl") == b"row\n"
    code, _, err = await cli.run("cancel", name)
    assert code == 0, err
    assert os.environ.get("AWS_ACCESS_KEY_ID") != s3_server.key_id  # the test's own process never had it

"""SkyPilot's `workdir`, storage `file_mounts` and the resources keys `ports`, `disk_size`, `use_spot` and
`image_id` as `load_yaml` reads them: every form, the refusals with their reasons, and a file read alike by
SkyPilot's own loader (in .venv-sky, `make setup-skypilot`; that test skips without it)."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
from tandem.scheduler.v1 import job_spec_pb2 as js

from mesh.errors import InvalidArgument
from services.scheduler import expand
from services.scheduler import spec as S
from tests.services.scheduler.test_skypilot import SKY_PYTHON, needs_skypilot

Bucket = js.Bucket


def parse(text: str, base_dir: Path | None = None) -> js.JobSpec:
    return S.parse_yaml(textwrap.dedent(text), base_dir=base_dir)


def refusals(text: str, base_dir: Path | None = None) -> dict[str, str]:
    with pytest.raises(InvalidArgument) as caught:
        parse(text, base_dir)
    return {v.field: v.description for v in caught.value.violations}


def skypilot_reads(script: str, path: Path) -> dict[str, Any]:
    """What SkyPilot's own loader makes of the file at `path`, as the script prints it (JSON, last line)."""
    done = subprocess.run(
        [str(SKY_PYTHON), "-c", script, str(path)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        cwd=path.parent,
        env={**os.environ, "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "HOME": str(path.parent)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_workdir_folder_is_read_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "code").mkdir()
    monkeypatch.chdir(tmp_path)
    task = parse("workdir: code\nrun: python train.py\n", base_dir=tmp_path / "elsewhere").tasks[0]
    assert task.workdir.path == str(tmp_path / "code")
    assert parse(f"workdir: {tmp_path}/code/\nrun: x\n", tmp_path).tasks[0].workdir.path == str(
        tmp_path / "code"
    )
    found = refusals("workdir: missing\nrun: x\n", tmp_path)
    assert "is not a folder" in found["workdir"]
    assert "only from a job file on disk" in refusals("workdir: code\nrun: x\n")["workdir"]
    assert "none of the task's envs" in refusals("workdir: /src/$USER\nrun: x\n")["workdir"]


def test_a_git_workdir_is_a_url_and_a_ref() -> None:
    task = parse("workdir: {url: 'https://github.com/org/repo.git', ref: v1.2}\nrun: x\n").tasks[0]
    assert (task.workdir.git_url, task.workdir.git_ref) == ("https://github.com/org/repo.git", "v1.2")
    assert parse("workdir: {url: 'git@github.com:org/repo.git'}\nrun: x\n").tasks[0].workdir.git_ref == ""
    assert "is required" in refusals("workdir: {ref: main}\nrun: x\n")["workdir.url"]
    assert "not a git URL" in refusals("workdir: {url: 'not a url'}\nrun: x\n")["workdir.url"]
    assert (
        "'-'"
        in refusals("workdir: {url: 'https://h/r.git', ref: '--upload-pack=x'}\nrun: x\n")["workdir.ref"]
    )


def test_workdir_lines_copy_or_check_out_and_fail_as_precheck() -> None:
    folder = js.TaskSpec(name="t", kind=js.TaskSpec.KIND_COMMAND, run="x", workdir=js.Workdir(path="/src"))
    [line] = expand.workdir_lines(folder)
    assert "cp -R -p -- /src/. ." in line and f"exit {expand.SETUP_FAILED_EXIT}" in line
    git = js.TaskSpec(workdir=js.Workdir(git_url="https://h/r.git", git_ref="v1"))
    [line] = expand.workdir_lines(git)
    assert "git fetch -q --depth 1 -- https://h/r.git v1" in line and "checkout -q -f FETCH_HEAD" in line
    assert expand.workdir_lines(js.TaskSpec()) == []


@pytest.mark.parametrize(
    ("value", "url", "mode", "create"),
    [
        ("s3://datasets/gsm8k", "s3://datasets/gsm8k", Bucket.MODE_COPY, False),  # a URI value is COPY
        ("{source: 's3://datasets/'}", "s3://datasets", Bucket.MODE_UNSPECIFIED, False),  # MOUNT
        ("{source: 's3://data/x', mode: copy}", "s3://data/x", Bucket.MODE_COPY, False),
        ("{name: ckpts, store: s3, mode: MOUNT_CACHED}", "s3://ckpts", Bucket.MODE_MOUNT_CACHED, True),
        ("{name: ckpts, persistent: true}", "s3://ckpts", Bucket.MODE_UNSPECIFIED, True),
    ],
)
def test_buckets_in_every_skypilot_form(value: str, url: str, mode: int, create: bool) -> None:
    [mount] = parse(f"run: x\nfile_mounts:\n  /data: {value}\n").tasks[0].file_mounts
    assert (mount.path, mount.bucket.url, mount.bucket.mode, mount.bucket.create) == (
        "/data",
        url,
        mode,
        create,
    )


@pytest.mark.parametrize(
    ("value", "field", "words"),
    [
        ("gs://bucket/data", "", "opens S3 buckets"),
        ("{name: bkt, store: gcs}", ".store", "opens S3 buckets"),
        ("{name: bkt, source: /local/dir}", ".source", "tandem launch"),
        ("{name: bkt, source: 's3://c'}", ".name", "not both"),
        ("{source: [/a, /b]}", ".name", "Storage name must be specified if the source is local."),
        ("{source: 's3://theirs', persistent: false}", ".persistent", "someone's own and kept"),
        ("{source: 's3://bkt', mode: STREAM}", ".mode", "must be one of mount, copy, mount_cached"),
        (
            "{source: 's3://bkt', config: {mount_cached: {}}}",
            ".config.mount_cached",
            "with mode MOUNT_CACHED",
        ),
        ("{mode: COPY}", "", "source must be specified when using COPY mode"),
        ("{volume: v, name: bkt}", ".volume", "not taken with a bucket"),
        ("{source: 's3://B_ad'}", ".source", "not an S3 bucket name"),
        ("{name: B_ad}", ".name", "not an S3 bucket name"),
        ("'s3://'", "", "not an S3 bucket name"),
    ],
)
def test_buckets_that_cannot_be_mounted_say_why(value: str, field: str, words: str) -> None:
    found = refusals(f"run: x\nfile_mounts:\n  /data: {value}\n")
    where = f'file_mounts["/data"]{field}'
    assert where in found, found
    assert words in found[where], found[where]


def test_the_placement_keys() -> None:
    resources = (
        parse(
            """\
        run: x
        resources:
          disk_size: 256
          ports: [8080, "10000-10010"]
          use_spot: true
          image_id: docker:nvcr.io/nvidia/pytorch:24.01-py3
        """
        )
        .tasks[0]
        .resources
    )
    assert resources.disk_gib == 256 and list(resources.ports) == ["8080", "10000-10010"]
    assert resources.preemptible and resources.image == "nvcr.io/nvidia/pytorch:24.01-py3"
    assert list(parse("run: x\nresources: {ports: 8888}\n").tasks[0].resources.ports) == ["8888"]
    assert S.port_range("10000-10010") == range(10000, 10011)


@pytest.mark.parametrize(
    ("resources", "field", "words"),
    [
        ("{ports: 70000}", "resources.ports[0]", "1 to 65535"),
        ("{ports: '9-3'}", "resources.ports[0]", "not above the last"),
        ("{ports: 'http'}", "resources.ports[0]", "not a port"),
        ("{ports: '1000-5000'}", "resources.ports[0]", "at most 1024"),
        ("{ports: [true]}", "resources.ports[0]", "must be a port"),
        ("{disk_size: -1}", "resources.disk_size", "0 (the backend default) or more"),
        ("{use_spot: yes-please}", "resources.use_spot", "true or false"),
        ("{image_id: ami-0123}", "resources.image_id", "machine image"),
        ("{image_id: {us-east-1: ami-1}}", "resources.image_id", "by region"),
        ("{image_id: 'docker:two words'}", "resources.image_id", "not an image reference"),
    ],
)
def test_placement_keys_that_cannot_mean_anything_say_why(resources: str, field: str, words: str) -> None:
    found = refusals(f"run: x\nresources: {resources}\n")
    assert field in found, found
    assert words in found[field], found[field]


def test_at_most_sixteen_ports() -> None:
    ports = ", ".join(str(8000 + i) for i in range(17))
    assert "at most 16" in refusals(f"run: x\nresources: {{ports: [{ports}]}}\n")["resources.ports"]


# Runs in .venv-sky: what SkyPilot's own loader makes of the file.
ORACLE = """
import json, sys
from sky.utils import dag_utils
task = dag_utils.load_dag_from_yaml(sys.argv[1]).tasks[0]
resources = list(task.resources)[0]
print(json.dumps({
    "workdir": task.workdir,
    "file_mounts": task.file_mounts,
    "storage": {p: [s.source, s.name, s.mode.value] for p, s in task.storage_mounts.items()},
    "ports": resources.ports,
    "disk_size": resources.disk_size,
    "use_spot": resources.use_spot,
    "image_id": resources.image_id,
}))
"""


@needs_skypilot
def test_skypilot_reads_these_keys_as_tandem_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "code").mkdir()
    path = tmp_path / "task.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            name: train_on_buckets
            workdir: code
            resources:
              disk_size: 512
              ports: [8080, "9000-9002"]
              use_spot: true
              image_id: docker:nvcr.io/nvidia/pytorch:24.01-py3
            file_mounts:
              /data: s3://datasets/gsm8k
              /ckpt:
                name: run-ckpts
                store: s3
                mode: MOUNT_CACHED
              /eval:
                source: s3://evals/v2
                mode: COPY
            run: python train.py
            """
        )
    )
    sky = skypilot_reads(ORACLE, path)
    monkeypatch.chdir(tmp_path)
    task = S.load_yaml(path).tasks[0]
    assert task.workdir.path == str((tmp_path / sky["workdir"]).resolve())
    mounts = {m.path: m.bucket for m in task.file_mounts}
    for where, uri in sky["file_mounts"].items():  # a URI as the value: SkyPilot copies it down
        assert (mounts[where].url, mounts[where].mode) == (uri, Bucket.MODE_COPY)
    modes = {"MOUNT": Bucket.MODE_MOUNT, "COPY": Bucket.MODE_COPY, "MOUNT_CACHED": Bucket.MODE_MOUNT_CACHED}
    for where, (source, name, mode) in sky["storage"].items():
        bucket = mounts[where]
        assert bucket.url == (source or f"s3://{name}") and bucket.create == (name is not None)
        assert (bucket.mode or Bucket.MODE_MOUNT) == modes[mode]
    assert set(mounts) == {*sky["file_mounts"], *sky["storage"]}
    resources = task.resources
    assert list(resources.ports) == sky["ports"]
    assert resources.disk_gib == sky["disk_size"] and resources.preemptible == sky["use_spot"]
    assert {f"docker:{resources.image}"} == set(sky["image_id"].values())


# -- any_of / ordered, job_recovery, priority, volumes, managed_secrets, envs in paths ------------------------


@pytest.mark.parametrize("key", ["any_of", "ordered"])
def test_resource_alternatives_are_gpu_requests_in_the_order_written(key: str) -> None:
    task = parse(
        f"""\
        run: x
        resources:
          cpus: 8+
          memory: 64
          {key}:
            - accelerators: H100:8
            - accelerators: [A100-80GB:8, A100:8]
            - {{accelerators: H100:8, cpus: 8}}
        """
    ).tasks[0]
    assert task.resources.gpus == "H100:8"
    assert list(task.resources.gpu_alternatives) == ["A100-80GB:8", "A100:8"]
    assert (task.resources.cpus, task.resources.memory_gib) == (8.0, 64.0)
    want = [S.Resources(gpus=8, gpu_type=t, cpus=8.0, memory_gib=64.0) for t in ("H100", "A100-80GB", "A100")]
    assert S.resource_choices(task) == want


@pytest.mark.parametrize(
    ("resources", "field", "words"),
    [
        (
            "{any_of: [{accelerators: A100:8}], ordered: [{accelerators: A100:8}]}",
            "resources.ordered",
            "one of",
        ),
        ("{any_of: []}", "resources.any_of", "list of resource tables"),
        ("{any_of: [A100:8]}", "resources.any_of[0]", "table of resources"),
        (
            "{any_of: [{cpus: 4}, {accelerators: A100:8}]}",
            "resources.any_of[0]",
            "names no accelerators where another alternative does",
        ),
        ("{any_of: [{cpus: 4}, {cpus: 8}]}", "resources.any_of[1]", "differs from any_of[0] in cpus"),
        ("{any_of: [{any_of: [{accelerators: A100:8}]}]}", "resources.any_of[0].any_of", "do not nest"),
        (
            "{any_of: [{accelerators: A100:8}, {accelerators: H100:8, infra: k8s}]}",
            "resources.any_of[1]",
            "differs from any_of[0] in",
        ),
        (
            "{ordered: [{accelerators: A100:8, instance_type: p4d}]}",
            "resources.ordered[0].instance_type",
            "cloud",
        ),
    ],
)
def test_resource_alternatives_that_cannot_mean_anything_say_why(
    resources: str, field: str, words: str
) -> None:
    found = refusals(f"run: x\nresources: {resources}\n")
    assert field in found, found
    assert words in found[field], found[field]


def test_job_recovery_priority_and_priority_class_are_the_jobs() -> None:
    spec = parse(
        """\
        run: x
        resources:
          infra: k8s
          job_recovery: {strategy: FAILOVER, max_restarts_on_errors: 3, recover_on_exit_codes: 33}
          priority: -200
          priority_class: research-low
        """
    )
    assert spec.recovery.max_restarts_on_errors == 3 and list(spec.recovery.recover_on_exit_codes) == [33]
    assert spec.priority == -200 and spec.kubernetes.priority_class_name == "research-low"
    S.check_spec(spec)
    just_a_strategy = parse("run: x\nresources: {job_recovery: eager_next_region}\n")
    assert just_a_strategy.HasField("recovery")  # preemptions recovered, no restarts on errors: SkyPilot's
    assert just_a_strategy.recovery.max_restarts_on_errors == 0
    codes = parse("run: x\nresources: {job_recovery: {recover_on_exit_codes: [33, 34]}}\n").recovery
    assert list(codes.recover_on_exit_codes) == [33, 34]
    group = parse(
        """\
        name: g
        ---
        name: a
        run: x
        resources: {job_recovery: {max_restarts_on_errors: 2}}
        ---
        name: b
        run: x
        resources: {job_recovery: {max_restarts_on_errors: 2}}
        """
    )
    assert group.recovery.max_restarts_on_errors == 2


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ("resources: {job_recovery: SOMEWHERE}", "resources.job_recovery.strategy", "EAGER_NEXT_REGION"),
        ("resources: {job_recovery: {retries: 3}}", "resources.job_recovery.retries", "not a known key"),
        (
            "resources: {job_recovery: {recover_on_exit_codes: [300]}}",
            "resources.job_recovery",
            "out of range",
        ),
        ("resources: {priority: 1001}", "resources.priority", "out of range"),
        (
            "recovery: {max_restarts_on_errors: 1}\nresources: {job_recovery: {max_restarts_on_errors: 2}}",
            "resources.job_recovery",
            "disagrees with the job's `recovery`",
        ),
        ("priority: 5\nresources: {priority: 7}", "resources.priority", "disagrees"),
        ("resources: {priority_class: low}", "resources.priority_class", "infra: k8s"),
    ],
)
def test_job_keys_under_resources_that_cannot_hold_say_why(text: str, field: str, words: str) -> None:
    found = refusals(f"run: x\n{text}\n")
    assert any(f.startswith(field) and words in d for f, d in found.items()), found


def test_tasks_of_a_group_must_agree_on_the_jobs_recovery() -> None:
    found = refusals(
        """\
        name: g
        ---
        name: a
        run: x
        resources: {job_recovery: {max_restarts_on_errors: 1}}
        ---
        name: b
        run: x
        resources: {priority: 10, job_recovery: {max_restarts_on_errors: 2}}
        """
    )
    assert "differs from tasks[0].resources.job_recovery" in found["tasks[1].resources.job_recovery"]


def test_volumes_mount_the_deployments_volumes_and_node_folders() -> None:
    task = parse(
        """\
        run: x
        volumes:
          /ckpt: shared-ckpt
          /data: {name: datasets, read_only: true}
          /scratch: {host_path: /mnt/nvme}
        """
    ).tasks[0]
    mounts = {m.path: m for m in task.file_mounts}
    assert mounts["/ckpt"].volume == "shared-ckpt" and not mounts["/ckpt"].read_only
    assert mounts["/data"].volume == "datasets" and mounts["/data"].read_only
    assert mounts["/scratch"].local_path == "/mnt/nvme"
    (sub,) = parse("run: x\nvolumes: {/ckpt: {name: shared, sub_path: runs/r1}}\n").tasks[0].file_mounts
    assert (sub.volume, sub.sub_path) == ("shared", "runs/r1")
    assert "'.' or '..'" in str(refusals("run: x\nvolumes: {/c: {name: shared, sub_path: ../other}}\n"))
    found = refusals("run: x\nvolumes: {data: v, /x: {name: a, host_path: /b}, /y: 3}\n")
    assert "absolute" in found['volumes["data"]']
    assert "exactly one of name and host_path" in found['volumes["/x"]']
    assert "a volume's name" in found['volumes["/y"]']


def test_managed_secrets_are_vault_secrets_in_their_variables() -> None:
    task = parse("run: x\nmanaged_secrets: [HF_TOKEN, 'secrets:WANDB_API_KEY']\n").tasks[0]
    assert [(b.secret, S.secret_env_name(b)) for b in task.secrets] == [
        ("hf-token", "HF_TOKEN"),
        ("wandb-api-key", "WANDB_API_KEY"),
    ]
    (filed,) = parse("run: x\nmanaged_secrets: [{HF_TOKEN: {mount_path: /run/hf/token}}]\n").tasks[0].secrets
    assert (filed.secret, filed.file) == ("hf-token", "/run/hf/token")
    found = refusals("run: x\nmanaged_secrets: [{A: {}, B: {}}, 3]\n")
    assert "one {NAME: {mount_path: /path}} table" in found["managed_secrets[0]"]
    assert "secret's name" in found["managed_secrets[1]"]
    found = refusals("run: x\nmanaged_secrets: [{C: {mount_path: relative/c}}]\n")
    assert "absolute path of a file" in found['managed_secrets[0]["C"].mount_path'], found


def test_the_tasks_envs_fill_its_mount_paths_and_workdir(tmp_path: Path) -> None:
    (tmp_path / "code-7b").mkdir()
    (tmp_path / "code-70b").mkdir()
    text = f"""\
        envs: {{SIZE: "7", CKPT: null}}
        workdir: {tmp_path}/code-${{SIZE}}b
        file_mounts:
          /model/llama-${{SIZE}}b: s3://weights/llama-$SIZE-b
          /out: {{name: $CKPT, store: s3}}
        volumes:
          /vol-$SIZE: vol-${{SIZE}}
        run: echo $SIZE
        """
    spec = S.parse_yaml(textwrap.dedent(text), base_dir=tmp_path, envs={"CKPT": "run-42"})
    task = spec.tasks[0]
    assert task.workdir.path == str(tmp_path / "code-7b")
    mounts = {m.path: m for m in task.file_mounts}
    assert mounts["/model/llama-7b"].bucket.url == "s3://weights/llama-7-b"
    assert mounts["/out"].bucket.url == "s3://run-42"
    assert mounts["/vol-7"].volume == "vol-7"
    assert task.run == "echo $SIZE"  # the command is the shell's to expand
    given = S.parse_yaml(textwrap.dedent(text), base_dir=tmp_path, envs={"CKPT": "ckpt", "SIZE": "70"})
    assert "/model/llama-70b" in {m.path for m in given.tasks[0].file_mounts}


def test_ephemeral_storage_is_skypilots_older_disk_size() -> None:
    assert parse("run: x\nresources: {ephemeral_storage: 100}\n").tasks[0].resources.disk_gib == 100
    found = refusals("run: x\nresources: {ephemeral_storage: 100, disk_size: 50}\n")
    assert "one of disk_size and ephemeral_storage" in found["resources.ephemeral_storage"]


ORACLE_MORE = """
import json, sys
import sky
task = sky.Task.from_yaml(sys.argv[1])
resources = list(task.resources)
print(json.dumps({
    "accelerators": [sorted(r.accelerators.items()) for r in resources],
    "cpus": sorted({str(r.cpus) for r in resources}),
    "job_recovery": [r.job_recovery for r in resources],
    "priority": sorted({r.priority for r in resources}),
    "file_mounts": task.file_mounts,
    "volumes": task.volumes,
    "secrets": sorted(ref.name for ref in task.managed_secret_refs),
}))
"""


@needs_skypilot
def test_skypilot_reads_alternatives_recovery_volumes_and_filled_paths_as_tandem_does(tmp_path: Path) -> None:
    path = tmp_path / "task.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            envs: {SIZE: "7"}
            resources:
              cpus: 8+
              ordered:
                - accelerators: H100:8
                - accelerators: A100:8
              job_recovery: {strategy: FAILOVER, max_restarts_on_errors: 3, recover_on_exit_codes: 33}
              priority: -200
            file_mounts:
              /model/llama-${SIZE}b: /weights/llama-$SIZE-b
            volumes:
              /ckpt: shared-ckpt
            managed_secrets: [HF_TOKEN]
            run: python train.py
            """
        )
    )
    sky = skypilot_reads(ORACLE_MORE, path)
    spec = S.load_yaml(path)
    task = spec.tasks[0]
    ours = [task.resources.gpus, *task.resources.gpu_alternatives]
    assert ours == [f"{name}:{count}" for ((name, count),) in sky["accelerators"]]
    assert sky["cpus"] == [f"{task.resources.cpus:g}+"]
    (recovery,) = {json.dumps(r, sort_keys=True) for r in sky["job_recovery"]}
    want = json.loads(recovery)
    assert spec.recovery.max_restarts_on_errors == want["max_restarts_on_errors"]
    assert list(spec.recovery.recover_on_exit_codes) == [want["recover_on_exit_codes"]]
    assert sky["priority"] == [spec.priority]
    mounts = {m.path: m for m in task.file_mounts}
    for where, source in sky["file_mounts"].items():
        assert mounts[where].local_path == source
    for where, volume in sky["volumes"].items():
        assert mounts[where].volume == volume
    assert sky["secrets"] == [S.secret_env_name(b) for b in task.secrets]


def test_labels_are_the_pods_on_kubernetes_only() -> None:
    spec = parse("run: x\nresources: {infra: k8s, labels: {team: rl, example.com/cost-center: 42}}\n")
    assert dict(spec.tasks[0].resources.labels) == {"team": "rl", "example.com/cost-center": "42"}
    S.check_spec(spec)
    assert "infra: k8s" in refusals("run: x\nresources: {labels: {team: rl}}\n")["resources.labels"]
    found = refusals("run: x\nresources: {infra: k8s, labels: {tandem.dev/job: x, 'a b': c, ok: 'not ok'}}\n")
    assert "Tandem's own labels" in found['resources.labels["tandem.dev/job"]']
    assert "not a Kubernetes label key" in found['resources.labels["a b"]']
    assert "not a label value" in found['resources.labels["ok"]']


@pytest.mark.parametrize(
    ("extra", "read_only"),
    [
        ("mode: MOUNT_CACHED, type: MODEL_CHECKPOINT_RO", True),
        ("mode: MOUNT_CACHED, type: dataset_rw", False),
        ("mode: MOUNT_CACHED, config: {mount_cached: {read_only: true}}", True),
        ("config: {mount: {read_only: true}}", True),  # MOUNT is the default mode
    ],
)
def test_a_buckets_type_and_config_give_its_read_only_part(extra: str, read_only: bool) -> None:
    (mount,) = (
        parse(f"run: x\nfile_mounts: {{/ckpt: {{source: s3://ckpts/run, {extra}}}}}\n").tasks[0].file_mounts
    )
    assert mount.bucket.url == "s3://ckpts/run" and mount.read_only is read_only


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ("type: DATASET_RO", ".type", "only be given with mode MOUNT_CACHED"),
        ("mode: MOUNT_CACHED, type: LOGS", ".type", "must be one of"),
        ("mode: COPY, config: {mount: {read_only: true}}", ".config.mount", "with mode MOUNT"),
        (
            "mode: MOUNT_CACHED, config: {mount_cached: {transfers: 8}}",
            ".config.mount_cached.transfers",
            "rclone",
        ),
        ("config: {disk_size: 100}", ".config.disk_size", "cloud volume"),
        ("config: {mount: {hf_mount_args: [-x]}}", ".config.mount.hf_mount_args", "Hugging Face"),
    ],
)
def test_bucket_tuning_that_cannot_mean_anything_says_why(extra: str, field: str, words: str) -> None:
    found = refusals(f"run: x\nfile_mounts: {{/ckpt: {{source: s3://ckpts/run, {extra}}}}}\n")
    key = f'file_mounts["/ckpt"]{field}'
    assert key in found, found
    assert words in found[key], found[key]


def test_tiers_and_same_infra_are_taken_as_skypilot_takes_them_on_kubernetes_and_slurm() -> None:
    task = parse("run: x\nresources: {disk_tier: best, network_tier: standard, disk_size: 100}\n").tasks[0]
    assert task.resources.disk_gib == 100  # the tiers choose nothing: there is no cloud product to pick
    group = parse("name: g\nplacement: same_infra\n---\nname: a\nrun: x\n---\nname: b\nrun: x\n")
    assert [t.name for t in group.tasks] == ["a", "b"]
    assert "SAME_INFRA" in refusals("name: g\nplacement: spread\n---\nname: a\nrun: x\n")["placement"]


def test_an_image_id_on_kubernetes_is_a_container_image_without_docker() -> None:
    task = parse("run: x\nresources: {infra: k8s, image_id: rocm/pytorch:latest}\n").tasks[0]
    assert task.resources.image == "rocm/pytorch:latest"
    assert (
        "machine image"
        in refusals("run: x\nresources: {image_id: rocm/pytorch:latest}\n")["resources.image_id"]
    )


def test_relative_host_paths_are_read_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "task.yaml").write_text("run: x\nfile_mounts: {/code: ./code, /data: {source: data/v1}}\n")
    mounts = {m.path: m.local_path for m in S.load_yaml(tmp_path / "task.yaml").tasks[0].file_mounts}
    assert mounts == {"/code": str(tmp_path / "code"), "/data": str(tmp_path / "data" / "v1")}
    assert (
        "read only from a job file on disk"
        in refusals("run: x\nfile_mounts: {/code: ./code}\n")['file_mounts["/code"]']
    )
    found = refusals("run: x\nfile_mounts: {/data: {source: ./data, mode: MOUNT}}\n")
    assert found['file_mounts["/data"].name'] == "Storage name must be specified if the source is local."


def test_any_of_spot_or_not_is_spot_and_ordered_takes_the_first() -> None:
    def preemptible(key: str, alternatives: str) -> bool:
        text = f"run: x\nresources: {{accelerators: A100:8, {key}: {alternatives}}}\n"
        return parse(text).tasks[0].resources.preemptible

    assert preemptible("any_of", "[{use_spot: false}, {use_spot: true}]")  # the cheapest: SkyPilot's rule
    assert preemptible("ordered", "[{use_spot: true}, {use_spot: false}]")
    assert not preemptible("ordered", "[{use_spot: false}, {use_spot: true}]")


def test_a_mount_under_the_tasks_home_is_taken_and_another_users_is_refused() -> None:
    [mount] = parse("run: x\nfile_mounts: {~/.ssh/id_rsa: /keys/id_rsa}\n").tasks[0].file_mounts
    assert (mount.path, mount.local_path) == ("~/.ssh/id_rsa", "/keys/id_rsa")
    found = refusals("run: x\nfile_mounts: {~root/.ssh/id_rsa: /keys/id_rsa}\n")
    assert "another user's home" in found['file_mounts["~root/.ssh/id_rsa"]']


def test_elastic_recovery_says_what_is_missing() -> None:
    found = refusals(
        "run: x\nnum_nodes: 4\nresources: {job_recovery: {strategy: DYNAMIC_NODE_SET, min_nodes: 2}}\n"
    )
    assert "SkyPilot server plugin" in found["resources.job_recovery.strategy"]


def test_alternatives_without_accelerators_are_spot_or_not() -> None:
    # SkyPilot's CPU task that may run on spot: the alternatives differ in use_spot alone
    resources = parse("run: x\nresources: {cpus: 4, any_of: [{use_spot: true}, {use_spot: false}]}\n")
    task = resources.tasks[0].resources
    assert (task.cpus, task.gpus, list(task.gpu_alternatives), task.preemptible) == (4, "", [], True)
    task = parse("run: x\nresources: {ordered: [{use_spot: false}, {use_spot: true}]}\n").tasks[0].resources
    assert not task.preemptible


def test_aws_neuron_accelerators_say_why() -> None:
    for name in ("Inferentia:6", "Trainium2:16"):
        found = refusals(f"run: x\nresources: {{accelerators: {name}}}\n")
        assert "AWS Neuron accelerator, only on AWS" in found["resources.accelerators"], found


@pytest.mark.parametrize("scheme", ["r2", "minio"])
def test_s3_compatible_stores_are_s3_at_the_tasks_endpoint(scheme: str) -> None:
    endpoint = "envs: {AWS_ENDPOINT_URL: 'https://objects.example.org'}\n"
    [mount] = (
        parse(f"run: x\n{endpoint}file_mounts: {{/data: {scheme}://my-data/train}}\n").tasks[0].file_mounts
    )
    assert mount.bucket.url == "s3://my-data/train"
    [mount] = (
        parse(f"run: x\n{endpoint}file_mounts: {{/data: {{name: my-data, store: {scheme}}}}}\n")
        .tasks[0]
        .file_mounts
    )
    assert mount.bucket.url == "s3://my-data"
    found = refusals(f"run: x\nfile_mounts: {{/data: {scheme}://my-data}}\n")
    assert "an S3-compatible store" in found['file_mounts["/data"]'], found
    assert "AWS_ENDPOINT_URL" in found['file_mounts["/data"]']
    found = refusals(f"run: x\nfile_mounts: {{/data: {{name: my-data, store: {scheme}}}}}\n")
    assert "an S3-compatible store" in found['file_mounts["/data"].store'], found
    found = refusals("run: x\nfile_mounts: {/data: gs://my-data}\n")
    assert "public cloud's own object store" in found['file_mounts["/data"]'], found


def test_an_empty_secret_is_the_variable_set_empty() -> None:
    task = parse("run: x\nsecrets: {HF_TOKEN: '', WANDB_API_KEY: null}\n").tasks[0]
    assert dict(task.envs) == {"HF_TOKEN": ""}
    assert [S.secret_env_name(b) for b in task.secrets] == ["WANDB_API_KEY"]
    found = refusals("run: x\nsecrets: {HF_TOKEN: hf_abc}\n")
    assert "is a secret's value in the job file" in found['secrets["HF_TOKEN"]'], found
    found = refusals("run: x\nenvs: {HF_TOKEN: x}\nsecrets: {HF_TOKEN: ''}\n")
    assert any("also set in envs" in v for v in found.values()), found


def test_a_variable_no_env_fills_is_named() -> None:
    found = refusals("run: x\nfile_mounts: {/groups.txt: /shared/$GROUP_FILE}\n")
    assert found['file_mounts["/groups.txt"]'].startswith("$GROUP_FILE is none of the task's envs"), found
    found = refusals("run: x\nworkdir: /src/${WHO}/$WHERE\n")
    assert found["workdir"].startswith("$WHO, $WHERE is none of the task's envs"), found


@needs_skypilot
def test_skypilot_reads_spot_alternatives_and_an_empty_secret_as_tandem_does(tmp_path: Path) -> None:
    path = tmp_path / "task.yaml"
    path.write_text(
        "resources: {cpus: 4, any_of: [{use_spot: true}, {use_spot: false}]}\n"
        "secrets: {HF_TOKEN: ''}\nrun: x\n"
    )
    sky = skypilot_reads(ORACLE_SPOT, path)
    task = S.load_yaml(path).tasks[0]
    assert sorted(sky["use_spot"]) == [False, True] and task.resources.preemptible
    assert sky["secrets"] == {"HF_TOKEN": ""} == dict(task.envs)


ORACLE_SPOT = """
import json, sys
import sky
task = sky.Task.from_yaml(sys.argv[1])
print(json.dumps({
    "use_spot": [r.use_spot for r in task.resources],
    "secrets": {k: v.get_secret_value() for k, v in task.secrets.items()},
}))
"""

"""SkyPilot's task files in Tandem's parser: the same meaning for the keys Tandem honours, a reason for each it
refuses. SkyPilot itself is the oracle where it is installed (`make setup-skypilot`: its own venv, .venv-sky,
as its pins would downgrade .venv's uvicorn): its loader reads the same files, and its schema's keys are each
in SPEC.md's table and each get a reason here. Those tests skip without it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from tandem.scheduler.v1 import job_spec_pb2 as js

from mesh.errors import InvalidArgument, R
from services.scheduler import spec as S

ROOT = Path(__file__).resolve().parents[3]
SKY_PYTHON = Path(os.environ.get("TANDEM_SKYPILOT_PYTHON", ROOT / ".venv-sky" / "bin" / "python"))
needs_skypilot = pytest.mark.skipif(
    not SKY_PYTHON.exists(), reason="needs SkyPilot in .venv-sky (make setup-skypilot)"
)


def parse(text: str, **kwargs: Any) -> js.JobSpec:
    return S.parse_yaml(textwrap.dedent(text), **kwargs)


def refusals(text: str, **kwargs: Any) -> dict[str, str]:
    with pytest.raises(InvalidArgument) as caught:
        S.parse_yaml(textwrap.dedent(text), **kwargs)
    assert caught.value.reason == R.ERROR_REASON_INVALID_JOB_SPEC
    return {v.field: v.description for v in caught.value.violations}


# -- single-task files and names ----------------------------------------------------------------------------


def test_a_single_task_file_is_a_one_task_group() -> None:
    spec = parse(
        """
        name: train
        num_nodes: 2
        resources: {accelerators: A100:8}
        setup: pip list
        run: python train.py
        """
    )
    assert spec.display_name == "train"
    (task,) = spec.tasks
    assert (task.name, task.kind, task.num_nodes) == ("train", js.TaskSpec.KIND_COMMAND, 2)
    assert (task.setup, task.run) == ("pip list", "python train.py")
    assert S.resources_of(task).gpus == 8


def test_a_single_task_file_takes_the_jobs_own_keys_too() -> None:
    spec = parse("name: t\npriority: 7\nbackend: slurm\nslurm: {partition: gpu}\nrun: x\n")
    assert (spec.priority, spec.backend, spec.slurm.partition) == (7, js.BACKEND_SLURM, "gpu")


def test_default_names_follow_skypilots_rule() -> None:
    # One task: the file's name names the task, in the shape task names take; no name at all: "task".
    assert parse("name: My_Fine.Tune job\nrun: x\n").tasks[0].name == "my-fine-tune-job"
    assert parse("name: My_Fine.Tune job\nrun: x\n").display_name == "My_Fine.Tune job"
    nameless = parse("run: x\n")
    assert (nameless.display_name, nameless.tasks[0].name) == ("", "task")
    # Several: the unnamed ones are NAME-INDEX.
    group = parse("name: grp\ntasks:\n  - run: a\n  - name: named\n    run: b\n  - run: c\n")
    assert [t.name for t in group.tasks] == ["grp-0", "named", "grp-2"]
    assert [t.name for t in parse("tasks:\n  - run: a\n  - run: b\n").tasks] == ["task-0", "task-1"]


def test_refusals_in_a_single_task_file_name_its_top_level_keys() -> None:
    found = refusals("run: x\nresources: {memory: lots}\npriority: high\n")
    assert set(found) == {"resources.memory", "priority"}
    assert set(refusals("run: x\nnum_nodes: 99\n")) == {"num_nodes"}


# -- resources ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "gpus", "alternatives"),
    [
        ("A100:8", "A100:8", []),
        ("L4", "L4:1", []),
        ("{A100: 8}", "A100:8", []),
        ("{A100: 8.0}", "A100:8", []),
        ("[H100:8, A100-80GB:8, A100:8]", "H100:8", ["A100-80GB:8", "A100:8"]),
        ("{V100:4, A100:2}", "V100:4", ["A100:2"]),  # a set: kept in the order written
        ("'{V100:4, A100:2}'", "V100:4", ["A100:2"]),  # the same set, quoted
        ("{A100: 8, H100: 8}", "A100:8", ["H100:8"]),
    ],
)
def test_accelerators_in_every_skypilot_form(value: str, gpus: str, alternatives: list[str]) -> None:
    (task,) = parse(f"run: x\nresources:\n  accelerators: {value}\n").tasks
    assert task.resources.gpus == gpus
    assert list(task.resources.gpu_alternatives) == alternatives


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("tpu-v4-8", "TPU"),
        ("A100:0.5", "fractional"),
        ("A100:many", "TYPE:COUNT"),
        ("{A100: yes}", "number"),
        ("[8]", "string"),
        ("A100:2000", "1 to 1024"),
        ("'[]'", "GPU type"),
    ],
)
def test_accelerators_that_cannot_mean_anything_here(value: str, words: str) -> None:
    found = refusals(f"run: x\nresources:\n  accelerators: {value}\n")
    assert list(found) and all(f.startswith("resources.accelerators") for f in found), found
    assert words in " ".join(found.values())


def test_gpu_alternatives_sent_as_a_proto_are_checked() -> None:
    def fields(resources: dict[str, Any]) -> list[str]:
        spec = json_format.ParseDict(
            {"tasks": [{"name": "a", "kind": "KIND_COMMAND", "run": "x", "resources": resources}]},
            js.JobSpec(),
        )
        with pytest.raises(InvalidArgument) as caught:
            S.check_spec(spec)
        return [v.field for v in caught.value.violations]

    assert fields({"gpuAlternatives": ["A100:8"]}) == ["tasks[0].resources.gpus"]
    assert fields({"gpus": "H100:8", "gpuAlternatives": ["A100:8", "8", "A100:x"]}) == [
        "tasks[0].resources.gpu_alternatives[1]",
        "tasks[0].resources.gpu_alternatives[2]",
    ]
    assert fields({"gpus": "H100:8", "gpuAlternatives": ["A100:8"] * 9}) == [
        "tasks[0].resources.gpu_alternatives"
    ]
    ok = json_format.ParseDict(
        {
            "tasks": [
                {
                    "name": "a",
                    "kind": "KIND_COMMAND",
                    "run": "x",
                    "resources": {"gpus": "H100:8", "gpuAlternatives": ["A100:8"]},
                }
            ]
        },
        js.JobSpec(),
    )
    S.check_spec(ok)
    assert S.resources_of(ok.tasks[0]).gpu_type == "H100"  # placed on the first choice for now


def test_gpus_and_accelerators_together_are_refused() -> None:
    assert "resources.accelerators" in refusals("run: x\nresources: {gpus: 8, accelerators: A100:8}\n")


def test_at_least_amounts_are_the_request() -> None:
    (task,) = parse("run: x\nresources: {cpus: 4+, memory: 32+}\n").tasks
    assert (task.resources.cpus, task.resources.memory_gib) == (4.0, 32.0)
    (task,) = parse("run: x\nresources: {cpus: '0.5+', memory: 512Mi+}\n").tasks
    assert (task.resources.cpus, task.resources.memory_gib) == (0.5, 0.5)
    assert "resources.cpus" in refusals("run: x\nresources: {cpus: 4++}\n")


def test_cloud_and_infra_name_a_backend_or_are_refused() -> None:
    assert parse("run: x\nresources: {cloud: kubernetes}\n").backend == js.BACKEND_KUBERNETES
    assert parse("run: x\nresources: {infra: k8s}\n").backend == js.BACKEND_KUBERNETES
    assert parse("run: x\nresources: {infra: slurm}\n").backend == js.BACKEND_SLURM
    assert parse("run: x\nresources: {infra: '*'}\n").backend == js.BACKEND_UNSPECIFIED
    assert "public cloud" in refusals("run: x\nresources: {cloud: aws}\n")["resources.cloud"]
    assert "public cloud" in refusals("run: x\nresources: {infra: gcp/us-central1}\n")["resources.infra"]
    assert "local" in refusals("run: x\nresources: {infra: local/box}\n")["resources.infra"]
    clash = refusals("name: g\nbackend: slurm\ntasks:\n  - run: x\n    resources: {cloud: kubernetes}\n")
    assert "slurm" in clash["tasks[0].resources.cloud"]
    two = "tasks:\n  - run: x\n    resources: {cloud: k8s}\n  - run: y\n    resources: {cloud: slurm}\n"
    assert set(refusals(two)) == {"tasks[0].resources.cloud", "tasks[1].resources.cloud"}


# SkyPilot's infra strings for Slurm and Kubernetes, and what they name: (cloud, region, zone) as SkyPilot's
# InfraInfo reads them, and the job's backend options as Tandem does.
INFRA = {
    "slurm/tandemtest/debug": ("slurm", "tandemtest", "debug"),
    "slurm/tandemtest": ("slurm", "tandemtest", None),
    "slurm/*/gpu": ("slurm", None, "gpu"),
    "k8s/my-context": ("kubernetes", "my-context", None),
    "kubernetes/arn:aws:eks:us-east-1:1:cluster/rl": (
        "kubernetes",
        "arn:aws:eks:us-east-1:1:cluster/rl",
        None,
    ),
}
INFRA_ORACLE = """
import json, sys
from sky.utils import infra_utils
out = {}
for text in json.loads(sys.argv[1]):
    info = infra_utils.InfraInfo.from_str(text)
    out[text] = [info.cloud, info.region, info.zone]
print(json.dumps(out))
"""


def test_infra_names_a_slurm_cluster_and_partition_or_a_kubernetes_context() -> None:
    for text, (cloud, region, zone) in INFRA.items():
        spec = parse(f"run: x\nresources: {{infra: '{text}'}}\n")
        if cloud == "slurm":
            assert spec.backend == js.BACKEND_SLURM
            assert (spec.slurm.cluster, spec.slurm.partition) == (region or "", zone or ""), text
        else:
            assert spec.backend == js.BACKEND_KUBERNETES
            assert spec.kubernetes.context == region, text
    # The file's own `slurm:` block and the tasks' `infra:` must agree; so must a group's tasks.
    both = parse("run: x\nslurm: {partition: debug, qos: low}\nresources: {infra: slurm/c/debug}\n")
    assert (both.slurm.cluster, both.slurm.partition, both.slurm.qos) == ("c", "debug", "low")
    found = refusals("run: x\nslurm: {partition: a}\nresources: {infra: slurm/c/b}\n")
    assert found["resources.infra"] == "names the partition 'b', and the job's is 'a'"
    group = (
        "tasks:\n  - run: x\n    resources: {infra: k8s/one}\n  - run: y\n    resources: {infra: k8s/two}\n"
    )
    assert refusals(group) == {"tasks[1].resources.infra": "names the context 'two', and the job's is 'one'"}
    assert "Slurm's form" in refusals("run: x\nresources: {infra: slurm/a/b/c}\n")["resources.infra"]
    assert "empty part" in refusals("run: x\nresources: {infra: slurm//b}\n")["resources.infra"]
    assert "any cloud" in refusals("run: x\nresources: {infra: '*/us-east-1'}\n")["resources.infra"]
    context = parse("run: x\nbackend: kubernetes\nkubernetes: {context: ctx}\n").kubernetes.context
    assert context == "ctx"  # the file may say it in the block too


@needs_skypilot
def test_infra_strings_mean_what_skypilot_reads_in_them(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(SKY_PYTHON), "-c", INFRA_ORACLE, json.dumps(list(INFRA))],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env={**os.environ, "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    read = json.loads(done.stdout.strip().splitlines()[-1])
    assert {text: tuple(parts) for text, parts in read.items()} == INFRA


def test_a_resources_key_with_nothing_under_it_asks_nothing() -> None:
    (task,) = parse("run: x\nresources:\n").tasks
    assert S.resources_of(task).gpus == 0


# -- envs and secrets ---------------------------------------------------------------------------------------


def test_envs_without_a_value_must_be_given_at_submission() -> None:
    text = "name: g\ntasks:\n  - name: a\n    run: x\n    envs: {MODEL: m, TOKEN: null, SEED: }\n"
    found = refusals(text)
    assert set(found) == {'tasks[0].envs["TOKEN"]', 'tasks[0].envs["SEED"]'}
    assert "--env TOKEN=VALUE" in found['tasks[0].envs["TOKEN"]']
    spec = parse(text, envs={"TOKEN": "t", "SEED": "1"})
    assert dict(spec.tasks[0].envs) == {"MODEL": "m", "TOKEN": "t", "SEED": "1"}


def test_given_envs_reach_every_task_and_win_over_the_file() -> None:
    spec = parse(
        "name: g\ntasks:\n  - {name: a, run: x, envs: {MODEL: m}}\n  - {name: b, run: y}\n",
        envs={"MODEL": "big", "EXTRA": "1"},
    )
    assert [dict(t.envs) for t in spec.tasks] == [
        {"MODEL": "big", "EXTRA": "1"},
        {"MODEL": "big", "EXTRA": "1"},
    ]
    assert 'tasks[0].envs["TANDEM_JOB"]' in refusals(
        "tasks:\n  - {name: a, run: x}\n", envs={"TANDEM_JOB": "x"}
    )


def test_load_yaml_takes_the_submissions_envs(tmp_path: Path) -> None:
    path = tmp_path / "task.yaml"
    path.write_text("run: echo $WHO\nenvs:\n  WHO:\n")
    assert dict(S.load_yaml(path, envs={"WHO": "me"}).tasks[0].envs) == {"WHO": "me"}
    with pytest.raises(InvalidArgument) as caught:
        S.load_yaml(path)
    assert [v.field for v in caught.value.violations] == ['envs["WHO"]']


def test_secrets_as_skypilots_table_and_references() -> None:
    (task,) = parse("run: x\nsecrets:\n  HF_TOKEN: null\n  WANDB_API_KEY:\n").tasks
    assert [(b.secret, S.secret_env_name(b)) for b in task.secrets] == [
        ("hf-token", "HF_TOKEN"),
        ("wandb-api-key", "WANDB_API_KEY"),
    ]
    (task,) = parse("run: x\nsecrets: ['secrets:HF_TOKEN', openai-key]\n").tasks
    assert [(b.secret, S.secret_env_name(b)) for b in task.secrets] == [
        ("hf-token", "HF_TOKEN"),
        ("openai-key", "OPENAI_KEY"),
    ]
    # The table form and Tandem's list form are the same spec.
    assert parse("run: x\nsecrets: {HF_TOKEN: null}\n") == parse("run: x\nsecrets: [hf-token]\n")


def test_a_secrets_value_in_the_file_is_refused() -> None:
    found = refusals("run: x\nsecrets: {HF_TOKEN: hf_abc123, OK: null}\n")
    assert list(found) == ['secrets["HF_TOKEN"]']
    assert "vault" in found['secrets["HF_TOKEN"]'] and "hf_abc123" not in found['secrets["HF_TOKEN"]']
    assert 'secrets["bad name"]' in refusals("run: x\nsecrets: {bad name: null}\n")
    assert 'secrets["X1"]' not in refusals("run: x\nsecrets: {X1: null}\nenvs: {X1: v}\n")


# -- keys refused, each with its reason ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ("run: x\nresources: {instance_type: p4d.24xlarge}\n", "resources.instance_type", "instance type"),
        ("run: x\nresources: {region: us-east-1}\n", "resources.region", "public cloud"),
        ("run: x\nresources: {accelerator_args: {tpu_vm: true}}\n", "resources.accelerator_args", "TPU"),
        (
            "run: x\nresources: {any_of: [{accelerators: A100:8, cpus: 4}, {accelerators: H100:8}]}\n",
            "resources.any_of[1]",
            "differs from any_of[0] in cpus",
        ),
        ("run: x\nresources: {disk_tier: fastest}\n", "resources.disk_tier", "must be one of low, medium"),
        ("run: x\nresources: {local_disk: 'nvme:1'}\n", "resources.local_disk", "not offer on Kubernetes"),
        ("run: x\nvolumes: {/scratch: {size: 100Gi}}\n", 'volumes["/scratch"].size', "deployment's"),
        ("run: x\nservice: {readiness_probe: /, replicas: 2}\n", "service.readiness_probe", "SkyServe"),
        ("run: x\nservice: {port: 80, replicas: 2}\n", "service.replicas", "SkyServe"),
        ("run: x\nconfig: {gcp: {vpc_name: net}}\n", "config.gcp", "public cloud"),
        ("run: x\nresources: {image_id: ami-0123}\n", "resources.image_id", "machine image"),
        ("run: x\nfile_mounts: {/data: 'gs://bucket/data'}\n", 'file_mounts["/data"]', "opens S3 buckets"),
        (
            "run: x\nfile_mounts: {/data: {name: b, store: gcs}}\n",
            'file_mounts["/data"].store',
            "opens S3 buckets",
        ),
        ("run: x\nfile_mounts: {/data: /shared/$USER}\n", 'file_mounts["/data"]', "none of the task's envs"),
        (
            "run: x\nfile_mounts: {'/out/${RUN}': {volume: v}}\n",
            'file_mounts["/out/${RUN}"]',
            "none of the task's",
        ),
        ("run: x\nprimary_tasks: [task]\n", "primary_tasks", "one-task file"),
    ],
)
def test_skypilot_keys_that_mean_nothing_here_say_why(text: str, field: str, words: str) -> None:
    found = refusals(text)
    assert field in found, found
    assert words in found[field]


def test_skypilots_group_header_keys_set_roles_and_delays() -> None:
    header = "name: g\nexecution: parallel\nprimary_tasks: [train]\n"
    tasks = "---\nname: train\nrun: t\n---\nname: env\nrun: e\n---\nname: eval\nrun: v\n"
    spec = parse(header + "termination_delay: {default: 30s, eval: 2m}\n" + tasks)
    roles = {t.name: (t.role, t.termination_delay.seconds) for t in spec.tasks}
    assert roles == {
        "train": (js.TaskSpec.ROLE_PRIMARY, 0),
        "env": (js.TaskSpec.ROLE_AUXILIARY, 30),
        "eval": (js.TaskSpec.ROLE_AUXILIARY, 120),
    }
    assert parse(header + "termination_delay: 45\n" + tasks).tasks[1].termination_delay.seconds == 45
    everyone = parse("name: g\nexecution: parallel\nprimary_tasks: []\n" + tasks)
    assert {t.role for t in everyone.tasks} == {js.TaskSpec.ROLE_UNSPECIFIED}  # all primary
    found = refusals(
        "name: g\nprimary_tasks: [nope]\ntermination_delay: {other: 1m}\ntasks:\n"
        "  - {name: a, run: x, role: auxiliary}\n  - {name: b, run: y, role: primary}\n"
    )
    assert {"primary_tasks[0]", 'termination_delay["other"]', "tasks[1].role"} <= set(found)


def test_a_typo_names_the_nearest_key() -> None:
    assert "did you mean resources?" in refusals("run: x\nresouces: {cpus: 2}\n")["resouces"]
    assert (
        "did you mean accelerators?"
        in refusals("run: x\nresources: {acelerators: A100}\n")["resources.acelerators"]
    )
    assert "did you mean run?" in refusals("name: g\ntasks:\n  - name: a\n    rn: x\n")["tasks[0].rn"]


def test_a_pipeline_is_a_serial_group_without_auxiliaries() -> None:
    assert parse("run: a\n---\nrun: b\n").execution == js.JobSpec.EXECUTION_SERIAL
    assert parse("name: g\n---\nname: a\nrun: a\n").execution == js.JobSpec.EXECUTION_SERIAL
    assert (
        parse("name: g\nexecution: parallel\n---\nname: a\nrun: a\n").execution
        == js.JobSpec.EXECUTION_PARALLEL
    )
    found = refusals(
        "name: g\nexecution: serial\ntasks:\n  - {name: a, run: x}\n  - {name: b, run: y, role: auxiliary}\n"
    )
    assert "no auxiliary tasks" in found["tasks[1].role"]
    assert "serial" in refusals("name: g\nexecution: sideways\n---\nname: a\nrun: a\n")["execution"]


# -- SkyPilot as the oracle ---------------------------------------------------------------------------------

# Task files of our own in SkyPilot's vocabulary, each with the envs given at submission.
SKY_FILES: dict[str, tuple[str, dict[str, str]]] = {
    "bare.yaml": (
        """\
        resources:
          accelerators: A100:8
          cpus: 16+
          memory: 64+
        setup: pip install -r requirements.txt
        run: python train.py --epochs 3
        """,
        {},
    ),
    "finetune.yaml": (
        """\
        name: finetune_llm
        num_nodes: 2
        resources:
          accelerators: [H100:8, A100-80GB:8]
        envs:
          MODEL_ID: some-org/some-model
          WANDB_PROJECT: null
        secrets:
          HF_TOKEN: null
        run: |
          torchrun --nnodes=$SKYPILOT_NUM_NODES --node_rank=$SKYPILOT_NODE_RANK train.py --model $MODEL_ID
        """,
        {"WANDB_PROJECT": "demo"},
    ),
    "serve-small.yaml": (
        """\
        name: small-eval
        resources:
          accelerators: {L4: 1}
          cpus: 4
          memory: 24Gi
        envs:
          BATCH: 16
        run: python eval.py --batch $BATCH
        """,
        {},
    ),
    "any-gpu.yaml": (
        """\
        resources:
          accelerators: {V100:1, T4:1}
        run: nvidia-smi
        """,
        {},
    ),
    "group.yaml": (
        """\
        name: rl_group
        execution: parallel
        primary_tasks: [trainer]
        termination_delay: 1m
        ---
        name: trainer
        resources:
          accelerators: H100:4
        run: python trainer.py
        ---
        name: rollout-env
        resources:
          cpus: 8+
        envs:
          PORT: 8000
        run: python env_server.py --port $PORT
        """,
        {},
    ),
    "pipeline.yaml": (
        """\
        name: prep_train_eval
        ---
        name: prepare
        run: python prepare.py
        ---
        name: train
        resources:
          accelerators: A100:8
        run: python train.py
        ---
        name: evaluate
        run: python eval.py
        """,
        {},
    ),
    "pipeline-headerless.yaml": (
        """\
        run: python prepare.py
        ---
        resources:
          accelerators: L4:1
        run: python train.py
        """,
        {},
    ),
    "pipeline-serial.yaml": (
        """\
        name: steps
        execution: serial
        ---
        name: first
        run: echo one
        ---
        name: second
        run: echo two
        """,
        {},
    ),
}

# Runs in .venv-sky: SkyPilot's own loader on each file, what it made of it as JSON.
ORACLE = """
import json, sys
from sky.utils import dag_utils
out = {}
for path, envs in json.loads(sys.argv[1]).items():
    dag = dag_utils.load_dag_from_yaml(path, env_overrides=list(envs.items()) or None)
    tasks = []
    for task in dag.tasks:
        resources = task.resources if isinstance(task.resources, list) else list(task.resources)
        tasks.append({
            "name": task.name,
            "run": task.run,
            "setup": task.setup,
            "num_nodes": task.num_nodes,
            "envs": dict(task.envs),
            "secrets": sorted(ref.name for ref in task._managed_secret_refs),
            "accelerators": [r.accelerators for r in resources if r.accelerators],
            "ordered": isinstance(task.resources, list),
            "cpus": [r.cpus for r in resources],
            "memory": [r.memory for r in resources],
            "images": sorted({str(v) for r in resources if r.image_id for v in r.image_id.values()}),
        })
    primary = getattr(dag, "primary_tasks", None)
    execution = dag.execution.value if dag.execution is not None else None
    out[path] = {"name": dag.name, "tasks": tasks, "primary": primary, "execution": execution}
print(json.dumps(out))
"""


def skypilot(paths: dict[Path, dict[str, str]]) -> dict[str, Any]:
    done = subprocess.run(
        [str(SKY_PYTHON), "-c", ORACLE, json.dumps({str(p): e for p, e in paths.items()})],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env={**os.environ, "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "HOME": str(next(iter(paths)).parent)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def amount(value: str | None) -> float:
    return float(str(value).rstrip("+")) if value is not None else 0.0


@needs_skypilot
def test_skypilot_and_tandem_read_the_same_files_alike(tmp_path: Path) -> None:
    paths: dict[Path, dict[str, str]] = {}
    for name, (text, envs) in SKY_FILES.items():
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        paths[path] = envs
    examples = {  # the examples SkyPilot users would write, with the values `--env` gives them
        "sky-torchrun.yaml": {"MASTER_PORT": "29500"},
        "sky-two-node.yaml": {"MASTER_PORT": "29500"},
        "sky-bucket-dataset.yaml": {},
        "sky-train-eval-group.yaml": {},
        "sky-rl-group.yaml": {"ROLLOUT_PORT": "8100"},
        "sky-docker-image.yaml": {},
    }
    for example, example_envs in examples.items():
        paths[ROOT / "examples" / "jobs" / example] = example_envs
    theirs = skypilot(paths)
    for path, envs in paths.items():
        sky, spec = theirs[str(path)], S.load_yaml(path, envs=envs)
        assert len(spec.tasks) == len(sky["tasks"]), path.name
        if sky["name"] is not None:
            assert spec.display_name == sky["name"], path.name
        if len(sky["tasks"]) > 1:  # SkyPilot's pipelines (serial) and job groups (parallel)
            assert js.JobSpec.Execution.Name(spec.execution) == f"EXECUTION_{sky['execution'].upper()}", (
                path.name
            )
        if sky["primary"]:
            primary = {t.name for t in spec.tasks if t.role != js.TaskSpec.ROLE_AUXILIARY}
            assert primary == set(sky["primary"]), path.name
        for task, want in zip(spec.tasks, sky["tasks"], strict=True):
            where = f"{path.name}: {task.name}"
            if want["name"] is not None:
                assert task.name == S.default_task_name(want["name"]), where
            assert (task.run or None, task.setup or None) == (want["run"], want["setup"]), where
            assert max(task.num_nodes, 1) == want["num_nodes"], where
            assert dict(task.envs) == want["envs"], where
            assert sorted(S.secret_env_name(b) for b in task.secrets) == want["secrets"], where
            requests = [task.resources.gpus, *task.resources.gpu_alternatives] if task.resources.gpus else []
            ours = [{t: c} for c, t in map(S.parse_gpus, requests)]
            if want["ordered"]:
                assert ours == want["accelerators"], where
            else:  # a set: SkyPilot's optimizer picks among them; Tandem keeps the order written
                assert sorted(map(str, ours)) == sorted(map(str, want["accelerators"])), where
            assert {amount(c) for c in want["cpus"]} == {task.resources.cpus}, where
            assert {amount(m) for m in want["memory"]} == {task.resources.memory_gib}, where
            assert want["images"] == ([f"docker:{task.resources.image}"] if task.resources.image else []), (
                where
            )


SCHEMA = """
import json
from sky.utils import schemas
print(json.dumps({
    "task": sorted(schemas.get_task_schema()["properties"]),
    "resources": sorted(schemas.get_resources_schema()["properties"]),
}))
"""


@pytest.fixture(scope="module")
def skypilot_schema(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    home = tmp_path_factory.mktemp("sky-home")  # SkyPilot keeps its state under ~/.sky
    done = subprocess.run(
        [str(SKY_PYTHON), "-c", SCHEMA],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env={**os.environ, "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "HOME": str(home)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    schema: dict[str, list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return schema


@needs_skypilot
def test_every_skypilot_key_is_honoured_or_refused_with_a_reason(
    skypilot_schema: dict[str, list[str]],
) -> None:
    for key in skypilot_schema["task"]:
        if key in S._TASK_KEYS:
            continue
        found = refusals(f"run: x\n{key}: 1\n")
        assert "is not a known key" not in found.get(key, ""), key
    for key in skypilot_schema["resources"]:
        if key in S._RESOURCE_KEYS:
            continue
        found = refusals(f"run: x\nresources:\n  {key}: 1\n")
        assert not found.get(f"resources.{key}", "").startswith("is not a known key"), key
        assert f"resources.{key}" in found, key


@needs_skypilot
def test_spec_md_has_a_row_for_every_skypilot_key(skypilot_schema: dict[str, list[str]]) -> None:
    text = (ROOT / "services" / "scheduler" / "SPEC.md").read_text()
    section = text.split("## SkyPilot's keys", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `([a-z_.]+)`", section, flags=re.MULTILINE))
    missing = [k for k in skypilot_schema["task"] if k not in rows]
    missing += [f"resources.{k}" for k in skypilot_schema["resources"] if f"resources.{k}" not in rows]
    assert not missing, missing

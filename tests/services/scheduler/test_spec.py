"""The job spec: YAML and proto paths, every refusal naming its field, the placement and fit checks."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from tandem.scheduler.v1 import job_spec_pb2 as js

from mesh.errors import FailedPrecondition, InvalidArgument, R
from services.scheduler import spec as S
from services.scheduler.backends.base import NodeInventory, Resources

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples" / "jobs").glob("*.yaml"))
DEMO_TOML = (ROOT / "examples" / "jobs" / "demo.toml").read_text()

H100_NODES = [
    NodeInventory(
        f"gpu-{i}", f"10.0.0.{i}", gpus=8, gpu_type="NVIDIA-H100-80GB-HBM3", cpus=96, memory_gib=1024
    )
    for i in range(2)
] + [NodeInventory("cpu-0", "10.0.1.0", cpus=32, memory_gib=128)]


def yaml_fields(text: str, **kwargs: Any) -> list[str]:
    with pytest.raises(InvalidArgument) as caught:
        S.parse_yaml(textwrap.dedent(text), **kwargs)
    assert caught.value.reason == R.ERROR_REASON_INVALID_JOB_SPEC
    assert caught.value.violations, caught.value.message
    return [v.field for v in caught.value.violations]


def proto_fields(document: dict[str, Any]) -> list[str]:
    spec = json_format.ParseDict(document, js.JobSpec())
    with pytest.raises(InvalidArgument) as caught:
        S.check_spec(spec)
    assert caught.value.reason == R.ERROR_REASON_INVALID_JOB_SPEC
    return [v.field for v in caught.value.violations]


def group(tasks: str, header: str = "name: g") -> str:
    return textwrap.dedent(header) + "\ntasks:\n" + textwrap.indent(textwrap.dedent(tasks), "  ")


ECHO = "- name: main\n  run: echo hi\n"


# -- the examples -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_parses_validates_and_fits(path: Path) -> None:
    spec = S.load_yaml(path)
    S.check_spec(spec)  # the proto path accepts what the YAML path built
    S.check_placement(spec)
    S.check_fits(spec, H100_NODES)
    again = js.JobSpec.FromString(spec.SerializeToString())
    S.check_spec(again)
    assert again == spec


def test_three_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {
        "rl-with-eval-watcher.yaml",
        "torchrun-multinode.yaml",
        "managed-taskapp-rl.yaml",
    }


def test_the_eval_watcher_example_maps_onto_the_contract() -> None:
    spec = S.load_yaml(ROOT / "examples" / "jobs" / "rl-with-eval-watcher.yaml")
    trainer, watcher = spec.tasks
    assert spec.display_name == "rl-with-eval-watcher"
    assert spec.execution == js.JobSpec.EXECUTION_PARALLEL
    assert spec.recovery.max_backoff.seconds == 300 and spec.recovery.scope == js.RecoveryPolicy.SCOPE_GROUP
    assert trainer.kind == js.TaskSpec.KIND_ONLINE_RL and trainer.role == js.TaskSpec.ROLE_PRIMARY
    assert trainer.online_rl.config_toml == DEMO_TOML
    assert S.trainer_config(trainer) is not None
    assert watcher.kind == js.TaskSpec.KIND_COMMAND  # inferred: no options block
    assert watcher.role == js.TaskSpec.ROLE_AUXILIARY and watcher.termination_delay.seconds == 120
    assert watcher.envs["WATCH_INTERVAL"] == "10"
    assert [(m.path, m.volume, m.read_only) for m in watcher.file_mounts] == [
        ("/ckpt", "rl-checkpoints", True)
    ]
    assert S.resources_of(watcher) == Resources(cpus=0.5, memory_gib=1.0)  # the group fits two cores


def test_the_managed_task_app_example_injects_the_key_and_registers() -> None:
    spec = S.load_yaml(ROOT / "examples" / "jobs" / "managed-taskapp-rl.yaml")
    app, trainer = spec.tasks
    assert app.kind == js.TaskSpec.KIND_SERVICE
    assert S.secret_env_name(app.secrets[0]) == "ENVIRONMENT_API_KEY"
    assert app.service.register_task_app.app_id == "math-word"
    assert S.secret_names(spec) == ["math-app-key"]
    assert S.resources_of(trainer) == Resources(gpus=8, gpu_type="H100", cpus=32, memory_gib=256)
    config = S.trainer_config(trainer)
    assert config is not None and config.task_app.name.endswith("/taskApps/math-word")


def test_skypilot_multi_document_form_equals_the_tasks_list() -> None:
    listed = S.parse_yaml(
        "name: g\nexecution: parallel\ntasks:\n  - name: a\n    run: a\n  - name: b\n    run: b\n"
    )
    documents = S.parse_yaml("name: g\nexecution: parallel\n---\nname: a\nrun: a\n---\nname: b\nrun: b\n")
    assert listed == documents


def test_units_and_short_forms() -> None:
    spec = S.parse_yaml(
        group(
            """
            - name: main
              run: echo
              termination_delay: 1m30s
              role: auxiliary
              resources: {gpus: 4, cpus: "2.5", memory: 32GB}
              secrets: [openai-key, {secret: hf-token, env: HUGGING_FACE_HUB_TOKEN}]
              file_mounts:
                /data: /shared/data
                /src: {source: /home/me/src, read_only: true}
            - name: other
              run: echo
              resources: {memory: 512Mi}
            """
        )
    )
    main, other = spec.tasks
    assert main.termination_delay.seconds == 90
    assert S.resources_of(main) == Resources(gpus=4, cpus=2.5, memory_gib=32e9 / 2**30)
    assert other.resources.memory_gib == 0.5
    assert [S.secret_env_name(b) for b in main.secrets] == ["OPENAI_KEY", "HUGGING_FACE_HUB_TOKEN"]
    assert [(m.path, m.local_path, m.read_only) for m in main.file_mounts] == [
        ("/data", "/shared/data", False),
        ("/src", "/home/me/src", True),
    ]


# -- refusals, each naming its field ------------------------------------------------------------------------

REFUSED = {
    "unknown top-level key": ("nmae: g\n" + "tasks:\n  " + ECHO.replace("\n", "\n  "), "nmae"),
    "unknown task key": (group("- name: main\n  run: x\n  accelerators: H100:8\n"), "tasks[0].accelerators"),
    "wrong type": (group(ECHO, "name: g\npriority: high"), "priority"),
    "bad priority": (group(ECHO, "name: g\npriority: 2000"), "priority"),
    "bool is not an integer": (group(ECHO, "name: g\npriority: true"), "priority"),
    "execution": (group(ECHO, "name: g\nexecution: sideways"), "execution"),
    "duplicate task names": (group(ECHO + ECHO), "tasks[1].name"),
    "no primary task": (group("- name: main\n  run: x\n  role: auxiliary\n"), "tasks"),
    "no tasks": ("name: g\ntasks: []\n", "tasks"),
    "task name pattern": (group("- name: Main Task\n  run: x\n"), "tasks[0].name"),
    "unknown kind": (group("- name: main\n  kind: batch\n  run: x\n"), "tasks[0].kind"),
    "options of another kind": (
        group("- name: main\n  kind: command\n  run: x\n  service: {port: 80}\n"),
        "tasks[0].service",
    ),
    "service without its options": (group("- name: main\n  kind: service\n  run: x\n"), "tasks[0].service"),
    "service without port": (
        group("- name: main\n  run: x\n  service: {health_path: /h}\n"),
        "tasks[0].service.port",
    ),
    "service port range": (
        group("- name: main\n  run: x\n  service: {port: 70000}\n"),
        "tasks[0].service.port",
    ),
    "options of another backend": (group(ECHO, "name: g\nbackend: local\nslurm: {partition: gpu}"), "slurm"),
    "backend options without backend": (group(ECHO, "name: g\nkubernetes: {namespace: ml}"), "kubernetes"),
    "unknown backend": (group(ECHO, "name: g\nbackend: aws"), "backend"),
    "max_backoff below initial_backoff": (
        group(ECHO, "name: g\nrecovery: {initial_backoff: 5m, max_backoff: 10s}"),
        "recovery.max_backoff",
    ),
    "max_backoff below the default initial": (
        group(ECHO, "name: g\nrecovery: {max_backoff: 5s}"),
        "recovery.max_backoff",
    ),
    "backoff over an hour": (
        group(ECHO, "name: g\nrecovery: {initial_backoff: 2h}"),
        "recovery.initial_backoff",
    ),
    "malformed duration": (
        group(ECHO, "name: g\nrecovery: {initial_backoff: 10 parsecs}"),
        "recovery.initial_backoff",
    ),
    "exit code range": (
        group(ECHO, "name: g\nrecovery: {recover_on_exit_codes: [1, 300]}"),
        "recovery.recover_on_exit_codes[1]",
    ),
    "restarts range": (
        group(ECHO, "name: g\nrecovery: {max_restarts_on_errors: 101}"),
        "recovery.max_restarts_on_errors",
    ),
    "malformed GPU request": (
        group(ECHO + "- name: big\n  run: x\n  resources: {gpus: 'H100:eight'}\n"),
        "tasks[1].resources.gpus",
    ),
    "GPU type without count": (
        group("- name: main\n  run: x\n  resources: {gpus: H100}\n"),
        "tasks[0].resources.gpus",
    ),
    "zero GPUs": (group("- name: main\n  run: x\n  resources: {gpus: 0}\n"), "tasks[0].resources.gpus"),
    "GPU list": (group("- name: main\n  run: x\n  resources: {gpus: [8]}\n"), "tasks[0].resources.gpus"),
    "memory unit": (
        group("- name: main\n  run: x\n  resources: {memory: 32 bananas}\n"),
        "tasks[0].resources.memory",
    ),
    "negative memory": (
        group("- name: main\n  run: x\n  resources: {memory: -1}\n"),
        "tasks[0].resources.memory",
    ),
    "negative cpus": (group("- name: main\n  run: x\n  resources: {cpus: -2}\n"), "tasks[0].resources.cpus"),
    "num_nodes range": (group("- name: main\n  run: x\n  num_nodes: 65\n"), "tasks[0].num_nodes"),
    "relative mount path": (
        group("- name: main\n  run: x\n  file_mounts: {ckpt: {volume: ckpt}}\n"),
        'tasks[0].file_mounts["ckpt"]',
    ),
    "relative local path": (
        group("- name: main\n  run: x\n  file_mounts: {/ckpt: ./ckpt}\n"),
        'tasks[0].file_mounts["/ckpt"]',
    ),
    "mount with two sources": (
        group("- name: main\n  run: x\n  file_mounts: {/c: {volume: v, source: /s}}\n"),
        'tasks[0].file_mounts["/c"]',
    ),
    "volume name pattern": (
        group("- name: main\n  run: x\n  file_mounts: {/c: {volume: My_Vol}}\n"),
        'tasks[0].file_mounts["/c"].volume',
    ),
    "reserved env": (
        group("- name: main\n  run: x\n  envs: {TANDEM_JOB: x}\n"),
        'tasks[0].envs["TANDEM_JOB"]',
    ),
    "SkyPilot alias env": (
        group("- name: main\n  run: x\n  envs: {SKYPILOT_NODE_RANK: 0}\n"),
        'tasks[0].envs["SKYPILOT_NODE_RANK"]',
    ),
    "env name": (group("- name: main\n  run: x\n  envs: {1BAD: x}\n"), 'tasks[0].envs["1BAD"]'),
    "env without value": (group("- name: main\n  run: x\n  envs: {TOKEN: }\n"), 'tasks[0].envs["TOKEN"]'),
    "secret name": (group("- name: main\n  run: x\n  secrets: [Bad_Name]\n"), "tasks[0].secrets[0]"),
    "secret env clash": (
        group("- name: main\n  run: x\n  envs: {OPENAI_KEY: x}\n  secrets: [openai-key]\n"),
        "tasks[0].secrets[0].env",
    ),
    "secret into a reserved name": (
        group("- name: main\n  run: x\n  secrets: [{secret: k, env: TANDEM_JOB_TOKEN}]\n"),
        "tasks[0].secrets[0].env",
    ),
    "termination delay on a primary": (
        group("- name: main\n  run: x\n  termination_delay: 10s\n"),
        "tasks[0].termination_delay",
    ),
    "termination delay over an hour": (
        group(ECHO + "- name: aux\n  run: x\n  role: auxiliary\n  termination_delay: 61m\n"),
        "tasks[1].termination_delay",
    ),
    "online_rl without a config": (group("- name: rl\n  online_rl: {}\n"), "tasks[0].online_rl.config"),
    "online_rl on two nodes": (
        group("- name: rl\n  num_nodes: 2\n  online_rl: {config_path: /cfg/job.toml}\n"),
        "tasks[0].num_nodes",
    ),
    "relative config_path": (
        group("- name: rl\n  online_rl: {config_path: job.toml}\n"),
        "tasks[0].online_rl.config_path",
    ),
    "two configs": (
        group("- name: rl\n  online_rl: {config: x, config_path: /c.toml}\n"),
        "tasks[0].online_rl",
    ),
    "config_file from a string": (
        group("- name: rl\n  online_rl: {config_file: demo.toml}\n"),
        "tasks[0].online_rl.config_file",
    ),
    "registered app's key not injected": (
        group(
            "- name: app\n  run: x\n  service: {port: 80, register_task_app: {app_id: a, api_key_secret: k}}\n"
        ),
        "tasks[0].service.register_task_app.api_key_secret",
    ),
    "duplicate YAML key": (group(ECHO, "name: g\nname: h"), "(yaml)"),
    "not YAML": ("name: [unclosed\n", "(yaml)"),
    "not a table": ("- just\n- a list\n", "(document)"),
    "display name length": (group(ECHO, "name: " + "x" * 129), "name"),
    "node selector label": (
        group(ECHO, "name: g\nbackend: kubernetes\nkubernetes: {node_selector: {'bad key!': x}}"),
        'kubernetes.node_selector["bad key!"]',
    ),
}


@pytest.mark.parametrize(("text", "field"), list(REFUSED.values()), ids=list(REFUSED))
def test_refusals_name_the_field(text: str, field: str) -> None:
    assert field in yaml_fields(text)


def test_inline_trainer_config_errors_name_the_config_field() -> None:
    config = DEMO_TOML.replace("steps = 80", "steps = 0").replace("steps = 60", "steps = 0")
    text = group("- name: rl\n  online_rl:\n    config: |\n" + textwrap.indent(config, "      "))
    assert "tasks[0].online_rl.config.algorithm.steps" in yaml_fields(text)
    garbled = group("- name: rl\n  online_rl:\n    config: 'steps = = 1'\n")
    assert yaml_fields(garbled) == ["tasks[0].online_rl.config"]
    unknown = group("- name: rl\n  online_rl:\n    config: 'no_such_key = 1'\n")
    assert yaml_fields(unknown) == ["tasks[0].online_rl.config.no_such_key"]  # the key, as the file spells it


def test_config_file_is_read_beside_the_job_file(tmp_path: Path) -> None:
    (tmp_path / "job.toml").write_text(DEMO_TOML)
    (tmp_path / "job.yaml").write_text(group("- name: rl\n  online_rl: {config_file: job.toml}\n"))
    assert S.load_yaml(tmp_path / "job.yaml").tasks[0].online_rl.config_toml == DEMO_TOML
    (tmp_path / "bad.yaml").write_text(group("- name: rl\n  online_rl: {config_file: missing.toml}\n"))
    with pytest.raises(InvalidArgument) as caught:
        S.load_yaml(tmp_path / "bad.yaml")
    assert [v.field for v in caught.value.violations] == ["tasks[0].online_rl.config_file"]


def test_every_problem_is_reported_at_once() -> None:
    text = group(
        "- name: a\n  run: x\n  resources: {gpus: 'x:y'}\n- name: a\n  run: x\n", "name: g\npriority: 5000"
    )
    assert set(yaml_fields(text)) == {"priority", "tasks[0].resources.gpus", "tasks[1].name"}


# -- YAML and proto agree -----------------------------------------------------------------------------------

TASK = {"name": "main", "kind": "KIND_COMMAND", "run": "echo"}
AGREE = {
    "duplicate names": (group(ECHO + ECHO), {"tasks": [TASK, TASK]}, "tasks[1].name", "tasks[1].name"),
    "backoff": (
        group(ECHO, "name: g\nrecovery: {initial_backoff: 60s, max_backoff: 30s}"),
        {"recovery": {"initialBackoff": "60s", "maxBackoff": "30s"}, "tasks": [TASK]},
        "recovery.max_backoff",
        "recovery.max_backoff",
    ),
    "gpus": (
        group("- name: main\n  run: echo\n  resources: {gpus: 'H100:x'}\n"),
        {"tasks": [{**TASK, "resources": {"gpus": "H100:x"}}]},
        "tasks[0].resources.gpus",
        "tasks[0].resources.gpus",
    ),
    "memory": (
        group("- name: main\n  run: echo\n  resources: {memory: -4}\n"),
        {"tasks": [{**TASK, "resources": {"memoryGib": -4}}]},
        "tasks[0].resources.memory",
        "tasks[0].resources.memory_gib",
    ),
    "mount path": (
        group("- name: main\n  run: echo\n  file_mounts: {ckpt: {volume: v}}\n"),
        {"tasks": [{**TASK, "fileMounts": [{"path": "ckpt", "volume": "v"}]}]},
        'tasks[0].file_mounts["ckpt"]',
        "tasks[0].file_mounts[0].path",
    ),
    "display name": (
        group(ECHO, "name: " + "x" * 200),
        {"displayName": "x" * 200, "tasks": [TASK]},
        "name",
        "display_name",
    ),
    "no primary": (
        group("- name: main\n  run: echo\n  role: auxiliary\n"),
        {"tasks": [{**TASK, "role": "ROLE_AUXILIARY"}]},
        "tasks",
        "tasks",
    ),
    "kind options": (
        group("- name: main\n  kind: online_rl\n  run: echo\n"),
        {"tasks": [{**TASK, "kind": "KIND_ONLINE_RL"}]},
        "tasks[0].online_rl",
        "tasks[0].online_rl",
    ),
    "options backend": (
        group(ECHO, "name: g\nbackend: slurm\nkubernetes: {namespace: ml}"),
        {"backend": "BACKEND_SLURM", "kubernetes": {"namespace": "ml"}, "tasks": [TASK]},
        "kubernetes",
        "kubernetes",
    ),
}


@pytest.mark.parametrize(("text", "document", "in_yaml", "in_proto"), list(AGREE.values()), ids=list(AGREE))
def test_yaml_and_proto_refuse_the_same_field(
    text: str, document: dict[str, Any], in_yaml: str, in_proto: str
) -> None:
    assert yaml_fields(text) == [in_yaml]
    assert proto_fields(document) == [in_proto]


def test_proto_rules_the_interceptor_also_checks_are_in_check_spec() -> None:
    assert "tasks" in proto_fields({})  # required
    assert "tasks[0].kind" in proto_fields({"tasks": [{"name": "main", "run": "x"}]})  # KIND_UNSPECIFIED
    assert "priority" in proto_fields({"priority": -1001, "tasks": [TASK]})


def test_proto_only_shapes() -> None:
    mount = {"tasks": [{**TASK, "fileMounts": [{"path": "/a"}]}]}
    assert proto_fields(mount) == ["tasks[0].file_mounts[0].source"]
    twice = {
        "tasks": [{**TASK, "fileMounts": [{"path": "/a", "volume": "v"}, {"path": "/a/", "volume": "w"}]}]
    }
    assert proto_fields(twice) == ["tasks[0].file_mounts[1].path"]
    nan = {"tasks": [{**TASK, "resources": {"cpus": "NaN"}}]}
    assert proto_fields(nan) == ["tasks[0].resources.cpus"]
    bad_duration = {"maxDuration": "0s", "tasks": [TASK]}
    assert proto_fields(bad_duration) == ["max_duration"]


# -- placement ----------------------------------------------------------------------------------------------


def rl_task(placement: str, gpus: str = "H100:8", config: str = DEMO_TOML) -> str:
    return group(
        f"- name: rl\n  resources: {{gpus: '{gpus}'}}\n  online_rl:\n    placement: {placement}\n"
        "    config: |\n" + textwrap.indent(config, "      ")
    )


@pytest.mark.parametrize(
    ("placement", "config", "field"),
    [
        ("{inference_gpus: 8}", DEMO_TOML, "tasks[0].online_rl.placement.inference_gpus"),
        (
            "{inference_gpus: 6, tensor_parallel_size: 4}",
            DEMO_TOML,
            "tasks[0].online_rl.placement.tensor_parallel_size",
        ),
        (
            "{reference_placement: none}",
            DEMO_TOML.replace("[algorithm]", "[algorithm]\nkl_coef = 0.1"),
            "tasks[0].online_rl.placement.reference_placement",
        ),
        (
            "{}",
            DEMO_TOML + "\n[topology]\ncpu_trainer_ranks = 2\n",
            "tasks[0].online_rl.config_toml.topology.cpu_trainer_ranks",
        ),
        ("{tensor_parallel_size: 16}", DEMO_TOML, "tasks[0].online_rl.placement"),
    ],
)
def test_impossible_placements_are_refused(placement: str, config: str, field: str) -> None:
    spec = S.parse_yaml(rl_task(placement, config=config))
    with pytest.raises(FailedPrecondition) as caught:
        S.check_placement(spec)
    assert caught.value.reason == R.ERROR_REASON_PLACEMENT_INVALID
    assert [v.field for v in caught.value.violations] == [field]


def test_possible_placements_pass() -> None:
    S.check_placement(
        S.parse_yaml(rl_task("{inference_gpus: 6, tensor_parallel_size: 2, reference_placement: own}"))
    )
    S.check_placement(S.parse_yaml(rl_task("{}", gpus="")))  # the CPU plan
    path_only = group("- name: rl\n  resources: {gpus: 8}\n  online_rl: {config_path: /c/job.toml}\n")
    S.check_placement(S.parse_yaml(path_only))


def test_a_job_that_states_its_model_size_is_checked_against_its_gpus_memory() -> None:
    sized = DEMO_TOML + "\n[topology]\nmodel_parameters = 8030261248\ngpu_memory_gb = 80\n"
    ddp = S.parse_yaml(rl_task("{inference_gpus: 6}", config=sized))
    with pytest.raises(FailedPrecondition) as caught:
        S.check_placement(ddp)
    assert caught.value.reason == R.ERROR_REASON_PLACEMENT_INVALID
    assert [v.field for v in caught.value.violations] == ["tasks[0].online_rl.placement"]
    assert "128.5 GB on each training GPU" in caught.value.violations[0].description
    S.check_placement(
        S.parse_yaml(rl_task("{inference_gpus: 6}", config=sized + 'sharding = "SHARDING_FSDP"\n'))
    )


# -- fitting the nodes --------------------------------------------------------------------------------------


def fit_fields(tasks: str, nodes: list[NodeInventory] = H100_NODES) -> list[str]:
    spec = S.parse_yaml(group(tasks))
    with pytest.raises(FailedPrecondition) as caught:
        S.check_fits(spec, nodes)
    assert caught.value.reason == R.ERROR_REASON_RESOURCES_UNSATISFIABLE
    return [v.field for v in caught.value.violations]


@pytest.mark.parametrize(
    ("tasks", "field"),
    [
        ("- name: a\n  run: x\n  resources: {gpus: 16}\n", "tasks[0].resources.gpus"),
        ("- name: a\n  run: x\n  resources: {gpus: 'A100:1'}\n", "tasks[0].resources.gpus"),
        ("- name: a\n  run: x\n  num_nodes: 3\n  resources: {gpus: 'H100:8'}\n", "tasks[0].num_nodes"),
        ("- name: a\n  run: x\n  resources: {cpus: 200}\n", "tasks[0].resources.cpus"),
        ("- name: a\n  run: x\n  resources: {memory: 2Ti}\n", "tasks[0].resources.memory_gib"),
        ("- name: a\n  run: x\n  num_nodes: 3\n  resources: {cpus: 64}\n", "tasks[0].num_nodes"),
        (
            "- name: a\n  run: x\n  num_nodes: 2\n  resources: {gpus: 8}\n"
            "- name: b\n  run: x\n  resources: {gpus: 1}\n",
            "tasks",
        ),
    ],
)
def test_resources_no_node_has_are_refused(tasks: str, field: str) -> None:
    assert fit_fields(tasks) == [field]


def test_resources_that_fit_pass() -> None:
    spec = S.parse_yaml(
        group(
            "- name: a\n  run: x\n  num_nodes: 2\n  resources: {gpus: 'h100:4', cpus: 90, memory: 1000Gi}\n"
            "- name: b\n  run: x\n  num_nodes: 3\n  resources: {cpus: 16}\n"
        )
    )
    S.check_fits(spec, H100_NODES)
    S.check_fits(spec, [])  # nothing known: nothing refused
    unreported = [NodeInventory(f"n{i}", "", gpus=8, gpu_type="H100") for i in range(3)]
    S.check_fits(spec, unreported)  # CPUs and memory not reported constrain nothing


def test_gpu_type_matching() -> None:
    assert S.gpu_type_matches("H100", "NVIDIA-H100-80GB-HBM3")
    assert S.gpu_type_matches("h100-80gb", "NVIDIA-H100-80GB-HBM3")
    assert S.gpu_type_matches("", "anything")
    assert not S.gpu_type_matches("H10", "NVIDIA-H100-80GB-HBM3")
    assert not S.gpu_type_matches("A100", "H100")


# -- helpers ------------------------------------------------------------------------------------------------


def test_parse_gpus() -> None:
    assert S.parse_gpus("H100:8") == (8, "H100")
    assert S.parse_gpus(" 2 ") == (2, "")
    assert S.parse_gpus("") == (0, "")
    for bad in ("H100", "H100:0", ":8", "H 100:8", "8:H100", "H100:2000"):
        with pytest.raises(ValueError, match=r"\w"):
            S.parse_gpus(bad)


def test_restart_delays_double_up_to_the_ceiling() -> None:
    policy = js.RecoveryPolicy()
    assert [S.restart_delay_s(policy, n) for n in (1, 2, 3, 6)] == [10, 20, 40, 300]
    policy.initial_backoff.FromSeconds(2)
    policy.max_backoff.FromSeconds(5)
    assert [S.restart_delay_s(policy, n) for n in (1, 2, 3)] == [2, 4, 5]
    policy.ClearField("max_backoff")
    policy.initial_backoff.FromSeconds(600)
    assert S.restart_delay_s(policy, 1) == 600  # an unset max never undercuts the initial wait


def test_importing_the_spec_loads_no_ml_stack() -> None:
    # Nor anything of trainer/: what the services and the gateway share with it lives in tandem_jobs.
    code = (
        "import sys, services.scheduler.servicer, services.scheduler.expand, gateway.servicer, gateway.cli\n"
        "ml = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules]\n"
        "print(','.join(ml + sorted(m for m in sys.modules if m == 'trainer' or m.startswith('trainer.'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def test_a_task_with_gpu_alternatives_fits_when_one_of_them_does() -> None:
    # No node has A100s, the H100 nodes satisfy the second choice: the task fits.
    either = S.parse_yaml("name: a\nresources:\n  accelerators: [A100:8, H100:8]\nrun: x\n")
    assert list(either.tasks[0].resources.gpu_alternatives) == ["H100:8"]
    S.check_fits(either, H100_NODES)
    # None does: the first choice's reason is given.
    neither = S.parse_yaml("name: a\nresources:\n  accelerators: [A100:8, L4:1]\nrun: x\n")
    with pytest.raises(FailedPrecondition) as caught:
        S.check_fits(neither, H100_NODES)
    assert [v.field for v in caught.value.violations] == ["tasks[0].resources.gpus"]
    assert "no node has A100 GPUs" in caught.value.violations[0].description
    # The group's total counts each task's smallest choice: 2 x H100:8 and one task of [H100:8, H100:1].
    group_of_two = group(
        "- name: a\n  run: x\n  num_nodes: 2\n  resources: {gpus: 'H100:7'}\n"
        "- name: b\n  run: x\n  resources: {accelerators: ['H100:8', 'H100:1']}\n"
    )
    S.check_fits(S.parse_yaml(group_of_two), H100_NODES)

"""SkyPilot's task-level `config:` (services/scheduler/task_config.py): each key parsed into `TaskConfig` or
refused naming it, SkyPilot's own loader (in .venv-sky) as the oracle that the files Tandem takes are
SkyPilot's, and its own pod merge as the oracle of `merge_pod`."""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from tandem.scheduler.v1 import job_pb2
from tandem.scheduler.v1 import job_spec_pb2 as js
from tandem.scheduler.v1 import scheduler_service_pb2 as pb

from mesh.errors import InvalidArgument
from services.scheduler import expand
from services.scheduler import spec as S
from services.scheduler.backends import pod_config as C
from tests.services.scheduler.test_kubernetes_jobs import acme
from tests.services.scheduler.test_scheduler import ORG, TERMINAL, Clients, State, expect, log_text, wait_for
from tests.services.scheduler.test_skypilot import SKY_PYTHON, needs_skypilot, parse, refusals
from tests.services.scheduler.test_skypilot_files import submit
from tests.services.scheduler.test_skypilot_kubernetes import created
from tests.services.scheduler.test_slurm_jobs import acme as slurm_acme
from tests.services.scheduler.test_task_image import ROOT, acme_local, needs_podman, runnable_image
from tests.support.kube_api import FakeKubeApi, running_kube_api, validate

__all__ = ["acme", "acme_local", "runnable_image", "slurm_acme"]  # fixtures


def on_k8s(config: str) -> str:
    return "run: x\nresources: {infra: k8s}\nconfig:\n" + textwrap.indent(textwrap.dedent(config), "  ")


def in_image(run_options: Any) -> str:
    options = json.dumps(run_options)
    return (
        f"run: x\nresources: {{image_id: docker:busybox}}\nconfig: {{docker: {{run_options: {options}}}}}\n"
    )


# -- what is honoured ----------------------------------------------------------------------------------------

K8S_CONFIG = """\
kubernetes:
  pod_config:
    metadata: {labels: {team: rl}}
    spec:
      tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
      containers:
        - env: [{name: NCCL_DEBUG, value: INFO}]
          volumeMounts: [{name: dshm, mountPath: /dev/shm}]
      volumes: [{name: dshm, emptyDir: {medium: Memory}}]
  custom_metadata:
    labels: {cost-center: "1234"}
    annotations: {example.com/owner: alice}
  kueue: {local_queue_name: team-a}
"""


def test_kubernetes_config_is_the_tasks_pod_config_metadata_and_queue() -> None:
    [task] = parse(on_k8s(K8S_CONFIG)).tasks
    pod = json.loads(task.config.pod_config_json)
    assert pod["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["metadata"] == {"labels": {"team": "rl"}}
    assert dict(task.config.labels) == {"cost-center": "1234"}
    assert dict(task.config.annotations) == {"example.com/owner": "alice"}
    assert task.config.kueue_queue == "team-a"


def test_quota_queue_wins_over_kueues_name_as_in_skypilot() -> None:
    [task] = parse(on_k8s("kubernetes: {quota: {queue: q-one}, kueue: {local_queue_name: q-two}}")).tasks
    assert task.config.kueue_queue == "q-one"


@pytest.mark.parametrize(
    ("options", "want"),
    [
        ("--shm-size=2g", ["--shm-size=2g"]),
        ("--shm-size 2g --ulimit nofile=1024:4096", ["--shm-size=2g", "--ulimit=nofile=1024:4096"]),
        (["-e A=1", "-eB=2", "--env", "C"], None),  # `--env` alone needs its value in the same item
        (["-e A=1", "-eB=2", "--env C"], ["--env=A=1", "--env=B=2", "--env=C"]),
        ("--ipc=private --read-only --pids-limit 64", ["--ipc=private", "--read-only", "--pids-limit=64"]),
        ("--tmpfs /scratch -m 4g --cpus 2", ["--tmpfs=/scratch", "--memory=4g", "--cpus=2"]),
    ],
)
def test_docker_run_options_from_the_allow_list(options: Any, want: list[str] | None) -> None:
    text = in_image(options)
    if want is None:
        found = refusals(text)
        assert "--env needs a value" in found["config.docker.run_options[2]"]
        return
    [task] = parse(text).tasks
    assert list(task.config.container_run_options) == want


def test_slurm_config_sets_the_jobs_slurm_options() -> None:
    spec = parse(
        """\
        run: x
        resources: {infra: slurm}
        config:
          slurm:
            sbatch_options: {A: research, q: normal}
            quota: {queue: high}
            cpu_partition: cpu
        """
    )
    assert spec.backend == js.BACKEND_SLURM
    assert (spec.slurm.partition, spec.slurm.account, spec.slurm.qos) == ("cpu", "research", "high")


def test_slurm_config_must_agree_with_the_jobs_own_options() -> None:
    found = refusals(
        """\
        run: x
        backend: slurm
        slurm: {account: ops}
        config: {slurm: {sbatch_options: {account: research}}}
        """
    )
    assert "names the account 'research', and the job's is 'ops'" in found["config.slurm"]


def test_each_task_of_a_group_has_its_own_config_and_their_slurm_options_agree() -> None:
    group = """\
        name: g
        backend: {backend}
        tasks:
          - name: a
            run: x
            config: {first}
          - name: b
            run: x
            config: {second}
        """
    spec = parse(
        group.format(
            backend="kubernetes",
            first="{kubernetes: {kueue: {local_queue_name: qa}}}",
            second="{kubernetes: {custom_metadata: {labels: {b: '1'}}}}",
        )
    )
    assert [t.config.kueue_queue for t in spec.tasks] == ["qa", ""]
    assert [dict(t.config.labels) for t in spec.tasks] == [{}, {"b": "1"}]
    found = refusals(
        group.format(
            backend="slurm",
            first="{slurm: {quota: {account: research}}}",
            second="{slurm: {quota: {account: ops}}}",
        )
    )
    assert found == {"tasks[1].config.slurm": "names the account 'ops', and the job's is 'research'"}


# -- what is refused -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "field", "words"),
    [
        ("gcp: {vpc_name: net}", "config.gcp", "public cloud"),
        ("azure: {vpc_name: net}", "config.azure", "public cloud"),
        ("vast: {datacenter_only: true}", "config.vast", "public cloud"),
        ("aws: {vpc_name: net}", "config.aws", "public cloud"),
        ("ssh: {provision_timeout: 10}", "config.ssh", "SSH node pools"),
        ("nvidia_gpus: {disable_ecc: true}", "config.nvidia_gpus", "ECC"),
        ("active_workspace: team", "config.active_workspace", "workspace"),
        ("hooks: [{run: echo}]", "config.hooks", "not kept as clusters"),
        ("jobs: {controller: {resources: {cpus: 2}}}", "config.jobs", "managed-jobs controller"),
        ("serve: {controller: {resources: {cpus: 2}}}", "config.serve", "SkyServe"),
        ("api_server: {endpoint: http://x}", "config.api_server", "API server"),
        ("kubernetes: {provision_timeout: 10}", "config.kubernetes.provision_timeout", "max_duration"),
        ("kubernetes: {dws: {enabled: true}}", "config.kubernetes.dws", "Dynamic Workload Scheduler"),
        (
            "kubernetes: {remote_identity: SERVICE_ACCOUNT}",
            "config.kubernetes.remote_identity",
            "service account",
        ),
        ("kubernetes: {enable_docker: true}", "config.kubernetes.enable_docker", "privileged"),
        (
            "kubernetes: {set_pod_resource_limits: true}",
            "config.kubernetes.set_pod_resource_limits",
            "limits",
        ),
        (
            "kubernetes: {kueue: {admission_timeout: 60}}",
            "config.kubernetes.kueue.admission_timeout",
            "waits",
        ),
        ("kubernetes: {custom_metadata: {name: x}}", "config.kubernetes.custom_metadata.name", "Tandem's"),
        (
            "kubernetes: {kueue: {local_queue_name: Not_A_Name}}",
            "config.kubernetes.kueue.local_queue_name",
            "not",
        ),
        ("kubernetes: {pod_config: [1]}", "config.kubernetes.pod_config", "partial Pod"),
        ("docker: {image: x}", "config.docker.image", "run_options"),
        ("slurm: {sbatch_options: {time: '1:00:00'}}", "config.slurm.sbatch_options.time", "max_duration"),
        (
            "slurm: {sbatch_options: {partition: gpu}}",
            "config.slurm.sbatch_options.partition",
            "infra: slurm",
        ),
        ("slurm: {sbatch_options: {exclusive: true}}", "config.slurm.sbatch_options.exclusive", "account"),
        ("slurm: {sbatch_options: {a: 1-4}}", "config.slurm.sbatch_options.a", "account (-A)"),
        ("kuberentes: {}", "config.kuberentes", "did you mean kubernetes?"),
    ],
)
def test_config_keys_without_a_meaning_here_are_refused_naming_them(
    config: str, field: str, words: str
) -> None:
    found = refusals(on_k8s(config))
    assert field in found, found
    assert words in found[field], found[field]


@pytest.mark.parametrize(
    ("pod", "field", "words"),
    [
        ({"spec": {"hostNetwork": True}}, "spec.hostNetwork", "node's network"),
        ({"spec": {"hostPID": True}}, "spec.hostPID", "every process"),
        ({"spec": {"hostIPC": True}}, "spec.hostIPC", "IPC"),
        ({"spec": {"serviceAccountName": "admin"}}, "spec.serviceAccountName", "identity"),
        (
            {"spec": {"automountServiceAccountToken": True}},
            "spec.automountServiceAccountToken",
            "credentials",
        ),
        ({"spec": {"nodeName": "node-a"}}, "spec.nodeName", "placement"),
        ({"spec": {"priorityClassName": "top"}}, "spec.priorityClassName", "priority"),
        ({"spec": {"restartPolicy": "Always"}}, "spec.restartPolicy", "recovery"),
        (
            {
                "spec": {
                    "volumes": [{"name": "a", "emptyDir": {}}, {"name": "root", "hostPath": {"path": "/"}}]
                }
            },
            "spec.volumes[1].hostPath",
            "folder of the node",
        ),
        (
            {"spec": {"containers": [{"securityContext": {"privileged": True}}]}},
            "spec.containers[0].securityContext.privileged",
            "every capability",
        ),
        (
            {
                "spec": {
                    "initContainers": [{"name": "i", "securityContext": {"allowPrivilegeEscalation": True}}]
                }
            },
            "spec.initContainers[0].securityContext.allowPrivilegeEscalation",
            "more rights",
        ),
        (
            {"spec": {"securityContext": {"runAsUser": 0}}},
            "spec.securityContext.runAsUser",
            "root",
        ),
        (
            {"spec": {"securityContext": {"runAsNonRoot": False}}},
            "spec.securityContext.runAsNonRoot",
            "root",
        ),
        (
            {"spec": {"containers": [{"securityContext": {"seccompProfile": {"type": "Unconfined"}}}]}},
            "spec.containers[0].securityContext.seccompProfile",
            "system calls",
        ),
        (
            {"spec": {"volumes": [{"name": "s", "secret": {"secretName": "scheduler-token"}}]}},
            "spec.volumes[0].secret",
            "Secret of the namespace",
        ),
        (
            {"spec": {"volumes": [{"name": "c", "persistentVolumeClaim": {"claimName": "other-org"}}]}},
            "spec.volumes[0].persistentVolumeClaim",
            "claim of the namespace",
        ),
        (
            {"spec": {"volumes": [{"name": "p", "projected": {"sources": []}}]}},
            "spec.volumes[0].projected",
            "service account token",
        ),
        (
            {"spec": {"volumes": [{"name": "n", "nfs": {"server": "x", "path": "/"}}]}},
            "spec.volumes[0].nfs",
            "reaching past the pod",
        ),
        (
            {
                "spec": {
                    "containers": [{"env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "s"}}}]}]
                }
            },
            "spec.containers[0].env[0].valueFrom",
            "Secret or ConfigMap",
        ),
        (
            {"spec": {"containers": [{"envFrom": [{"configMapRef": {"name": "c"}}]}]}},
            "spec.containers[0].envFrom",
            "Secret or ConfigMap",
        ),
        ({"spec": {"imagePullSecrets": [{"name": "regcred"}]}}, "spec.imagePullSecrets", "own secrets"),
        ({"spec": {"runtimeClassName": "runc"}}, "spec.runtimeClassName", "container runtime"),
        (
            {"metadata": {"labels": {"tandem.dev/job": "other"}}},
            'metadata.labels["tandem.dev/job"]',
            "Tandem's",
        ),
        ({"metadata": {"name": "mine"}}, "metadata.name", "Tandem's"),
        ({"kind": "Deployment"}, "kind", "Pod"),
        ({"status": {}}, "status", "not a Pod's field"),
    ],
)
def test_pod_config_fields_that_cross_organizations_are_refused_naming_them(
    pod: dict[str, Any], field: str, words: str
) -> None:
    found = refusals(on_k8s(f"kubernetes: {{pod_config: {json.dumps(pod)}}}"))
    key = f"config.kubernetes.pod_config.{field}" if field != "kind" else "config.kubernetes.pod_config.kind"
    assert key in found, found
    assert words in found[key], found[key]


def test_capabilities_are_left_to_the_deployment_and_checked_with_its_setting() -> None:
    pod = {
        "spec": {
            "containers": [{"securityContext": {"capabilities": {"add": ["SYS_PTRACE", "CAP_IPC_LOCK"]}}}]
        }
    }
    [task] = parse(on_k8s(f"kubernetes: {{pod_config: {json.dumps(pod)}}}")).tasks  # the spec takes them
    assert json.loads(task.config.pod_config_json) == pod
    found = dict(C.pod_config_problems(pod, allowed_capabilities=["IPC_LOCK"]))
    assert list(found) == ["spec.containers[0].securityContext.capabilities.add[0]"]
    assert "SYS_PTRACE" in found["spec.containers[0].securityContext.capabilities.add[0]"]
    assert "IPC_LOCK" in found["spec.containers[0].securityContext.capabilities.add[0]"]
    assert C.pod_config_problems(pod, allowed_capabilities=["sys_ptrace", "IPC_LOCK"]) == []


def test_false_host_namespaces_ask_nothing_and_are_taken() -> None:
    [task] = parse(on_k8s("kubernetes: {pod_config: {spec: {hostNetwork: false, hostPID: false}}}")).tasks
    assert json.loads(task.config.pod_config_json)["spec"] == {"hostNetwork": False, "hostPID": False}


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ("--privileged", "--privileged reaches past the task's sandbox"),
        ("-v /:/host", "-v reaches past"),
        ("--volume=/etc:/etc", "--volume reaches past"),
        ("--cap-add SYS_ADMIN", "--cap-add reaches past"),
        ("--network bridge", "--network reaches past"),
        ("--pid=host", "--pid reaches past"),
        ("--device /dev/kmsg", "--device reaches past"),
        ("--security-opt seccomp=unconfined", "--security-opt reaches past"),
        ("--user 0", "--user reaches past"),
        ("--ipc=host", "--ipc=host is refused"),
        ("--env 'BAD NAME=1'", "does not name a variable"),
        ("--tmpfs scratch", "absolute path"),
        ("--shm-size 'unclosed", "No closing quotation"),
    ],
)
def test_docker_run_options_that_reach_the_host_are_refused_naming_them(options: str, words: str) -> None:
    found = refusals(in_image(options))
    assert words in found["config.docker.run_options"], found


def test_each_config_block_takes_its_backend() -> None:
    found = refusals("run: x\nresources: {infra: slurm}\nconfig:\n" + textwrap.indent(K8S_CONFIG, "  "))
    for key in (
        "pod_config",
        "custom_metadata.labels",
        "custom_metadata.annotations",
        "kueue.local_queue_name",
    ):
        assert "takes the job on Kubernetes" in found[f"config.kubernetes.{key}"], found
    found = refusals("run: x\nconfig: {slurm: {sbatch_options: {account: a}}}\n")
    assert "take the job on Slurm" in found["config.slurm"]
    found = refusals(
        "run: x\nresources: {infra: k8s, image_id: docker:busybox}\nconfig: {docker: {run_options: --shm-size=1g}}\n"
    )
    assert "the kubelet runs the image" in found["config.docker.run_options"]
    found = refusals("run: x\nconfig: {docker: {run_options: --shm-size=1g}}\n")
    assert "the task has no image_id" in found["config.docker.run_options"]
    found = refusals(
        "run: x\nresources: {accelerators: A100:1, infra: slurm}\nconfig: {slurm: {cpu_partition: cpu}}\n"
    )
    assert "asks for GPUs" in found["config.slurm.cpu_partition"]


def test_custom_labels_never_take_tandems_own() -> None:
    found = refusals(on_k8s("kubernetes: {custom_metadata: {labels: {app.kubernetes.io/managed-by: me}}}"))
    assert (
        "Tandem's own labels"
        in found['config.kubernetes.custom_metadata.labels["app.kubernetes.io/managed-by"]']
    )
    found = refusals(on_k8s("kubernetes: {custom_metadata: {annotations: {kueue.x-k8s.io/queue-name: q}}}"))
    assert "Kueue's" in found['config.kubernetes.custom_metadata.annotations["kueue.x-k8s.io/queue-name"]']


def test_a_proto_config_is_checked_as_the_yaml_one_naming_proto_fields() -> None:
    spec = js.JobSpec(backend=js.BACKEND_KUBERNETES)
    task = spec.tasks.add(name="t", kind=js.TaskSpec.KIND_COMMAND, run="x")
    task.config.pod_config_json = json.dumps({"spec": {"hostPID": True}})
    task.config.labels["tandem.dev/job"] = "x"
    task.config.container_run_options.append("--privileged")
    with pytest.raises(InvalidArgument) as caught:
        S.check_spec(spec)
    fields = {v.field for v in caught.value.violations}
    assert {
        "tasks[0].config.pod_config_json.spec.hostPID",
        'tasks[0].config.labels["tandem.dev/job"]',
        "tasks[0].config.container_run_options",
        "tasks[0].config.container_run_options[0]",
    } <= fields, fields


# -- SkyPilot as the oracle ---------------------------------------------------------------------------------

SCHEMA = """
import json
from sky.utils import schemas
config = schemas._task_config_schema()
print(json.dumps({key: sorted(value.get("properties", {})) for key, value in config["properties"].items()}))
"""

LOADER = """
import json, sys
from sky.utils import dag_utils
out = {}
for path in json.loads(sys.argv[1]):
    dag = dag_utils.load_dag_from_yaml(path)
    out[path] = [r.cluster_config_overrides for r in dag.tasks[0].resources]
print(json.dumps(out))
"""

MERGE = """
import json, sys
from sky.utils import config_utils
out = []
for base, override in json.loads(sys.argv[1]):
    config_utils.merge_k8s_configs(base, override)
    out.append(base)
print(json.dumps(out))
"""


def skypilot(program: str, argument: Any, home: Path) -> Any:
    done = subprocess.run(
        [str(SKY_PYTHON), "-c", program, json.dumps(argument)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env={**os.environ, "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "HOME": str(home)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_skypilot
def test_every_key_of_skypilots_task_config_is_honoured_or_refused_with_a_reason(tmp_path: Path) -> None:
    schema: dict[str, list[str]] = skypilot(SCHEMA, None, tmp_path)
    assert {"kubernetes", "docker", "slurm", "gcp", "hooks"} <= set(schema)
    refused = 0
    for key, inner in schema.items():
        for sub in inner or [""]:
            text = f"{key}: {{{sub}: 1}}" if sub else f"{key}: 1"
            try:
                S.parse_yaml(on_k8s(text))
            except InvalidArgument as exc:
                found = {v.field: v.description for v in exc.violations}
            else:
                continue
            assert any(f.startswith(f"config.{key}") for f in found), (key, sub, found)
            for field, why in found.items():
                assert "is not a key Tandem takes" not in why, (field, why)
            refused += 1
    assert refused > 20


@needs_skypilot
def test_spec_md_has_a_row_for_every_skypilot_config_key(tmp_path: Path) -> None:
    schema: dict[str, list[str]] = skypilot(SCHEMA, None, tmp_path)
    text = (ROOT / "services" / "scheduler" / "SPEC.md").read_text()
    section = text.split("## SkyPilot's keys", 1)[1].split("\n## ", 1)[0]
    cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `config")]
    rows = {name for cell in cells for name in re.findall(r"`(config\.[a-z_.]+)`", cell)}
    wanted = {f"config.{key}" for key in schema}
    wanted |= {f"config.{key}.{sub}" for key in ("kubernetes", "slurm", "docker") for sub in schema[key]}
    assert not wanted - rows, sorted(wanted - rows)


@needs_skypilot
def test_skypilot_reads_the_config_tandem_takes_alike(tmp_path: Path) -> None:
    files = {
        "k8s.yaml": on_k8s(K8S_CONFIG),
        "docker.yaml": "run: x\nresources: {image_id: docker:busybox}\n"
        "config: {docker: {run_options: ['--shm-size=2g', '--ulimit nofile=1024:4096']}}\n",
        "slurm.yaml": "run: x\nresources: {infra: slurm}\n"
        "config: {slurm: {sbatch_options: {account: research}, quota: {queue: high}, cpu_partition: cpu}}\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    theirs = skypilot(LOADER, [str(tmp_path / n) for n in files], tmp_path)
    for name in files:
        [overrides] = theirs[str(tmp_path / name)]
        spec = S.load_yaml(tmp_path / name)
        config = spec.tasks[0].config
        if name == "k8s.yaml":
            kubernetes = overrides["kubernetes"]
            assert json.loads(config.pod_config_json) == kubernetes["pod_config"]
            assert dict(config.labels) == kubernetes["custom_metadata"]["labels"]
            assert dict(config.annotations) == kubernetes["custom_metadata"]["annotations"]
            assert config.kueue_queue == kubernetes["kueue"]["local_queue_name"]
        elif name == "docker.yaml":
            assert overrides["docker"]["run_options"] == ["--shm-size=2g", "--ulimit nofile=1024:4096"]
            assert list(config.container_run_options) == ["--shm-size=2g", "--ulimit=nofile=1024:4096"]
        else:
            slurm = overrides["slurm"]
            assert spec.slurm.account == slurm["sbatch_options"]["account"]
            assert spec.slurm.qos == slurm["quota"]["queue"]
            assert spec.slurm.partition == slurm["cpu_partition"]


POD: dict[str, Any] = {
    "metadata": {"labels": {"a": "1"}},
    "spec": {
        "containers": [
            {
                "name": "task",
                "image": "img",
                "command": ["bash", "-c", "x"],
                "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                "volumeMounts": [{"name": "w", "mountPath": "/w"}],
            }
        ],
        "volumes": [{"name": "w", "emptyDir": {}}],
        "tolerations": [{"key": "x", "operator": "Exists"}],
    },
}
OVERRIDES: list[dict[str, Any]] = [
    {"spec": {"containers": [{"env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}]}]}},
    {"spec": {"containers": [{"name": "task", "args": ["--x"]}, {"name": "sidecar", "image": "side"}]}},
    {"spec": {"volumes": [{"name": "w", "emptyDir": {"medium": "Memory"}}, {"name": "v", "emptyDir": {}}]}},
    {"spec": {"tolerations": [{"key": "y", "operator": "Exists"}]}, "metadata": {"labels": {"b": "2"}}},
    {
        "spec": {
            "containers": [
                {"name": "task", "command": ["sh"], "volumeMounts": [{"name": "v", "mountPath": "/v"}]}
            ]
        }
    },
    {"spec": {"nodeSelector": {"pool": "gpu"}, "tolerations": None}},
]


def test_a_pod_config_of_another_shape_than_the_pod_is_named() -> None:
    override = {"spec": {"containers": {"name": "task"}, "tolerations": "all", "nodeSelector": None}}
    assert C.mismatched_shapes(POD, override) == [
        ("spec.containers", "is a list in the task's pod, and pod_config gives a table"),
        ("spec.tolerations", "is a list in the task's pod, and pod_config gives a value"),
    ]
    assert C.mismatched_shapes(POD, {"spec": {"containers": [{"command": "sh"}]}}) == []  # items: merge's
    assert C.mismatched_shapes(POD, {"metadata": {"labels": {"a": "2"}}}) == []


@needs_skypilot
def test_merge_pod_is_skypilots_merge(tmp_path: Path) -> None:
    theirs = skypilot(MERGE, [[POD, override] for override in OVERRIDES], tmp_path)
    ours = [C.merge_pod(POD, override) for override in OVERRIDES]
    assert ours == theirs
    assert POD["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]


# -- on the Kubernetes stand-in --------------------------------------------------------------------------


@pytest.fixture
def cluster() -> Iterator[FakeKubeApi]:
    with running_kube_api(run_pods=False) as api:
        api.add_node("node-a")
        yield api


@pytest.fixture
def with_ipc_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_SCHEDULER_KUBERNETES__ALLOWED_CAPABILITIES", '["IPC_LOCK"]')


POD_CONFIG_TASK = """\
name: nccl-test
resources: {infra: k8s, cpus: 1}
run: echo hi
config:
  kubernetes:
    pod_config:
      metadata:
        labels: {team: rl, tandem.dev/job: mine}
      spec:
        tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
        containers:
          - env: [{name: NCCL_DEBUG, value: INFO}, {name: TANDEM_NUM_NODES, value: "7"}]
            volumeMounts: [{name: dshm, mountPath: /dev/shm}]
            securityContext: {capabilities: {add: [IPC_LOCK]}}
          - name: sidecar
            image: busybox
            command: [sleep, infinity]
        volumes: [{name: dshm, emptyDir: {medium: Memory}}]
    custom_metadata:
      labels: {cost-center: "1234"}
      annotations: {example.com/owner: alice}
    kueue: {local_queue_name: team-a}
"""


@pytest.mark.timeout(120)
async def test_pod_config_is_merged_into_the_tasks_pod(
    with_ipc_lock: None, acme: Clients, cluster: FakeKubeApi, tmp_path: Path
) -> None:
    path = tmp_path / "task.yaml"
    path.write_text(POD_CONFIG_TASK.replace(", tandem.dev/job: mine", ""))
    spec = S.load_yaml(path)
    await acme.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, spec=spec))
    [job] = await created(cluster, "jobs")
    validate(job)
    template = job["spec"]["template"]
    pod = template["spec"]
    task, sidecar = pod["containers"]
    # the nameless container merged into Tandem's own, by SkyPilot's rule; Tandem's variables kept
    env = {e["name"]: e.get("value") for e in task["env"]}
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["TANDEM_NUM_NODES"] == "7"  # an env item by name: the task's value, as SkyPilot merges it
    assert "TANDEM_JOB" in env and task["command"][:2] == ["bash", "-euo"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in task["volumeMounts"]
    assert task["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert task["securityContext"]["allowPrivilegeEscalation"] is False
    assert sidecar == {"name": "sidecar", "image": "busybox", "command": ["sleep", "infinity"]}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    # custom_metadata on the Job and its pods; Tandem's labels stay; the Kueue queue on the Job
    labels = template["metadata"]["labels"]
    assert labels["team"] == "rl" and labels["cost-center"] == "1234"
    assert labels["app.kubernetes.io/managed-by"] == job["metadata"]["labels"]["app.kubernetes.io/managed-by"]
    assert template["metadata"]["annotations"]["example.com/owner"] == "alice"
    assert job["metadata"]["labels"]["cost-center"] == "1234"
    assert job["metadata"]["annotations"]["example.com/owner"] == "alice"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert "kueue.x-k8s.io/queue-name" not in labels


@pytest.mark.timeout(120)
async def test_a_capability_the_deployment_does_not_allow_refuses_the_launch(
    acme: Clients, cluster: FakeKubeApi, tmp_path: Path
) -> None:
    path = tmp_path / "task.yaml"
    path.write_text(POD_CONFIG_TASK.replace(", tandem.dev/job: mine", ""))
    reply = await acme.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, spec=S.load_yaml(path)))
    done = await wait_for(acme, reply.job.name, *TERMINAL)
    assert done.state == State.STATE_FAILED
    assert done.failure.failure_class == job_pb2.Failure.CLASS_PRECHECK
    assert "config.kubernetes.pod_config.spec.containers[0].securityContext.capabilities.add[0]" in (
        done.failure.message
    )
    assert "IPC_LOCK" in done.failure.message
    assert not [key for key in cluster.objects if key[0] == "jobs"]


@pytest.fixture
def kubernetes_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_SCHEDULER_DEFAULT_BACKEND", "kubernetes")


@pytest.mark.timeout(120)
async def test_run_options_of_a_job_that_lands_on_kubernetes_refuse_its_launch(
    kubernetes_by_default: None, acme: Clients, cluster: FakeKubeApi
) -> None:
    spec = parse(in_image("--shm-size=1g"))  # no backend of its own: the scheduler's default, Kubernetes
    assert spec.backend == js.BACKEND_UNSPECIFIED
    reply = await acme.scheduler.CreateJob(pb.CreateJobRequest(parent=ORG, spec=spec))
    done = await wait_for(acme, reply.job.name, *TERMINAL)
    assert done.failure.failure_class == job_pb2.Failure.CLASS_PRECHECK
    assert "config.docker.run_options" in done.failure.message
    assert "runs on kubernetes" in done.failure.message
    assert not [key for key in cluster.objects if key[0] == "jobs"]


@pytest.mark.timeout(120)
async def test_pod_config_may_not_rewrite_tandems_own_mounts(acme: Clients, cluster: FakeKubeApi) -> None:
    mount = "{pod_config: {spec: {containers: [{volumeMounts: [{name: x, mountPath: /tmp}]}]}}}"
    reply = await acme.scheduler.CreateJob(
        pb.CreateJobRequest(parent=ORG, spec=parse(on_k8s(f"kubernetes: {mount}")))
    )
    done = await wait_for(acme, reply.job.name, *TERMINAL)
    assert done.failure.failure_class == job_pb2.Failure.CLASS_PRECHECK
    assert (
        "spec.containers[0].volumeMounts[0]: is Tandem's own mount of the task at /tmp"
        in done.failure.message
    )
    assert not [key for key in cluster.objects if key[0] == "jobs"]


def test_tandems_own_pod_labels_are_refused_in_pod_config(tmp_path: Path) -> None:
    path = tmp_path / "task.yaml"
    path.write_text(POD_CONFIG_TASK)
    with pytest.raises(InvalidArgument) as caught:
        S.load_yaml(path)
    assert [v.field for v in caught.value.violations] == [
        'config.kubernetes.pod_config.metadata.labels["tandem.dev/job"]'
    ]


# -- on the local backend's container runtime ----------------------------------------------------------


def test_run_options_follow_tandems_own_in_the_containers_run() -> None:
    [task] = parse(in_image("--shm-size 96m --env 'GREETING=hello there'")).tasks
    script = expand.in_container(task, "true", image="busybox", env_names=["A"], folders=[])
    argv = shlex.split(script.split("task_image", 1)[1])
    assert argv[argv.index("--network") : argv.index("--network") + 2] == ["--network", "host"]
    at = argv.index("--shm-size=96m")
    assert argv[at : at + 2] == ["--shm-size=96m", "--env=GREETING=hello there"]
    assert at > argv.index("A") and at < argv.index("--user")


def host_nproc() -> int:
    """An nproc limit this host allows: podman's --ulimit replaces containers.conf's default_ulimits
    (tests/support/images.py), so a test that sets one sets nproc within the host's too."""
    return min(
        resource.getrlimit(resource.RLIMIT_NPROC)[1], int(Path("/proc/sys/kernel/pid_max").read_text())
    )


@needs_podman
async def test_run_options_reach_the_tasks_container(runnable_image: str, acme_local: Clients) -> None:
    """A job file's `config.docker.run_options` through CreateJob to the local backend's podman: the
    container has the shared memory, the open-files limit and the variable they ask for."""
    nproc = host_nproc()
    spec = parse(
        f"""\
        envs:
          PYTHONPATH: {ROOT}
        resources:
          image_id: docker:{runnable_image}
        config:
          docker:
            run_options:
              - --shm-size=96m
              - --ulimit nofile=512:512 --ulimit nproc={nproc}:{nproc} -e FROM_RUN_OPTIONS=yes
        run: |
          while read -r what where kind options rest; do
            if [ "$where" = /dev/shm ]; then echo "shm $options"; fi
          done < /proc/mounts
          echo "nofile=$(ulimit -n) from=$FROM_RUN_OPTIONS"
        """
    )
    job = await submit(acme_local, spec)
    done = await wait_for(acme_local, job.name, *TERMINAL, within_s=180)
    logs = await log_text(acme_local, job.name)
    assert done.state == State.STATE_SUCCEEDED, (done.failure.message, logs)
    assert "size=98304k" in logs, logs
    assert "nofile=512 from=yes" in logs, logs


# -- on Slurm --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_cpu_tasks_cpu_partition_is_its_slurm_partition(slurm_acme: Clients) -> None:
    # tests/support/slurm.py's cluster is `tandemtest`, with the one partition `debug`.
    def request(job_id: str, partition: str) -> pb.CreateJobRequest:
        spec = parse(
            f"""\
            name: {job_id}
            resources: {{infra: slurm}}
            config: {{slurm: {{cpu_partition: {partition}}}}}
            run: echo "in $SLURM_JOB_PARTITION"
            """
        )
        assert spec.slurm.partition == partition
        return pb.CreateJobRequest(parent=ORG, job_id=job_id, spec=spec)

    reply = await slurm_acme.scheduler.CreateJob(request("cpu-only", "debug"))
    done = await wait_for(slurm_acme, reply.job.name, *TERMINAL, within_s=120)
    assert done.state == State.STATE_SUCCEEDED, done.failure.message
    assert "in debug" in await log_text(slurm_acme, done.name)
    error = await expect(
        slurm_acme.scheduler.CreateJob(request("no-gpu-partition", "gpu")),
        grpc.StatusCode.FAILED_PRECONDITION,
        "FAILED_PRECONDITION",
    )
    assert [v.field for v in error.violations] == ["spec.slurm.partition"]
    assert "no partition 'gpu'" in error.message
    await slurm_acme.close()

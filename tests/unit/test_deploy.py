"""deploy/ checked without a cluster: every Kubernetes manifest against the Kubernetes OpenAPI schemas
(kubernetes-validate), each overlay rendered the way `kubectl apply -k` renders it and checked again, the
wiring between the objects (probes, secrets, peers' Service names), and the Dockerfiles' instructions and
COPY sources.

The renderer below implements the kustomize subset the manifests use: `resources` (files and folders
with a kustomization), `namespace` (namespaced objects and ServiceAccount subjects of role bindings),
`labels` (pairs on metadata), `images` (newName/newTag) and `patches` with inline JSON 6902 operations
selected by `target` kind/name. A kustomization using anything else fails the test, so the subset and the
manifests cannot drift apart silently.

Run: .venv/bin/python -m pytest tests/unit/test_deploy.py
"""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
SCHEMA_VERSION = "1.35.0"
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "PersistentVolume"}
SUPPORTED_KEYS = {"apiVersion", "kind", "namespace", "resources", "labels", "images", "patches"}
SERVICES = {  # Deployment -> (python -m module, port)
    "tandem-gateway": ("gateway", 50050),
    "tandem-vault": ("services.vault", 50051),
    "tandem-scheduler": ("services.scheduler", 50052),
    "tandem-taskapp-proxy": ("services.taskapp_proxy", 50053),
    "tandem-events": ("services.events", 50054),
}

Obj = dict[str, Any]


def load_documents(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _pointer(path: str) -> list[str]:
    assert path.startswith("/"), path
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _apply_to_list(node: list[Any], last: str, operation: Obj) -> None:
    op, index = operation["op"], len(node) if last == "-" else int(last)
    if op == "add":
        node.insert(index, copy.deepcopy(operation["value"]))
    elif op == "replace":
        node[index] = copy.deepcopy(operation["value"])
    elif op == "remove":
        del node[index]
    elif op == "test":
        assert node[index] == operation["value"], operation
    else:
        raise AssertionError(f"unsupported JSON patch op {op}")


def _apply_to_dict(node: Obj, last: str, operation: Obj) -> None:
    op = operation["op"]
    if op in ("replace", "remove", "test"):
        assert last in node, f"{operation['path']} does not exist"
    if op in ("add", "replace"):
        node[last] = copy.deepcopy(operation["value"])
    elif op == "remove":
        del node[last]
    elif op == "test":
        assert node[last] == operation["value"], operation
    else:
        raise AssertionError(f"unsupported JSON patch op {op}")


def json_patch(obj: Obj, operations: list[Obj]) -> Obj:
    """RFC 6902 add / replace / remove / test."""
    result = copy.deepcopy(obj)
    for operation in operations:
        *parents, last = _pointer(operation["path"])
        node: Any = result
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            _apply_to_list(node, last, operation)
        else:
            _apply_to_dict(node, last, operation)
    return result


def _targets(target: Obj, obj: Obj) -> bool:
    assert set(target) <= {"kind", "name"}, f"unsupported patch target {target}"
    return all(
        (obj.get("kind") if key == "kind" else obj["metadata"].get("name")) == value
        for key, value in target.items()
    )


def _set_image(image: str, rule: Obj) -> str:
    found = re.match(r"^([^:@]+(?::\d+/[^:@]+)?)(?::([^@]+))?(@.*)?$", image)
    assert found, image
    name, tag = found.group(1), found.group(2)
    if name != rule["name"]:
        return image
    name, tag = str(rule.get("newName", name)), rule.get("newTag", tag)
    return f"{name}:{tag}" if tag else name


def _containers(obj: Obj) -> list[Obj]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("containers", []), *spec.get("initContainers", [])]


def _set_namespace(objects: list[Obj], namespace: str) -> None:
    for obj in objects:
        if obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = namespace
        if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            for subject in obj.get("subjects", []):
                if subject["kind"] == "ServiceAccount":
                    subject["namespace"] = namespace


def render(folder: Path) -> list[Obj]:
    """The objects `kubectl apply -k folder` would send, for the kustomize subset in the module docstring."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED_KEYS
    assert not unknown, f"{folder}: kustomization fields the test renderer does not implement: {unknown}"
    objects: list[Obj] = []
    for resource in kustomization.get("resources", []):
        path = (folder / resource).resolve()
        objects += render(path) if path.is_dir() else load_documents(path)
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"target", "patch"}, f"only inline patches with a target: {patch}"
        operations = yaml.safe_load(patch["patch"])
        assert isinstance(operations, list), "only JSON 6902 patches"
        matched = [i for i, obj in enumerate(objects) if _targets(patch["target"], obj)]
        assert matched, f"{folder}: patch target {patch['target']} matches nothing"
        for i in matched:
            objects[i] = json_patch(objects[i], operations)
    for rule in kustomization.get("images", []):
        for obj in objects:
            for container in _containers(obj):
                container["image"] = _set_image(container["image"], rule)
    if namespace := kustomization.get("namespace"):
        _set_namespace(objects, namespace)
    for entry in kustomization.get("labels", []):
        assert set(entry) <= {"pairs"}, "labels: only pairs (no selectors, no templates)"
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(entry["pairs"])
    return objects


def manifests() -> list[Path]:
    return sorted(p for p in KUBE.rglob("*.yaml") if p.name != "kustomization.yaml")


OVERLAYS = sorted(p.parent for p in (KUBE / "overlays").glob("*/kustomization.yaml"))


@pytest.mark.parametrize("path", manifests(), ids=lambda p: str(p.relative_to(KUBE)))
def test_every_manifest_matches_the_kubernetes_schema(path: Path) -> None:
    for obj in load_documents(path):
        kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)


def test_overlays_are_dev_and_production() -> None:
    assert [p.name for p in OVERLAYS] == ["dev", "production"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_each_overlay_renders_to_valid_wired_objects(overlay: Path) -> None:
    objects = render(overlay)
    for obj in objects:
        kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
    names = [(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), "duplicate objects"
    by_kind: dict[str, dict[str, Obj]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    (namespace,) = by_kind["Namespace"]
    assert all(
        o["metadata"].get("namespace") == namespace for o in objects if o["kind"] not in CLUSTER_SCOPED
    )
    assert all(o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tandem" for o in objects)

    config = by_kind["ConfigMap"]["tandem-config"]["data"]
    for name, (module, port) in SERVICES.items():
        deployment = by_kind["Deployment"][name]
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["command"] + container["args"] == ["python", "-m", module]
        package = ROOT.joinpath(*module.split("."))
        assert (package / "__main__.py").exists(), f"python -m {module} has no __main__"
        assert container["ports"][0]["containerPort"] == port
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert container[probe]["grpc"]["port"] == port
        env = {item["name"]: item for item in container["env"]}
        assert env["TANDEM_STORE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "tandem-store", "key": "url"}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert (
            mounts["mesh-key"]["mountPath"] == "/var/lib/tandem/mesh.key" and mounts["mesh-key"]["readOnly"]
        )
        assert volumes["mesh-key"]["secret"]["secretName"] == "tandem-mesh-key"
        assert config["TANDEM_STATE_DIR"] == "/var/lib/tandem"
        assert container["image"].split(":")[-1] in ("dev", "0.1.0"), "the overlay pins the tag"
        service = by_kind["Service"][name]
        assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        assert service["spec"]["ports"][0]["port"] == port
        target = name.removeprefix("tandem-").replace("-", "_").upper()
        assert config[f"TANDEM_TARGETS__{target}"] == f"{name}:{port}"
        refs = [e["configMapRef"]["name"] for e in container["envFrom"]]
        assert all(ref in by_kind["ConfigMap"] for ref in refs)
        if name != "tandem-vault":
            assert "vault-master-key" not in volumes, "only the vault mounts the master key"
    vault = by_kind["Deployment"]["tandem-vault"]["spec"]["template"]["spec"]
    assert any(v.get("secret", {}).get("secretName") == "tandem-vault-master-key" for v in vault["volumes"])

    scheduler = by_kind["Deployment"]["tandem-scheduler"]
    assert scheduler["spec"]["replicas"] == 1 and scheduler["spec"]["strategy"]["type"] == "Recreate"
    assert scheduler["spec"]["template"]["spec"]["serviceAccountName"] == "tandem-scheduler"
    scheduler_config = by_kind["ConfigMap"]["tandem-scheduler-config"]["data"]
    assert scheduler_config["TANDEM_SCHEDULER_KUBERNETES__IMAGE"].split(":")[-1] in ("dev", "0.1.0")
    assert by_kind["ServiceAccount"][scheduler_config["TANDEM_SCHEDULER_KUBERNETES__SERVICE_ACCOUNT"]]
    role = by_kind["Role"]["tandem-scheduler"]
    granted = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert {"create", "delete", "get", "list", "patch"} <= granted[("batch", "jobs")]
    assert {"create", "delete"} <= granted[("", "services")] and {"get"} <= granted[("", "pods/log")]
    assert {"deletecollection", "list"} <= granted[("", "pods")]
    cluster_rules = by_kind["ClusterRole"]["tandem-scheduler"]["rules"]
    assert any("priorityclasses" in rule["resources"] and "create" in rule["verbs"] for rule in cluster_rules)
    for binding in (*by_kind["RoleBinding"].values(), *by_kind["ClusterRoleBinding"].values()):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "tandem-scheduler", "namespace": namespace}
        ]
    assert set(by_kind["PriorityClass"]) == {
        "tandem-low",
        "tandem-normal",
        "tandem-high",
        "tandem-critical",
        "tandem-preemptible",
    }


JOB_PEERS = ("tandem-vault", "tandem-scheduler", "tandem-taskapp-proxy", "tandem-events")  # what a job calls


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_task_pods_reach_only_dns_and_the_services_a_job_calls(overlay: Path) -> None:
    from services.scheduler.backends.kubernetes import MANAGED_BY  # noqa: PLC0415

    objects = render(overlay)
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {MANAGED_BY: "tandem"}}, "selects the backend's task pods"
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"] and not spec.get("ingress")
    dns, *services = spec["egress"]
    assert dns["to"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
        }
    ]
    assert sorted((p["port"], p["protocol"]) for p in dns["ports"]) == [(53, "TCP"), (53, "UDP")]
    reached = {}
    for rule in services:
        (peer,) = rule["to"]
        assert set(peer) == {"podSelector"}, "only pods of this namespace"
        (port,) = rule["ports"]
        matched = [
            name
            for name, d in deployments.items()
            if peer["podSelector"]["matchLabels"].items()
            <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matched) == 1, peer
        reached[matched[0]] = (port["port"], port["protocol"])
    assert reached == {name: (SERVICES[name][1], "TCP") for name in JOB_PEERS}, "never the gateway"
    scheduler_config = next(o for o in objects if o["metadata"]["name"] == "tandem-scheduler-config")["data"]
    assert scheduler_config["TANDEM_SCHEDULER_KUBERNETES__NETWORK_POLICY"] == "true"
    role = next(o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == "tandem-scheduler")
    assert any(
        r["apiGroups"] == ["networking.k8s.io"]
        and r["resources"] == ["networkpolicies"]
        and "create" in r["verbs"]
        for r in role["rules"]
    )


def test_the_deployed_priority_classes_are_the_backends_bands() -> None:
    from services.scheduler.backends.kubernetes import PREEMPTIBLE_BAND, PRIORITY_BANDS  # noqa: PLC0415

    deployed = {o["metadata"]["name"]: o for o in load_documents(KUBE / "base" / "priorityclasses.yaml")}
    bands = (*PRIORITY_BANDS, PREEMPTIBLE_BAND)
    assert {band.name: band.value for band in bands} == {n: o["value"] for n, o in deployed.items()}
    assert all(o["preemptionPolicy"] == "Never" for o in deployed.values())


def test_production_scales_only_the_gateway() -> None:
    deployments = {
        o["metadata"]["name"]: o
        for o in render(KUBE / "overlays" / "production")
        if o["kind"] == "Deployment"
    }
    replicas = {name: o["spec"]["replicas"] for name, o in deployments.items()}
    assert replicas == {
        "tandem-gateway": 3,
        "tandem-taskapp-proxy": 1,
        "tandem-vault": 1,
        "tandem-scheduler": 1,
        "tandem-events": 1,
    }
    gateway = deployments["tandem-gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["resources"]["requests"]["cpu"] == "500m"


def test_the_renderer_applies_json_patches_as_specified() -> None:
    obj: Obj = {"a": {"b": [1, 2]}, "c": 1}
    ops: list[Obj] = [
        {"op": "add", "path": "/a/b/-", "value": 3},
        {"op": "replace", "path": "/c", "value": 2},
        {"op": "remove", "path": "/a/b/0"},
        {"op": "add", "path": "/d~1e", "value": {}},
    ]
    assert json_patch(obj, ops) == {"a": {"b": [2, 3]}, "c": 2, "d/e": {}}
    with pytest.raises(AssertionError):
        json_patch(obj, [{"op": "replace", "path": "/missing", "value": 1}])
    assert _set_image("ghcr.io/x/y:latest", {"name": "ghcr.io/x/y", "newTag": "1"}) == "ghcr.io/x/y:1"
    assert _set_image("registry:5000/x:1", {"name": "registry:5000/x", "newName": "r/x"}) == "r/x:1"


# -- Dockerfiles -------------------------------------------------------------------------------------------

INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
    "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER",
}  # fmt: skip
DOCKERFILES = sorted((ROOT / "deploy" / "docker").glob("*.Dockerfile"))


def instructions(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) with comments dropped and continuation lines joined."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        word, _, rest = pending.partition(" ")
        result.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, f"{path.name}: a continuation line runs off the end"
    return result


def test_there_are_service_and_trainer_images() -> None:
    assert [p.name for p in DOCKERFILES] == ["services.Dockerfile", "trainer.Dockerfile"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_parses_and_copies_what_exists(path: Path) -> None:
    steps = instructions(path)
    assert steps[0][0] in ("FROM", "ARG")
    assert all(word in INSTRUCTIONS for word, _ in steps), [w for w, _ in steps if w not in INSTRUCTIONS]
    ignore = path.with_name(path.name + ".dockerignore")
    assert ignore.exists(), "a per-Dockerfile .dockerignore keeps the context small"
    allowed = {
        line.lstrip("!").rstrip("/") for line in ignore.read_text().splitlines() if line.startswith("!")
    }
    for word, args in steps:
        if word not in ("COPY", "ADD"):
            continue
        parts = [p for p in shlex.split(args) if not p.startswith("--")]
        if args.startswith("--from="):
            continue  # from an earlier stage, not the context
        *sources, _destination = parts
        for source in sources:
            assert (ROOT / source).exists(), f"{path.name}: COPY source {source} is not in the repository"
            assert source.split("/")[0] in allowed, f"{path.name}: {source} is excluded by {ignore.name}"
    users = [args for word, args in steps if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the image runs as a non-root user"


def test_the_services_image_installs_no_ml_extra() -> None:
    runs = " ".join(
        args for word, args in instructions(ROOT / "deploy/docker/services.Dockerfile") if word == "RUN"
    )
    assert "pip install ." in runs and "[gpu]" not in runs and "[cpu]" not in runs and "torch" not in runs
    trainer = " ".join(args for word, args in instructions(ROOT / "deploy/docker/trainer.Dockerfile"))
    assert "nvidia/cuda" in trainer and ".[gpu,storage]" in trainer  # storage: bucket mounts in the task


def test_slurm_scripts_are_shell_scripts_that_need_postgresql() -> None:
    script = (ROOT / "deploy/slurm/tandem-services.sh").read_text()
    assert script.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in script
    assert "TANDEM_STORE_URL" in script and "postgresql://" in script
    sbatch = (ROOT / "deploy/slurm/tandem-services.sbatch").read_text()
    assert "#SBATCH --job-name=tandem-services" in sbatch and "tandem-services.sh" in sbatch
    example = (ROOT / "deploy/slurm/tandem.env.example").read_text()
    for line in example.splitlines():
        if line and not line.startswith("#"):
            assert re.match(r"^TANDEM_[A-Z_]+=", line), line

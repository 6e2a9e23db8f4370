"""A task's Kubernetes pod settings from SkyPilot's `config.kubernetes.pod_config`: the fields a task may not
set (`pod_config_problems`: they would reach past its organization, or undo what Tandem's Job needs) and
SkyPilot's merge of a partial Pod into the one the backend builds (`merge_pod`).

Plain data in, plain data out: the spec's checks (services/scheduler/task_config.py) and the Kubernetes
backend share these, and nothing here imports protobuf or the Kubernetes client.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any

Json = dict[str, Any]

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
RESERVED_PREFIXES = ("tandem.dev/", "app.kubernetes.io/", "kueue.x-k8s.io/")  # Tandem's labels, Kueue's own

# Kubernetes' list maps: merged item by item by this key; None: replaced whole (SkyPilot's merge keys).
_MERGE_KEYS: dict[str, str | None] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "resourceClaims": "name",
    "env": "name",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "ports": "containerPort",
    "volumeDevices": "devicePath",
    "claims": "name",
    "args": None,
    "command": None,
    "imagePullSecrets": None,
}
# The volume sources a pod's own: scratch space, its own claim, facts about itself. Any other reaches what
# the namespace holds for every organization's jobs (its Secrets, ConfigMaps, claims), or the node.
_VOLUME_SOURCES = ("name", "emptyDir", "ephemeral", "downwardAPI")
_VOLUME_REFUSED = {
    "hostPath": "mounts a folder of the node, where other organizations' tasks run; mount the deployment's "
    "volumes with the task's volumes",
    "secret": "mounts a Secret of the namespace, which other organizations' jobs share; a task's secrets are "
    "its vault secrets (secrets:)",
    "projected": "mounts Secrets, ConfigMaps or a service account token of the namespace",
    "persistentVolumeClaim": "mounts a claim of the namespace, which other organizations' jobs share; mount "
    "the deployment's volumes with the task's volumes",
}
_VOLUME_OTHER = (
    "is a volume source reaching past the pod (the namespace's objects, the node, a network store); a task "
    "mounts emptyDir, ephemeral and downwardAPI volumes here, and the deployment's volumes with its volumes"
)
_CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
_POD_TOP = ("apiVersion", "kind", "metadata", "spec")
# Pod fields a task may not set: each would reach past its organization, or undo what Tandem's Job needs.
_POD_REFUSED = {
    "runtimeClassName": "chooses another container runtime than the one the deployment gave the pods",
    "schedulerName": "hands the pod to another scheduler; placement is Tandem's",
    "imagePullSecrets": "pulls with a Secret of the namespace, which other organizations' jobs share; a "
    "private registry's login is the task's own secrets (SKYPILOT_DOCKER_USERNAME, _PASSWORD, _SERVER)",
    "hostNetwork": "puts the pod on the node's network, beside every other organization's traffic",
    "hostPID": "shows the pod every process of the node",
    "hostIPC": "shares the node's IPC namespace with the pod",
    "hostUsers": "runs the pod in the node's user namespace",
    "serviceAccountName": "gives the pod another identity's rights in the cluster; the task pods run as the "
    "deployment's service account",
    "serviceAccount": "gives the pod another identity's rights in the cluster; the task pods run as the "
    "deployment's service account",
    "automountServiceAccountToken": "gives the pod Kubernetes credentials; a task has no business with the "
    "cluster's API",
    "nodeName": "places the pod itself; placement is the scheduler's (ask with resources)",
    "priorityClassName": "is the job's priority band here; write the job's priority (or resources."
    "priority_class)",
    "restartPolicy": "is Tandem's: a pod that ends is an attempt that ended (the job's recovery restarts it)",
    "subdomain": "names the attempt's own headless Service (SKYPILOT_NODE_IPS)",
    "hostname": "is the rank's name from its Indexed Job",
}
_SECURITY_REFUSED = {
    "privileged": "gives the container the node's devices and every capability",
    "allowPrivilegeEscalation": "lets the container's processes gain more rights than they start with",
    "procMount": "unmasks the node's /proc in the container",
}
_UNCONFINED = "turns off the profile that confines the pod's system calls"


def pod_config_problems(
    pod: Json, allowed_capabilities: Iterable[str] | None = None
) -> list[tuple[str, str]]:
    """(path in the partial Pod, why) for each field that would reach past the task's organization.
    `allowed_capabilities`: the Linux capabilities a container may add (the deployment's setting); None
    leaves them to the backend, which checks them at launch with its setting."""
    found: list[tuple[str, str]] = [
        (key, f"is not a Pod's field Tandem merges (it takes {', '.join(_POD_TOP)})")
        for key in pod
        if key not in _POD_TOP
    ]
    if pod.get("apiVersion", "v1") != "v1" or pod.get("kind", "Pod") != "Pod":
        found.append(("kind", "must be a Pod (apiVersion v1)"))
    found.extend(_pod_metadata_problems(pod.get("metadata")))
    spec = pod.get("spec")
    if spec is None:
        return found
    if not isinstance(spec, dict):
        return [*found, ("spec", "must be an object")]
    for key, why in _POD_REFUSED.items():
        if key in spec and not (key.startswith("host") and spec[key] is False and key != "hostname"):
            found.append((f"spec.{key}", why))
    found.extend(_security_problems(spec.get("securityContext"), "spec.securityContext", pod_level=True))
    volumes = spec.get("volumes")
    for index, volume in enumerate(volumes if isinstance(volumes, list) else []):
        found.extend(
            (f"spec.volumes[{index}].{key}", _VOLUME_REFUSED.get(key, _VOLUME_OTHER))
            for key in (volume if isinstance(volume, dict) else {})
            if key not in _VOLUME_SOURCES
        )
    for kind in _CONTAINER_LISTS:
        found.extend(_container_problems(spec.get(kind), f"spec.{kind}", allowed_capabilities))
    return found


def _pod_metadata_problems(metadata: Any) -> list[tuple[str, str]]:
    if metadata is None:
        return []
    if not isinstance(metadata, dict):
        return [("metadata", "must be an object")]
    found: list[tuple[str, str]] = []
    for key, value in metadata.items():
        if key not in ("labels", "annotations"):
            found.append((f"metadata.{key}", "is Tandem's: a task sets only labels and annotations"))
        elif not isinstance(value, dict):
            found.append((f"metadata.{key}", "must be an object"))
        else:
            found.extend(
                (f"metadata.{key}[{_quoted(k)}]", "is under a prefix Tandem's own labels use")
                for k in value
                if str(k).startswith(RESERVED_PREFIXES)
            )
    return found


def _container_problems(containers: Any, at: str, allowed: Iterable[str] | None) -> list[tuple[str, str]]:
    if containers is None:
        return []
    if not isinstance(containers, list):
        return [(at, "must be a list")]
    found: list[tuple[str, str]] = []
    for index, container in enumerate(containers):
        if not isinstance(container, dict):
            found.append((f"{at}[{index}]", "must be an object"))
            continue
        context = container.get("securityContext")
        found.extend(_security_problems(context, f"{at}[{index}].securityContext", allowed=allowed))
        if "envFrom" in container:
            found.append((f"{at}[{index}].envFrom", _FROM_NAMESPACE))
        env = container.get("env")
        for position, variable in enumerate(env if isinstance(env, list) else []):
            source = variable.get("valueFrom") if isinstance(variable, dict) else None
            if isinstance(source, dict) and source.keys() & {"secretKeyRef", "configMapKeyRef"}:
                found.append((f"{at}[{index}].env[{position}].valueFrom", _FROM_NAMESPACE))
    return found


_FROM_NAMESPACE = (
    "reads a Secret or ConfigMap of the namespace, which other organizations' jobs share; a task's secrets "
    "are its vault secrets (secrets:)"
)


def _security_problems(
    context: Any, at: str, *, pod_level: bool = False, allowed: Iterable[str] | None = None
) -> list[tuple[str, str]]:
    if context is None:
        return []
    if not isinstance(context, dict):
        return [(at, "must be an object")]
    found: list[tuple[str, str]] = []
    for key, why in _SECURITY_REFUSED.items():
        if context.get(key) not in (None, False, "Default"):
            found.append((f"{at}.{key}", why))
    if context.get("runAsNonRoot") is False:
        found.append(
            (f"{at}.runAsNonRoot", "would let the pod run as root; the task pods always run as non-root")
        )
    for key in ("runAsUser", "runAsGroup"):
        if context.get(key) == 0:
            found.append((f"{at}.{key}", "is root; the task pods always run as non-root"))
    for key in ("seccompProfile", "appArmorProfile"):
        profile = context.get(key)
        if isinstance(profile, dict) and profile.get("type") == "Unconfined":
            found.append((f"{at}.{key}", _UNCONFINED))
    windows = context.get("windowsOptions")
    if isinstance(windows, dict) and windows.get("hostProcess"):
        found.append((f"{at}.windowsOptions.hostProcess", "runs the container as a process of the node"))
    capabilities = context.get("capabilities")
    if pod_level or not isinstance(capabilities, dict):
        return found
    return [*found, *_capability_problems(capabilities, f"{at}.capabilities", allowed)]


def _capability_problems(capabilities: Json, at: str, allowed: Iterable[str] | None) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    added = capabilities.get("add") or []
    if not isinstance(added, list):
        return [(f"{at}.add", "must be a list")]
    if allowed is not None:
        permitted = {c.upper().removeprefix("CAP_") for c in allowed}
        for index, capability in enumerate(added):
            name = str(capability).upper().removeprefix("CAP_")
            if name not in permitted:
                found.append(
                    (
                        f"{at}.add[{index}]",
                        f"adds the capability {capability}, which this deployment does not allow (its "
                        f"kubernetes.allowed_capabilities: {', '.join(sorted(permitted)) or 'none'})",
                    )
                )
    return found


def overridden_own_parts(base: Json, override: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(path, why) for each volume and mount of Tandem's pod `base` that `override` would change: those are
    the task's mounts as Tandem made them (read-only where the spec says so), not the task's to rewrite."""
    found: list[tuple[str, str]] = []
    spec = override.get("spec")
    if not isinstance(spec, dict):
        return found
    own_volumes = {v.get("name") for v in base.get("spec", {}).get("volumes", [])}
    volumes = spec.get("volumes")
    for index, volume in enumerate(volumes if isinstance(volumes, list) else []):
        if isinstance(volume, dict) and volume.get("name") in own_volumes:
            found.append((f"spec.volumes[{index}]", f"is Tandem's own volume {volume['name']!r} of the task"))
    containers = spec.get("containers")
    own = base.get("spec", {}).get("containers", [])
    for index, container in enumerate(containers if isinstance(containers, list) else []):
        if not isinstance(container, dict) or not own:
            continue
        same = next((c for c in own if c.get("name") == container.get("name")), None)
        target = same if same is not None or "name" in container else own[0]
        paths = {m.get("mountPath") for m in (target or {}).get("volumeMounts", [])}
        mounts = container.get("volumeMounts")
        for position, mount in enumerate(mounts if isinstance(mounts, list) else []):
            if isinstance(mount, dict) and mount.get("mountPath") in paths:
                found.append(
                    (
                        f"spec.containers[{index}].volumeMounts[{position}]",
                        f"is Tandem's own mount of the task at {mount['mountPath']}",
                    )
                )
    return found


def mismatched_shapes(base: Json, override: Mapping[str, Any], at: str = "") -> list[tuple[str, str]]:
    """(path, why) for each field of `override` whose shape (table, list or value) cannot merge into the one
    `base` has there, as SkyPilot refuses them: a table over a list, a list over a table, a value over
    either (`null`, which clears a field, and the lists replaced whole merge over anything)."""
    found: list[tuple[str, str]] = []
    for key, value in override.items():
        where = f"{at}.{key}" if at else key
        current = base.get(key)
        if value is None or current is None:
            continue
        have, give = _shape(current), _shape(value)
        if have != give and not (give == "a list" and _MERGE_KEYS.get(key, "") is None):
            found.append((where, f"is {have} in the task's pod, and pod_config gives {give}"))
        elif isinstance(value, dict):
            found.extend(mismatched_shapes(current, value, where))
    return found


def _shape(value: Any) -> str:
    return "a table" if isinstance(value, dict) else "a list" if isinstance(value, list) else "a value"


def merge_pod(base: Json, override: Mapping[str, Any]) -> Json:
    """`override` (a partial Pod) merged into a copy of `base` by SkyPilot's rule: objects key by key; in
    Kubernetes' list maps (`containers`, `volumes`, `env`, ... by `name`; `volumeMounts` by `mountPath`)
    an item with the key of one in `base` is merged into it, others appended, and a container without a
    name merges into the first; `command`, `args` and `imagePullSecrets` are replaced whole; other lists
    appended to; `null` clears a field."""
    out = copy.deepcopy(base)
    _merge(out, copy.deepcopy(dict(override)))
    return out


def _merge(base: Json, override: Mapping[str, Any]) -> None:
    for key, value in override.items():
        current = base.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            _merge(current, value)
        elif isinstance(value, list) and isinstance(current, list) and _MERGE_KEYS.get(key, "") is not None:
            by = _MERGE_KEYS.get(key)
            for item in value:
                name = item.get(by) if by and isinstance(item, dict) else None
                same = next((c for c in current if isinstance(c, dict) and c.get(by) == name), None)
                if name is not None and same is not None:
                    _merge(same, item)
                elif name is None and key == "containers" and current and isinstance(item, dict):
                    _merge(current[0], item)
                else:
                    current.append(item)
        else:
            base[key] = value


def _quoted(key: object) -> str:
    return json.dumps(str(key))

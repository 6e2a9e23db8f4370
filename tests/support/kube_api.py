"""A stand-in for the Kubernetes API server, for testing the Kubernetes backend where no cluster can run.

`FakeKubeApi` is a small HTTP server on 127.0.0.1 that answers the REST paths the official `kubernetes`
client calls for the backend, with the API server's JSON shapes and status codes:

    /apis/batch/v1/namespaces/{ns}/jobs[/{name}]             list (labelSelector), create, get, delete
    /api/v1/namespaces/{ns}/services[/{name}]                list, create, get, delete
    /api/v1/namespaces/{ns}/secrets[/{name}]                 list, create, get, delete (image pull Secrets)
    /api/v1/namespaces/{ns}/pods[/{name}]                    list (labelSelector), get, delete, deletecollection
    /api/v1/namespaces/{ns}/pods/{name}/log                  the pod's log as text
    /api/v1/pods, /api/v1/nodes                              list (fieldSelector on status.phase)
    /apis/scheduling.k8s.io/v1/priorityclasses[/{name}]      list, create, get
    /apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies[/{name}]  list, create, get, delete
    /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices[/{name}]    list, create, get, patch, delete

Objects live in memory. Every created object is checked against the Kubernetes OpenAPI schema with
`kubernetes-validate` (422 Invalid when it fails, as a real API server refuses it), names are unique per
namespace (409 AlreadyExists), missing objects answer 404 NotFound. Creating a Job also does the Job
controller's first step: one Pending pod per completion index, labelled and annotated as Kubernetes does
(`batch.kubernetes.io/job-completion-index`, `job-name`, the template's labels), its hostname
`<job>-<index>` whatever the template says. Deleting a Job deletes its pods and the objects it owns at once
(the garbage collector, without its delay: an object with several owners goes with the last of them); each
delete's options are kept in `deletions` so tests can check the propagation policy and grace period.

It is not a cluster: nothing schedules pods. Tests move a Job through its life with hooks (`start_job`,
`finish_job`, `evict_pod`, `set_log`, `remove_job`, `refuse_next_create`, `add_node`, `stop`). With
`run_pods=True` it also plays the kubelet: each pod's command runs as a local process with the pod's
environment (downward-API fields resolved), its output is the pod log and its exit code the container's,
and deleting a pod signals the process (SIGTERM, SIGKILL after the grace period). That mode backs the
`kube_backend` fixture, which the shared backend conformance suite can use: the backend code is the one
that runs against a real cluster, pointed here by a normal client `Configuration(host=...)`.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import pytest
from kubernetes import client as k8s

from services.scheduler.backends.kubernetes import KubernetesBackend

Json = dict[str, Any]
SCHEMA_VERSION = "1.35.0"  # the Kubernetes version whose OpenAPI schemas objects are checked against
INDEX = "batch.kubernetes.io/job-completion-index"

_KINDS = {  # plural -> (kind, apiVersion, namespaced)
    "jobs": ("Job", "batch/v1", True),
    "services": ("Service", "v1", True),
    "secrets": ("Secret", "v1", True),
    "pods": ("Pod", "v1", True),
    "nodes": ("Node", "v1", False),
    "priorityclasses": ("PriorityClass", "scheduling.k8s.io/v1", False),
    "networkpolicies": ("NetworkPolicy", "networking.k8s.io/v1", True),
    "endpointslices": ("EndpointSlice", "discovery.k8s.io/v1", True),
}
_PATH = re.compile(
    r"^/(?:api/v1|apis/batch/v1|apis/scheduling\.k8s\.io/v1|apis/networking\.k8s\.io/v1"
    r"|apis/discovery\.k8s\.io/v1)"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[a-z]+)(?:/(?P<name>[^/]+))?(?P<log>/log)?$"
)


def validate(obj: Mapping[str, Any], version: str = SCHEMA_VERSION) -> None:
    """Raise kubernetes_validate.ValidationError when `obj` does not match its kind's schema (strict: no
    unknown fields)."""
    kubernetes_validate.validate(dict(obj), version, strict=True)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _split_selector(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [p.strip() for p in [*parts, current] if p.strip()]


def matches_labels(labels: Mapping[str, str], selector: str) -> bool:
    """Kubernetes label selector semantics: `a=b`, `a==b`, `a!=b`, `a`, `!a`, `a in (x,y)`, `a notin (x)`."""
    for term in _split_selector(selector):
        if found := re.match(r"^(\S+)\s+(in|notin)\s+\((.*)\)$", term):
            key, op, values = found.group(1), found.group(2), {v.strip() for v in found.group(3).split(",")}
            if (op == "in") != (labels.get(key) in values):
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _field(obj: Json, path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part, {}) if isinstance(value, dict) else {}
    return "" if value == {} else str(value)


def matches_fields(obj: Json, selector: str) -> bool:
    for term in _split_selector(selector):
        if "!=" in term:
            path, value = term.split("!=", 1)
            if _field(obj, path) == value:
                return False
        elif "=" in term:
            path, value = term.replace("==", "=").split("=", 1)
            if _field(obj, path) != value:
                return False
    return True


class FakeKubeApi:
    """See the module docstring."""

    def __init__(self, *, run_pods: bool = False, schema_version: str = SCHEMA_VERSION) -> None:
        self.run_pods = run_pods
        self.schema_version = schema_version
        self.objects: dict[tuple[str, str, str], Json] = {}  # (plural, namespace or "", name) -> object
        self.logs: dict[tuple[str, str], bytes] = {}  # (namespace, pod) -> log
        self.deletions: list[tuple[str, str, Json]] = []  # (plural, name, delete options)
        self.patches: list[tuple[str, str, Any]] = []  # (plural, name, JSON Patch or merge patch)
        self._lost: dict[tuple[str, str], int] = {}  # (namespace, job) -> pods deleted before they ended
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.created: list[Json] = []  # every object the client created, as sent
        self._refusals: list[str] = []
        self._forbidden: set[str] = set()
        self._lock = threading.RLock()
        self._versions = itertools.count(1)
        self._processes: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        if run_pods:  # the machine itself is the one node the pods run on
            memory_kib = (
                next(
                    (
                        int(line.split()[1])
                        for line in Path("/proc/meminfo").read_text().splitlines()
                        if line.startswith("MemTotal:")
                    ),
                    8 * 2**20,
                )
                if Path("/proc/meminfo").exists()
                else 8 * 2**20
            )
            self.add_node("localhost", cpus=os.cpu_count() or 1, memory_gib=max(1, memory_kib // 2**20))

    # -- lifetime -------------------------------------------------------------------------------------------

    def start(self) -> FakeKubeApi:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                api._handle(self, "GET")

            def do_POST(self) -> None:
                api._handle(self, "POST")

            def do_DELETE(self) -> None:
                api._handle(self, "DELETE")

            def do_PATCH(self) -> None:
                api._handle(self, "PATCH")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-kube-api", daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def configuration(self) -> k8s.Configuration:
        """A normal client configuration pointing at this server (no retries, so a stopped server fails fast)."""
        configuration = k8s.Configuration()
        configuration.host = self.url
        configuration.retries = False
        return configuration

    def stop(self) -> None:
        """Stop answering: the API server is unreachable from now on (connections are refused)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for process in list(self._processes.values()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        for process in list(self._processes.values()):
            process.wait(timeout=10)
        self._processes.clear()

    # -- hooks ----------------------------------------------------------------------------------------------

    def job(self, namespace: str, name: str) -> Json:
        return self.objects[("jobs", namespace, name)]

    def pods(self, namespace: str, job: str) -> dict[int, Json]:
        with self._lock:
            return {
                int(pod["metadata"]["labels"][INDEX]): pod
                for (plural, ns, _), pod in self.objects.items()
                if plural == "pods" and ns == namespace and pod["metadata"]["labels"].get("job-name") == job
            }

    def start_job(self, namespace: str, name: str, node: str = "node-a") -> None:
        """Every pod of the Job is scheduled on `node` and running."""
        with self._lock:
            for rank, pod in self.pods(namespace, name).items():
                pod["spec"]["nodeName"] = node
                pod["status"].update(
                    phase="Running",
                    podIP=f"10.1.0.{rank + 10}",
                    containerStatuses=[self._container_status(pod, {"running": {"startedAt": _now()}})],
                )
            job = self.job(namespace, name)
            job["status"].update(active=len(self.pods(namespace, name)), startTime=_now())

    def finish_job(self, namespace: str, name: str, exit_codes: Mapping[int, int] | None = None) -> None:
        """Every pod ends, rank r with `exit_codes[r]` (default 0); the Job completes or fails as the Job
        controller would with backoffLimit 0."""
        codes = dict(exit_codes or {})
        with self._lock:
            for rank, pod in self.pods(namespace, name).items():
                self._terminate(pod, codes.get(rank, 0))
            self._settle(namespace, name)

    def evict_pod(self, namespace: str, name: str, rank: int, reason: str = "Evicted", by: str = "") -> None:
        """The pod of `rank` is evicted (reason `Evicted`) or preempted (`Preempting`), with the
        DisruptionTarget condition Kubernetes adds (reason `by`, e.g. `DeletionByPodGC` when its node is
        gone); the Job fails."""
        with self._lock:
            pod = self.pods(namespace, name)[rank]
            by = by or ("PreemptionByScheduler" if reason == "Preempting" else "TerminationByKubelet")
            pod["status"].update(
                reason=reason,
                message=f"The pod was {'preempted' if reason == 'Preempting' else 'evicted'}",
                conditions=[{"type": "DisruptionTarget", "status": "True", "reason": by, "message": reason}],
            )
            self._terminate(pod, 137)
            self._settle(namespace, name)

    def fail_job(self, namespace: str, name: str, reason: str, message: str) -> None:
        """The Job controller fails the Job itself (e.g. `DeadlineExceeded`) and stops its pods."""
        with self._lock:
            for pod in self.pods(namespace, name).values():
                self._terminate(pod, 137)
            job = self.job(namespace, name)
            job["status"].update(active=0, failed=len(self.pods(namespace, name)))
            job["status"]["conditions"] = [
                {"type": "Failed", "status": "True", "reason": reason, "message": message}
            ]

    def forbid(self, plural: str) -> None:
        """Every request on `plural` (e.g. "priorityclasses") answers 403 Forbidden, as RBAC would."""
        self._forbidden.add(plural)

    def set_log(self, namespace: str, job: str, rank: int, text: str) -> None:
        with self._lock:
            pod = self.pods(namespace, job)[rank]
            self.logs[(namespace, pod["metadata"]["name"])] = text.encode()

    def remove_job(self, namespace: str, name: str) -> None:
        """The Job and its pods disappear without the backend asking (someone ran kubectl delete)."""
        with self._lock:
            self._delete("jobs", namespace, name, {})

    def refuse_next_create(self, message: str) -> None:
        """The next create answers 422 Invalid with `message`, as an admission webhook or a policy would."""
        self._refusals.append(message)

    def add_node(
        self,
        name: str,
        *,
        gpus: int = 0,
        cpus: int = 8,
        memory_gib: int = 32,
        labels: Mapping[str, str] | None = None,
        ready: bool = True,
    ) -> None:
        allocatable = {"cpu": str(cpus), "memory": f"{memory_gib}Gi", "pods": "110"}
        if gpus:
            allocatable["nvidia.com/gpu"] = str(gpus)
        with self._lock:
            self.objects[("nodes", "", name)] = self._stamp(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": name, "labels": dict(labels or {})},
                    "spec": {},
                    "status": {
                        "allocatable": allocatable,
                        "capacity": dict(allocatable),
                        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                        "addresses": [{"type": "InternalIP", "address": f"10.0.0.{len(self.objects) % 250}"}],
                    },
                }
            )

    # -- the HTTP side --------------------------------------------------------------------------------------

    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        url = urlsplit(request.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(request.headers.get("Content-Length") or 0)
        body = json.loads(request.rfile.read(length)) if length else {}
        self.requests.append((method, url.path))
        if method == "PATCH":
            kind = request.headers.get("Content-Type", "")
            if isinstance(body, list) != (kind == "application/json-patch+json"):
                return self._reply(
                    request, 415, _status(415, "UnsupportedMediaType", f"{kind} with this body")
                )
        found = _PATH.match(url.path)
        if not found or found.group("plural") not in _KINDS:
            return self._reply(request, 404, _status(404, "NotFound", f"no route for {url.path}"))
        plural, name = found.group("plural"), found.group("name")
        if plural in self._forbidden:
            return self._reply(request, 403, _status(403, "Forbidden", f"{plural} is forbidden"))
        namespace = found.group("ns") or ""
        with self._lock:
            code, answer = self._route(method, plural, namespace, name, bool(found.group("log")), query, body)
        if isinstance(answer, bytes):
            return self._reply(request, code, answer, "text/plain")
        return self._reply(request, code, answer)

    def _reply(self, request: BaseHTTPRequestHandler, code: int, answer: Any, kind: str = "") -> None:
        data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        request.send_response(code)
        request.send_header("Content-Type", kind or "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def _route(
        self, method: str, plural: str, ns: str, name: str | None, log: bool, query: Json, body: Json
    ) -> tuple[int, Any]:
        kind, api_version, _ = _KINDS[plural]
        if log:
            if ("pods", ns, name or "") not in self.objects:
                return 404, _status(404, "NotFound", f'pods "{name}" not found')
            return 200, self.logs.get((ns, name or ""), b"")
        if plural == "jobs" and method == "GET":  # the Job controller notices deadlines when asked
            for key in [k for k in self.objects if k[0] == "jobs" and (not ns or k[1] == ns)]:
                self._check_deadline(key[1], key[2])
        if method == "GET" and name is None:
            items = [
                copy.deepcopy(obj)
                for (p, o_ns, _), obj in sorted(self.objects.items())
                if p == plural
                and (not ns or o_ns == ns)
                and matches_labels(obj["metadata"].get("labels") or {}, query.get("labelSelector", ""))
                and matches_fields(obj, query.get("fieldSelector", ""))
            ]
            metadata = {"resourceVersion": str(next(self._versions))}
            return 200, {
                "kind": f"{kind}List",
                "apiVersion": api_version,
                "metadata": metadata,
                "items": items,
            }
        if method == "GET":
            obj = self.objects.get((plural, ns, name or ""))
            if obj is None:
                return 404, _status(404, "NotFound", f'{plural} "{name}" not found')
            return 200, copy.deepcopy(obj)
        if method == "POST":
            return self._create(plural, ns, body)
        if method == "PATCH" and name is not None:
            return self._patch(plural, ns, name, body)
        if method == "DELETE":
            return self._remove(plural, ns, name, query, body)
        return 405, _status(405, "MethodNotAllowed", method)

    def _patch(self, plural: str, ns: str, name: str, body: Any) -> tuple[int, Json]:
        """A JSON Patch (RFC 6902: a list of operations) or a merge patch (RFC 7386: an object)."""
        obj = self.objects.get((plural, ns, name))
        if obj is None:
            return 404, _status(404, "NotFound", f'{plural} "{name}" not found')
        self.patches.append((plural, name, copy.deepcopy(body)))
        patched = copy.deepcopy(obj)
        if isinstance(body, list):
            try:
                _json_patch(patched, body)
            except (KeyError, IndexError, ValueError, TypeError) as error:
                return 422, _status(422, "Invalid", f"the patch does not apply: {error!r}")
        else:
            _merge(patched, body)
        try:  # the patched object must still be a valid one (its status aside: some kinds have none)
            validate({k: v for k, v in patched.items() if k != "status"}, self.schema_version)
        except kubernetes_validate.ValidationError as error:
            return 422, _status(422, "Invalid", f"{obj.get('kind')} is invalid: {error.message}")
        obj.clear()
        obj.update(patched)
        obj["metadata"]["resourceVersion"] = str(next(self._versions))
        if plural == "jobs":
            self._check_deadline(ns, name)
        return 200, copy.deepcopy(obj)

    def _remove(self, plural: str, ns: str, name: str | None, query: Json, body: Json) -> tuple[int, Json]:
        """DELETE of one object or, without a name, of every object the label selector matches."""
        grace = query.get("gracePeriodSeconds")
        options = {**body, **({"gracePeriodSeconds": int(grace)} if grace is not None else {})}
        if name is None:
            selector = query.get("labelSelector", "")
            doomed = [
                n
                for (p, o_ns, n), obj in self.objects.items()
                if p == plural
                and o_ns == ns
                and matches_labels(obj["metadata"].get("labels") or {}, selector)
            ]
            for doomed_name in doomed:
                self._delete(plural, ns, doomed_name, options)
            kind, api_version, _ = _KINDS[plural]
            return 200, {"kind": f"{kind}List", "apiVersion": api_version, "metadata": {}, "items": []}
        if (plural, ns, name) not in self.objects:
            return 404, _status(404, "NotFound", f'{plural} "{name}" not found')
        self._delete(plural, ns, name, options)
        return 200, _status(200, "", "deleted", "Success")

    def _create(self, plural: str, ns: str, body: Json) -> tuple[int, Json]:
        if self._refusals:
            message = self._refusals.pop(0)
            return 422, _status(422, "Invalid", message)
        try:
            validate(body, self.schema_version)
        except kubernetes_validate.ValidationError as error:
            return 422, _status(422, "Invalid", f"{body.get('kind')} is invalid: {error.message}")
        name = body.get("metadata", {}).get("name", "")
        if (plural, ns, name) in self.objects:
            return 409, _status(409, "AlreadyExists", f'{plural} "{name}" already exists')
        self.created.append(copy.deepcopy(body))
        obj = self._stamp(copy.deepcopy(body), ns)
        obj.setdefault("status", {})
        self.objects[(plural, ns, name)] = obj
        if plural == "jobs":
            self._make_pods(obj)
        return 201, copy.deepcopy(obj)

    def _stamp(self, obj: Json, ns: str = "") -> Json:
        metadata = obj.setdefault("metadata", {})
        metadata.setdefault("uid", str(uuid.uuid4()))
        metadata["resourceVersion"] = str(next(self._versions))
        metadata.setdefault("creationTimestamp", _now())
        if ns:
            metadata["namespace"] = ns
        return obj

    # -- the controllers' part ------------------------------------------------------------------------------

    def _make_pods(self, job: Json) -> None:
        ns, name, uid = job["metadata"]["namespace"], job["metadata"]["name"], job["metadata"]["uid"]
        template = job["spec"]["template"]
        for rank in range(int(job["spec"].get("completions") or 1)):
            labels = {
                **(template.get("metadata", {}).get("labels") or {}),
                "batch.kubernetes.io/controller-uid": uid,
                "batch.kubernetes.io/job-name": name,
                "controller-uid": uid,
                "job-name": name,
                INDEX: str(rank),
            }
            annotations = {**(template.get("metadata", {}).get("annotations") or {}), INDEX: str(rank)}
            pod_name = f"{name}-{rank}-{uuid.uuid4().hex[:5]}"
            spec = copy.deepcopy(template["spec"])
            spec["hostname"] = f"{name}-{rank}"
            pod = self._stamp(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": pod_name,
                        "labels": labels,
                        "annotations": annotations,
                        "ownerReferences": [
                            {
                                "apiVersion": "batch/v1",
                                "kind": "Job",
                                "name": name,
                                "uid": uid,
                                "controller": True,
                            }
                        ],
                    },
                    "spec": spec,
                    "status": {"phase": "Pending"},
                },
                ns,
            )
            self.objects[("pods", ns, pod_name)] = pod
            job["status"].setdefault("startTime", _now())
            if self.run_pods:
                self._run(pod)

    def _container_status(self, pod: Json, state: Json) -> Json:
        container = pod["spec"]["containers"][0]
        return {
            "name": container["name"],
            "image": container["image"],
            "imageID": "",
            "ready": "running" in state,
            "restartCount": 0,
            "state": state,
        }

    def _terminate(self, pod: Json, code: int) -> None:
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "finishedAt": _now()}
        pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
        pod["status"]["containerStatuses"] = [self._container_status(pod, {"terminated": terminated})]

    def _settle(self, ns: str, name: str) -> None:
        """The Job controller's verdict from its pods (backoffLimit 0: one failed pod fails the Job)."""
        job = self.objects.get(("jobs", ns, name))
        if job is None:
            return
        pods = list(self.pods(ns, name).values())
        phases = [pod["status"].get("phase") for pod in pods]
        status = job["status"]
        status.update(
            active=sum(p in ("Pending", "Running") for p in phases),
            succeeded=phases.count("Succeeded"),
            failed=phases.count("Failed") + self._lost.get((ns, name), 0),
        )
        if status.get("conditions"):
            return
        if status["failed"]:
            reason = "BackoffLimitExceeded"
            message = "Job has reached the specified backoff limit"
            status["conditions"] = [
                {"type": "FailureTarget", "status": "True", "reason": reason, "message": message},
                {"type": "Failed", "status": "True", "reason": reason, "message": message},
            ]
            for pod in pods:  # the controller stops the ranks still running
                if pod["status"].get("phase") in ("Pending", "Running"):
                    self._kill(ns, pod["metadata"]["name"], 0)
        elif status["succeeded"] == int(job["spec"].get("completions") or 1):
            status["conditions"] = [
                {"type": "SuccessCriteriaMet", "status": "True", "reason": "CompletionsReached"},
                {"type": "Complete", "status": "True", "reason": "CompletionsReached"},
            ]
            status["completionTime"] = _now()

    def _check_deadline(self, ns: str, name: str) -> None:
        """activeDeadlineSeconds: past it, the Job fails with DeadlineExceeded and its pods are stopped."""
        job = self.objects.get(("jobs", ns, name))
        if job is None or job["status"].get("conditions"):
            return
        deadline, started = job["spec"].get("activeDeadlineSeconds"), job["status"].get("startTime")
        if deadline is None or started is None:
            return
        elapsed = (
            datetime.now(UTC) - datetime.strptime(started, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
        ).total_seconds()
        if elapsed < int(deadline):
            return
        message = "Job was active longer than specified deadline"
        job["status"]["conditions"] = [
            {"type": "FailureTarget", "status": "True", "reason": "DeadlineExceeded", "message": message},
            {"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": message},
        ]
        grace = int(job["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30))
        for pod in list(self.pods(ns, name).values()):
            if pod["status"].get("phase") in ("Pending", "Running"):
                self._delete("pods", ns, pod["metadata"]["name"], {"gracePeriodSeconds": grace})

    def _delete(self, plural: str, ns: str, name: str, options: Json) -> None:
        obj = self.objects.pop((plural, ns, name), None)
        if obj is None:
            return
        self.deletions.append((plural, name, options))
        if plural == "pods":
            self._kill(ns, name, int(options.get("gracePeriodSeconds", 30)))
            job = obj["metadata"]["labels"].get("job-name", "")
            if (
                obj["status"].get("phase") not in ("Succeeded", "Failed")
                and ("jobs", ns, job) in self.objects
            ):
                self._lost[(ns, job)] = self._lost.get((ns, job), 0) + 1  # a deleted running pod failed
                self._settle(ns, job)
        uid = obj["metadata"]["uid"]
        alive = {other["metadata"]["uid"] for other in self.objects.values()}
        owned = [  # the garbage collector removes a dependent once none of its owners is left
            key
            for key, other in self.objects.items()
            if any(ref.get("uid") == uid for ref in other["metadata"].get("ownerReferences") or [])
            and not any(ref.get("uid") in alive for ref in other["metadata"]["ownerReferences"])
        ]
        for key in owned:
            self._delete(key[0], key[1], key[2], {"propagationPolicy": "garbage collector"})

    # -- the kubelet's part (run_pods=True) -----------------------------------------------------------------

    def _run(self, pod: Json) -> None:
        container = pod["spec"]["containers"][0]
        rank = pod["metadata"]["annotations"][INDEX]
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH", "TMPDIR")}
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = item["value"]
            else:
                path = item["valueFrom"]["fieldRef"]["fieldPath"]
                env[item["name"]] = rank if INDEX in path else "127.0.0.1"
        command = list(container["command"])
        if command[0] == "python":
            command[0] = sys.executable
        workdir = container.get("workingDir")
        process = subprocess.Popen(
            command,
            env=env,
            cwd=workdir if workdir and Path(workdir).is_dir() else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self._processes[(ns, name)] = process
        pod["spec"]["nodeName"] = "localhost"
        pod["status"].update(
            phase="Running",
            podIP="127.0.0.1",
            containerStatuses=[self._container_status(pod, {"running": {"startedAt": _now()}})],
        )
        threading.Thread(target=self._watch, args=(ns, name, pod, process), daemon=True).start()

    def _watch(self, ns: str, name: str, pod: Json, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for line in iter(process.stdout.readline, b""):
            with self._lock:
                self.logs[(ns, name)] = self.logs.get((ns, name), b"") + line
        code = process.wait()
        with self._lock:
            self._processes.pop((ns, name), None)
            self._terminate(pod, code if code >= 0 else 128 - code)
            self._settle(ns, pod["metadata"]["labels"]["job-name"])

    def _kill(self, ns: str, name: str, grace_s: int) -> None:
        process = self._processes.get((ns, name))
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)

        def hard_kill() -> None:
            deadline = time.monotonic() + grace_s
            while process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

        threading.Thread(target=hard_kill, daemon=True).start()


def _json_patch(target: Json, operations: list[Json]) -> None:
    """RFC 6902 add / replace / remove on objects (what the backend sends)."""
    for operation in operations:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"][1:].split("/")]
        node: Any = target
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        value = copy.deepcopy(operation.get("value"))
        if isinstance(node, list):  # an index, or `-` past the end
            index = len(node) if last == "-" else int(last)
            if operation["op"] == "add":
                node.insert(index, value)
            elif operation["op"] == "replace":
                node[index] = value
            elif operation["op"] == "remove":
                del node[index]
            else:
                raise ValueError(f"unsupported op {operation['op']}")
        elif operation["op"] in ("add", "replace"):
            if operation["op"] == "replace" and last not in node:
                raise KeyError(operation["path"])
            node[last] = value
        elif operation["op"] == "remove":
            del node[last]
        else:
            raise ValueError(f"unsupported op {operation['op']}")


def _merge(target: Json, patch: Json) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def _status(code: int, reason: str, message: str, status: str = "Failure") -> Json:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": status,
        "message": message,
        "reason": reason,
        "code": code,
    }


def make_backend(api: FakeKubeApi, **options: Any) -> KubernetesBackend:
    """A KubernetesBackend talking to `api` through a normal client configuration."""
    settings: Json = {"namespace": "tandem-jobs", "image": "tandem-trainer:test", "log_refresh_s": 0.0}
    settings.update(options)
    return KubernetesBackend(configuration=api.configuration(), **settings)


@contextlib.contextmanager
def running_kube_api(*, run_pods: bool = False) -> Iterator[FakeKubeApi]:
    """A started FakeKubeApi, stopped on exit."""
    api = FakeKubeApi(run_pods=run_pods).start()
    try:
        yield api
    finally:
        api.stop()


@contextlib.asynccontextmanager
async def kubernetes_backend(**options: Any) -> AsyncIterator[tuple[KubernetesBackend, FakeKubeApi]]:
    """The backend against a stand-in API server that runs each pod's command locally."""
    with running_kube_api(run_pods=True) as api:
        backend = make_backend(api, **options)
        try:
            yield backend, api
        finally:
            await backend.close()


@pytest.fixture
def kube_api() -> Iterator[FakeKubeApi]:
    """A stand-in API server whose pods change state only through its hooks."""
    with running_kube_api() as api:
        yield api


@pytest.fixture
async def kube_backend() -> AsyncIterator[KubernetesBackend]:
    """The Kubernetes backend against a stand-in API server that runs each pod's command locally (ranks as
    local processes): the fixture the shared backend conformance suite can take."""
    async with kubernetes_backend() as (backend, _api):
        yield backend

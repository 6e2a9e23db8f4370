"""Inference on a trained checkpoint: an inference worker per checkpoint, started on first use through the
scheduler as a SERVICE job of the checkpoint's organization, and calls relayed to its OpenAI-compatible
endpoint.

The worker job is `orgs/{org}/jobs/infer-<hash of the checkpoint>`: one task running
`python -m trainer.inference.worker` on the checkpoint folder, whose service port is the worker's HTTP
port (readiness: `GET /health`). The scheduler reports the task's `endpoint` once it is ready; until
then a call fails with UNAVAILABLE / DEPENDENCY_UNAVAILABLE and a RetryInfo. A worker with no generation for
`TANDEM_GATEWAY_INFER_IDLE_S` (15 minutes) exits, and its job SUCCEEDS; a worker job that ended is replaced by
a new one on the next call (one whose worker failed, at most once a minute).

Each checkpoint's worker wants a key of its own, so another process on its host cannot use it behind the
gateway's back. The key is derived from the deployment's signing seed and the checkpoint's name (every
gateway replica, and a restarted one, knows it without storing it), uploaded sealed to the organization's
vault as the secret `infer-<hash>` and bound to the task as `INFERENCE_WORKER_KEY`: the task opens it at
run time with its job token, so the job record, and every `GetJob` / `ListJobs` answer, holds only the
secret's name. The task's envs name the checkpoint and its step (`INFERENCE_CHECKPOINT`,
`INFERENCE_CHECKPOINT_STEP`), which is how `ListInferenceWorkers` finds the workers among the jobs; the
worker reports the step as its weight version. `GET /health` of a worker tells how long it has been idle.

Shortcuts: the worker runs the gateway's own Python on the scheduler's default backend with the CPU torch
engine, so the checkpoint folder must be readable where the job runs (the `local` backend, or shared
storage); it listens on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import shlex
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

from google.protobuf import duration_pb2
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.inference.v1 import generation_pb2
from tandem.scheduler.v1 import job_pb2, job_spec_pb2
from tandem.trainer.v1 import checkpoint_pb2

from gateway.httpinput import DIGITS
from mesh.errors import FailedPrecondition, InvalidArgument, NotFound, R, Unavailable

WORKER_TASK = "worker"
KEY_ENV = "INFERENCE_WORKER_KEY"  # the secret's variable (TANDEM_* are the scheduler's); the run script passes it on
CHECKPOINT_ENV = "INFERENCE_CHECKPOINT"
STEP_ENV = "INFERENCE_CHECKPOINT_STEP"
STARTING_RETRY_S = 5.0
FAILED_RETRY_S = 60.0
READINESS_TIMEOUT_S = 600
_TERMINAL = {job_pb2.Job.STATE_SUCCEEDED, job_pb2.Job.STATE_FAILED, job_pb2.Job.STATE_CANCELLED}
ACTIVE = frozenset(
    {
        job_pb2.Job.STATE_PENDING,
        job_pb2.Job.STATE_STARTING,
        job_pb2.Job.STATE_RUNNING,
        job_pb2.Job.STATE_RECOVERING,
    }
)
FINISH = {
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}

GetJob = Callable[[str], Awaitable[job_pb2.Job | None]]
CreateJob = Callable[[str, str, job_spec_pb2.JobSpec], Awaitable[job_pb2.Job]]
Post = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def checkpoint_path(checkpoint: checkpoint_pb2.Checkpoint) -> str:
    parsed = urlparse(checkpoint.uri)
    if parsed.scheme not in ("", "file"):
        raise FailedPrecondition(
            f"{checkpoint.name} is stored at {parsed.scheme}://, which workers cannot load yet",
            reason=R.ERROR_REASON_FAILED_PRECONDITION,
        )
    return unquote(parsed.path)


def worker_key(seed: bytes, checkpoint: str) -> str:
    """The key the worker serving `checkpoint` wants: an HMAC of its name under the deployment's seed."""
    digest = hmac.new(seed, b"tandem inference worker\x00" + checkpoint.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def key_secret(checkpoint: str) -> str:
    """The id of the vault secret holding that key, in the checkpoint's organization."""
    return worker_job_id(checkpoint)


def worker_spec(
    checkpoint: checkpoint_pb2.Checkpoint, idle_exit_s: float = 0.0, python: str = sys.executable
) -> job_spec_pb2.JobSpec:
    """The one-task SERVICE job that serves `checkpoint`, exiting after `idle_exit_s` without a call (0: never).
    Its key arrives as the secret `key_secret(checkpoint.name)`, never in the spec."""
    model = checkpoint_path(checkpoint)
    exports = {
        "TANDEM_WORKER_MODEL_PATH": model,
        "TANDEM_WORKER_MODEL_ID": checkpoint.name,
        "TANDEM_WORKER_IDLE_EXIT_S": f"{idle_exit_s:g}",
        "TANDEM_WORKER_WEIGHT_VERSION": str(checkpoint.step),
    }
    lines = [f"export {k}={shlex.quote(v)}" for k, v in exports.items()]
    lines.append('export TANDEM_WORKER_HTTP_PORT="$TANDEM_SERVICE_PORT"')
    lines.append(f'export TANDEM_WORKER_OPENAI_API_KEY="${KEY_ENV}"')
    lines.append(f"exec {shlex.quote(python)} -m trainer.inference.worker")
    task = job_spec_pb2.TaskSpec(
        name=WORKER_TASK,
        kind=job_spec_pb2.TaskSpec.KIND_SERVICE,
        role=job_spec_pb2.TaskSpec.ROLE_PRIMARY,
        run="\n".join(lines),
        envs={CHECKPOINT_ENV: checkpoint.name, STEP_ENV: str(checkpoint.step)},
        secrets=[job_spec_pb2.SecretBinding(secret=key_secret(checkpoint.name), env=KEY_ENV)],
        # The checkpoint folder, read-only: a task in a sandbox sees no other job's folders but those it mounts.
        file_mounts=[job_spec_pb2.FileMount(path=model, local_path=model, read_only=True)],
        service=job_spec_pb2.ServiceOptions(
            port=free_port(),
            health_path="/health",
            readiness_timeout=duration_pb2.Duration(seconds=READINESS_TIMEOUT_S),
        ),
    )
    return job_spec_pb2.JobSpec(
        display_name=f"inference {checkpoint.name}"[:128],
        execution=job_spec_pb2.JobSpec.EXECUTION_PARALLEL,
        tasks=[task],
    )


def worker_job_id(checkpoint: str) -> str:
    return "infer-" + hashlib.sha256(checkpoint.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Endpoint:
    """A ready worker: its OpenAI-compatible base URL and the key it wants as `Authorization: Bearer`."""

    base_url: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}


@dataclass
class _Started:
    job: str
    at: float
    checkpoint: checkpoint_pb2.Checkpoint


class Workers:
    """Where each checkpoint's worker is, starting it when there is none."""

    def __init__(self, key_seed: bytes, idle_exit_s: float = 0.0) -> None:
        self._key_seed = key_seed
        self._idle_exit_s = idle_exit_s
        self._jobs: dict[str, _Started] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def key(self, checkpoint: str) -> str:
        """The key of the worker serving `checkpoint` (the value its vault secret holds)."""
        return worker_key(self._key_seed, checkpoint)

    def forget(self, checkpoint: str) -> None:
        """Drop what this gateway knows of `checkpoint`'s worker (it was stopped): the next call starts one."""
        self._jobs.pop(checkpoint, None)

    def served(self, org: str) -> list[checkpoint_pb2.Checkpoint]:
        """The checkpoints of `org` this gateway has started workers for."""
        return [s.checkpoint for name, s in self._jobs.items() if name.split("/")[1] == org]

    async def endpoint(
        self, checkpoint: checkpoint_pb2.Checkpoint, get_job: GetJob, create_job: CreateJob
    ) -> Endpoint:
        """The base URL of a ready worker serving `checkpoint`; UNAVAILABLE with a retry delay until then."""
        lock = self._locks.setdefault(checkpoint.name, asyncio.Lock())
        async with lock:  # concurrent first calls start one worker, not one each
            return await self._endpoint(checkpoint, get_job, create_job)

    async def _endpoint(
        self, checkpoint: checkpoint_pb2.Checkpoint, get_job: GetJob, create_job: CreateJob
    ) -> Endpoint:
        org = checkpoint.name.split("/")[1]
        known = self._jobs.get(checkpoint.name)
        name = known.job if known else f"orgs/{org}/jobs/{worker_job_id(checkpoint.name)}"
        job = await get_job(name)
        if job is not None and job.state in _TERMINAL:
            if (
                job.state == job_pb2.Job.STATE_FAILED
                and known is not None
                and time.time() - known.at < FAILED_RETRY_S
            ):
                raise Unavailable(
                    f"the inference worker for {checkpoint.name} failed: {job.failure.message}",
                    reason=R.ERROR_REASON_DEPENDENCY_UNAVAILABLE,
                    retry_after_s=FAILED_RETRY_S,
                )
            name = f"{name.rsplit('/', 1)[0]}/{worker_job_id(checkpoint.name)}-{int(time.time()) % 100000}"
            job = None
        if job is None:
            job = await create_job(org, name.rsplit("/", 1)[1], worker_spec(checkpoint, self._idle_exit_s))
            self._jobs[checkpoint.name] = _Started(job.name, time.time(), checkpoint)
        else:
            self._jobs.setdefault(checkpoint.name, _Started(job.name, time.time(), checkpoint))
        for task in job.tasks:
            if task.task == WORKER_TASK and task.endpoint and job.state == job_pb2.Job.STATE_RUNNING:
                return Endpoint(task.endpoint.rstrip("/"), self.key(checkpoint.name))
        raise Unavailable(
            f"an inference worker for {checkpoint.name} is starting ({job_pb2.Job.State.Name(job.state)})",
            reason=R.ERROR_REASON_DEPENDENCY_UNAVAILABLE,
            retry_after_s=STARTING_RETRY_S,
        )


def served_checkpoint(job: job_pb2.Job) -> tuple[str, int] | None:
    """(checkpoint, step) when `job` is an inference worker job of `worker_spec`, else None."""
    if not job.name.rsplit("/", 1)[-1].startswith("infer-"):
        return None
    for task in job.spec.tasks:
        bound = {binding.env for binding in task.secrets}
        if task.name == WORKER_TASK and CHECKPOINT_ENV in task.envs and KEY_ENV in bound:
            step = task.envs.get(STEP_ENV, "0")
            return task.envs[CHECKPOINT_ENV], int(step) if DIGITS.fullmatch(step) else 0
    return None


def endpoint_of(job: job_pb2.Job) -> str:
    """The worker's base URL once the scheduler reports it ready; empty before."""
    for task in job.tasks:
        if task.task == WORKER_TASK and task.endpoint and job.state == job_pb2.Job.STATE_RUNNING:
            return str(task.endpoint.rstrip("/"))
    return ""


def worker_resource(job: job_pb2.Job, health: dict[str, Any] | None) -> pb.InferenceWorker:
    """The InferenceWorker of a worker job, with the idle clock from the worker's `GET /health` answer."""
    served = served_checkpoint(job)
    checkpoint, step = served if served else ("", 0)
    worker = pb.InferenceWorker(job=job.name, checkpoint=checkpoint, step=step, state=job.state)
    if health is not None and isinstance(health.get("idle_s"), int | float):
        idle = float(health["idle_s"])
        worker.idle.FromNanoseconds(int(idle * 1e9))
        limit = health.get("idle_exit_s")
        if isinstance(limit, int | float) and limit > 0:
            worker.idle_left.FromNanoseconds(int(max(float(limit) - idle, 0.0) * 1e9))
    return worker


def openai_body(request: pb.InferRequest, model: str) -> tuple[str, dict[str, Any]]:
    """The OpenAI-compatible route and body of an Infer request."""
    body: dict[str, Any] = {"model": model}
    sampling = request.sampling
    if sampling.HasField("temperature"):
        body["temperature"] = sampling.temperature
    if sampling.HasField("top_p"):
        body["top_p"] = sampling.top_p
    if sampling.top_k:
        body["top_k"] = sampling.top_k
    if sampling.min_p:
        body["min_p"] = sampling.min_p
    if sampling.max_tokens:
        body["max_tokens"] = sampling.max_tokens
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.HasField("seed"):
        body["seed"] = sampling.seed
    if request.messages:
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
        return "/v1/chat/completions", body
    body["prompt"] = request.prompt
    return "/v1/completions", body


def infer_response(answer: dict[str, Any], checkpoint: checkpoint_pb2.Checkpoint) -> pb.InferResponse:
    choice = (answer.get("choices") or [{}])[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("message") or {}).get("content", "")
    usage = answer.get("usage") or {}
    extra = answer.get("tandem") or {}
    response = pb.InferResponse(
        text=str(text),
        token_ids=[int(t) for t in extra.get("completion_token_ids", [])],
        finish_reason=FINISH.get(str(choice.get("finish_reason")), generation_pb2.FINISH_REASON_UNSPECIFIED),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        model=checkpoint.name,
    )
    response.policy_version.job = checkpoint.name.split("/checkpoints/")[0]
    response.policy_version.weight_version = int(extra.get("weight_version", 0))
    return response


def worker_error(status: int, answer: dict[str, Any]) -> Exception:
    """A worker's error answer as a domain error."""
    error = answer.get("error") or {}
    message = str(error.get("message", f"the inference worker answered HTTP {status}"))
    code = str(error.get("code", ""))
    if code == "context_length_exceeded" or "CONTEXT_LENGTH" in code.upper():
        return InvalidArgument(message, reason=R.ERROR_REASON_CONTEXT_LENGTH_EXCEEDED)
    if status == 404:
        return NotFound(message, reason=R.ERROR_REASON_CHECKPOINT_NOT_FOUND)
    if 400 <= status < 500:
        return InvalidArgument(message)
    return Unavailable(message, reason=R.ERROR_REASON_DEPENDENCY_UNAVAILABLE, retry_after_s=STARTING_RETRY_S)

"""Inference on a trained checkpoint: an inference worker per checkpoint, started on first use through the
scheduler as a SERVICE job of the checkpoint's organization, and calls relayed to its OpenAI-compatible
endpoint.

The worker job is `orgs/{org}/jobs/infer-<hash of the checkpoint>`: one task running
`python -m trainer.inference.worker` on the checkpoint folder, whose service port is the worker's HTTP
port (readiness: `GET /health`). The scheduler reports the task's `endpoint` once it is ready; until
then a call fails with UNAVAILABLE / DEPENDENCY_UNAVAILABLE and a RetryInfo. A worker with no generation for
`TANDEM_GATEWAY_INFER_IDLE_S` (15 minutes) exits, and its job SUCCEEDS; a worker job that ended is replaced by
a new one on the next call (one whose worker failed, at most once a minute).

Each worker job gets a key of its own (`INFERENCE_WORKER_KEY` in the task's envs, read back from the
job record, so a restarted gateway still has it); the worker refuses calls without it, so another process on
its host cannot use it behind the gateway's back. Anyone who can read the job (the organization) can read
the key, which gives no more than Infer does.

Shortcuts: the worker runs the gateway's own Python on the scheduler's default backend with the CPU torch
engine, so the checkpoint folder must be readable where the job runs (the `local` backend, or shared
storage); it listens on loopback.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
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

from mesh.errors import FailedPrecondition, InvalidArgument, NotFound, R, Unavailable

WORKER_TASK = "worker"
KEY_ENV = "INFERENCE_WORKER_KEY"  # TANDEM_* envs are the scheduler's; the run script passes it on
STARTING_RETRY_S = 5.0
FAILED_RETRY_S = 60.0
READINESS_TIMEOUT_S = 600
_TERMINAL = {job_pb2.Job.STATE_SUCCEEDED, job_pb2.Job.STATE_FAILED, job_pb2.Job.STATE_CANCELLED}
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


def worker_spec(
    checkpoint: checkpoint_pb2.Checkpoint, idle_exit_s: float = 0.0, python: str = sys.executable
) -> job_spec_pb2.JobSpec:
    """The one-task SERVICE job that serves `checkpoint`, exiting after `idle_exit_s` without a call (0: never)."""
    exports = {
        "TANDEM_WORKER_MODEL_PATH": checkpoint_path(checkpoint),
        "TANDEM_WORKER_MODEL_ID": checkpoint.name,
        "TANDEM_WORKER_IDLE_EXIT_S": f"{idle_exit_s:g}",
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
        envs={KEY_ENV: secrets.token_urlsafe(32)},
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

    def __init__(self, idle_exit_s: float = 0.0) -> None:
        self._idle_exit_s = idle_exit_s
        self._jobs: dict[str, _Started] = {}
        self._locks: dict[str, asyncio.Lock] = {}

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
                spec = next((t for t in job.spec.tasks if t.name == WORKER_TASK), None)
                return Endpoint(task.endpoint.rstrip("/"), spec.envs.get(KEY_ENV, "") if spec else "")
        raise Unavailable(
            f"an inference worker for {checkpoint.name} is starting ({job_pb2.Job.State.Name(job.state)})",
            reason=R.ERROR_REASON_DEPENDENCY_UNAVAILABLE,
            retry_after_s=STARTING_RETRY_S,
        )


def openai_body(request: pb.InferRequest, model: str) -> tuple[str, dict[str, Any]]:
    """The OpenAI-compatible route and body of an Infer request."""
    body: dict[str, Any] = {"model": model}
    sampling = request.sampling
    if sampling.HasField("temperature"):
        body["temperature"] = sampling.temperature
    if sampling.HasField("top_p"):
        body["top_p"] = sampling.top_p
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

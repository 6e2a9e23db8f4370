"""`TorchEngine`: batched generation with torch + transformers, for CPU workers and small GPU models.

Load a local Hugging Face directory and generate:

    engine = await TorchEngine.load("/path/to/model")           # config.json, *.safetensors, tokenizer
    async for item in engine.generate(engine.render(messages, {}), Sampling(temperature=0.7)):
        ...                                                      # TokenChunk per token, then one Finished

**Batching.** One scheduler task owns the model. Each step it admits queued generations (FIFO, up to
`max_batch` in flight; the rest wait), runs one forward pass for every generation in flight on the engine's
single worker thread (so the event loop stays responsive), samples one token per generation and pushes a
chunk to each one's queue. `engine.stats.batch_sizes` counts the steps by how many generations they
advanced, which is how a test or an operator sees that concurrent requests share forward passes.

**KV cache, kept exact as generations join and leave.** The batch keeps one `DynamicCache` whose rows are
left-padded: each row holds [padding][every token of its generation but the newest], real tokens contiguous,
with a 2D attention mask and per-row position ids, the layout Hugging Face's own `generate` uses. A step
feeds each cached row its newest token (decode); a generation that joins is prefilled on its own in the
same step (prompt plus any completion so far, left-padded with the other joiners) and its cache rows are
merged in, the shorter side padded on the left. A finished generation's row is dropped at the next step,
and leading columns that became padding in every row are trimmed. A weight commit drops the whole cache,
so every token after a commit is computed from the new weights alone (the in-flight generations are
prefilled again). That is what makes an in-flight update exact: staging and receiving touch nothing in
service, so generation runs on during the transfer, and after the commit each generation in flight is
prefilled (prompt plus completion so far) with the new weights and continues from there, its next tokens
tagged with the new version. Costs: a join costs one prefill of the joiners plus a copy of the cache (the
merge); a leave costs a copy. Models whose cache is not made of plain full-attention layers (sliding windows,
linear attention) are detected after the first forward and served by recomputing every sequence in full
each step: exact, quadratic in length. Padding makes a batched row's logits differ from a solo run's in
the last float bits (~1e-5 here), as in every batched engine; only a near-tie can tip greedy one way.

**Sampling**, per generation on its own `torch.Generator` (seeded by `Sampling.seed`, else at random):
temperature 0 is greedy (argmax, ties to the lowest id) and reports the log-softmax of the raw logits;
otherwise logits / temperature, then min-p, top-k and top-p as `trainer/sampling.py` defines them (the
function the trainer scores with), and the reported log-prob of a token and its `top_logprobs` candidates
are from that renormalised distribution. Candidates outside the nucleus (log-prob -inf) are left out, so a chunk
may list fewer than `top_logprobs` of them.

**Ending.** EOS (the tokenizer's, plus any in the model's `generation_config`) and `stop_token_ids` end a
generation with "stop"; the token stays in `token_ids` but its text is left out, as vLLM does. A stop
string ends it with "stop" when the decoded completion contains one; the text ends before it, the tokens
that formed it stay. "length" when `max_tokens` or the context is reached. Text is the whole completion
decoded again each step (special tokens skipped), emitting the new suffix: exact across multi-byte
characters, linear in the completion's length per step. Trailing U+FFFD (an incomplete UTF-8 sequence)
and, with stop strings, the last `len(longest stop) - 1` characters are held back until they are settled,
so no chunk ever carries text that is later cut.

**Errors.** `generate` checks the request eagerly, when called: `PromptTooLong` (the prompt fills the
context) and `EngineError` (empty prompt, unknown token id, bad sampling values) are raised before any
iterator exists. Closing the iterator early (the caller cancelled) drops the generation at the next step.
`close()` ends every pending generation with `EngineError`.

**Weights.** `manifest()` lists the model's `state_dict()` in order, each tensor once: a tensor shared by
two names (tied embeddings: `lm_head.weight` is `model.embed_tokens.weight`) is listed under its first
name, which is the one Hugging Face checkpoints store; the alias is not a name an update may use. For the
Llama and Qwen2 families the state dict names are the checkpoint names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from trainer.inference import delta
from trainer.inference.engine import (
    Engine,
    EngineError,
    EngineInfo,
    Finished,
    FinishReason,
    Generation,
    LoraMismatch,
    ManifestMismatch,
    ModelLoadError,
    PauseMode,
    PromptTooLong,
    Sampling,
    TensorMeta,
    TokenChunk,
)
from trainer.inference.weights import dtype_name, dtype_of, manifest_of, manifest_problems, tensor_checksum
from trainer.sampling import truncated

log = logging.getLogger(__name__)

_QueueItem = TokenChunk | Finished | BaseException


@dataclass
class EngineStats:
    """Counters of the scheduler's work since load; read them from the event loop."""

    steps: int = 0  # forward steps run (each samples one token for every generation it advanced)
    batch_sizes: Counter[int] = field(default_factory=Counter)  # generations advanced by a step -> steps
    prefill_tokens: int = 0  # tokens fed to prefills: new generations, and everything after a weight commit
    decode_tokens: int = 0  # tokens fed one per cached row
    generations: int = 0  # generations admitted to the batch

    @property
    def max_batch_seen(self) -> int:
        return max(self.batch_sizes, default=0)


@dataclass(eq=False)
class _Sequence:
    """One generation. Mutated by the worker thread during a step, by the event loop between steps."""

    prompt: list[int]
    sampling: Sampling
    max_new: int
    stop_ids: frozenset[int]
    generator: torch.Generator
    queue: asyncio.Queue[_QueueItem] = field(default_factory=asyncio.Queue)
    tokens: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of text sent so far
    first_version: int | None = None
    last_version: int = 0
    done: bool = False
    cancelled: bool = False

    @property
    def holdback(self) -> int:
        return max((len(s) for s in self.sampling.stop), default=1) - 1


@dataclass
class _Sampled:
    seq: _Sequence
    token: int
    logprob: float
    top: list[tuple[int, float]]
    text: str
    finish: FinishReason | None


@dataclass
class _KvBatch:
    """The cached rows: `rows[i]` owns row i of `cache` and `mask` (shape [rows, columns])."""

    rows: list[_Sequence]
    cache: DynamicCache
    mask: torch.Tensor


class TorchEngine(Engine):
    """A Hugging Face causal LM in service; see the module docstring for batching, sampling and weights."""

    in_flight_updates = True  # updates are staged apart from the weights in service and swapped between steps
    delta_updates = True  # a delta is written into the weights in service between two steps
    lora_updates = True  # an adapter is added to the model (peft) and its updates staged and swapped in

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        info: EngineInfo,
        *,
        max_batch: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.info = info
        self.stats = EngineStats()
        self.max_batch = max_batch
        self.eos_token_ids = eos_token_ids
        self._model = model
        self._tokenizer = tokenizer
        self._device = next(model.parameters()).device
        self._vocab_rows = _embedding_rows(model)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_token_ids)
        self._pad_id = int(pad)
        self._served = _distinct_tensors(model.state_dict(keep_vars=True).items())
        self._manifest = manifest_of(self._served.items())
        self._version = 0
        self._staged: dict[str, torch.Tensor] | None = None
        self._lora: Any | None = None  # the LoraAdapterSpec of the adapter added, if any
        self._adapter: dict[str, torch.Tensor] = {}  # its tensors, in peft's saved naming
        self._kv: _KvBatch | None = None  # touched only on the worker thread, or under the step lock
        self._reuse_cache = True
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-engine")
        self._step_lock = asyncio.Lock()
        self._queued: deque[_Sequence] = deque()
        self._active: list[_Sequence] = []
        self._paused = False
        self._pause_mode: PauseMode | None = None
        self._pause_epoch = 0
        self._closed = False
        self._work = asyncio.Event()
        self._changed = asyncio.Event()
        self._scheduler: asyncio.Task[None] | None = None

    # ---- loading --------------------------------------------------------------------------------

    @classmethod
    async def load(
        cls,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        max_batch: int = 32,
        model_id: str | None = None,
    ) -> TorchEngine:
        """Load a local model directory (its tokenizer too, unless `tokenizer_path` names another) on
        `device`, in `dtype` (default: the checkpoint's). Raises `ModelLoadError` when the directory, its
        config or its safetensors weights are missing, either fails to load, or the tokenizer does not fit
        the model (more tokens than embedding rows, or no EOS token).

        A LoRA checkpoint (a folder with peft's `adapter_config.json` and no `config.json`: what a job in
        LoRA mode saves) is served as its base model, the config's `base_model_name_or_path`, with the
        adapter in it; its own tokenizer files come first."""
        adapter = _saved_adapter(model_path)
        base_path = model_path if adapter is None else adapter[0]
        if (
            adapter is not None
            and tokenizer_path is None
            and (Path(model_path) / "tokenizer_config.json").exists()
        ):
            tokenizer_path = model_path
        model, tokenizer, eos = await asyncio.to_thread(_load_parts, base_path, tokenizer_path, device, dtype)
        if adapter is not None:
            await asyncio.to_thread(_load_adapter, model, Path(model_path), adapter[1])
        info = EngineInfo(
            model=model_id or Path(model_path).name,
            model_path=model_path,
            tokenizer=tokenizer_path or model_path,
            max_context_tokens=int(model.config.max_position_embeddings),
            kind="torch",
            engine_version=torch.__version__,
            tensor_parallel_size=1,
            device=str(next(model.parameters()).device),
            dtype=dtype_name(model.dtype),
            vocab_size=_embedding_rows(model),
        )
        engine = cls(model, tokenizer, info, max_batch=max_batch, eos_token_ids=eos)
        if adapter is not None:
            from trainer import lora  # noqa: PLC0415

            engine._lora, engine._adapter = adapter[1], lora.served_adapter(model)
        engine._scheduler = asyncio.create_task(engine._schedule(), name="torch-engine-scheduler")
        return engine

    # ---- state ----------------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    def label_loaded_weights(self, version: int) -> None:
        self._version = version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def pause_mode(self) -> PauseMode | None:
        """The mode of the current pause; None when running."""
        return self._pause_mode

    @property
    def queued(self) -> int:
        """Generations waiting to join the batch (paused, or the batch is full)."""
        return sum(1 for seq in self._queued if not seq.cancelled)

    @property
    def in_flight(self) -> int:
        """Generations in the batch (frozen ones included while paused in KEEP mode)."""
        return sum(1 for seq in self._active if not seq.cancelled and not seq.done)

    # ---- text -----------------------------------------------------------------------------------

    def render(self, messages: Sequence[Mapping[str, str]], template_kwargs: Mapping[str, Any]) -> list[int]:
        """The tokenizer's chat template with `add_generation_prompt=True` (whatever `template_kwargs` say),
        encoded without adding special tokens the template did not write."""
        kwargs = {**template_kwargs, "add_generation_prompt": True}
        try:
            text = self._tokenizer.apply_chat_template(
                [dict(message) for message in messages], tokenize=False, **kwargs
            )
        except (ValueError, TypeError) as exc:
            raise EngineError(f"cannot render the chat template: {exc}") from exc
        if not isinstance(text, str):
            raise EngineError("the chat template did not render to text")
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, adding no BOS or other special tokens (special tokens written in the text, such
        as `<|im_end|>`, are still recognised)."""
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, special tokens skipped (as in generated text)."""
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=True)
        if not isinstance(text, str):
            raise TypeError("the tokenizer decoded one sequence to several texts")
        return text

    # ---- generation -----------------------------------------------------------------------------

    def generate(self, prompt_token_ids: Sequence[int], sampling: Sampling) -> Generation:
        """Check the request now (raising `PromptTooLong` or `EngineError`), and return the stream; the
        generation joins the queue when the stream is first iterated."""
        if self._closed:
            raise EngineError("the engine is closed")
        prompt = [int(token) for token in prompt_token_ids]
        context = self.info.max_context_tokens
        if not prompt:
            raise EngineError("the prompt is empty")
        if len(prompt) >= context:
            raise PromptTooLong(len(prompt), context)
        if min(prompt) < 0 or max(prompt) >= self._vocab_rows:
            raise EngineError(f"the prompt holds a token id outside the vocabulary [0, {self._vocab_rows})")
        problem = _sampling_problem(sampling)
        if problem:
            raise EngineError(problem)
        room = context - len(prompt)
        seq = _Sequence(
            prompt=prompt,
            sampling=sampling,
            max_new=min(sampling.max_tokens, room) if sampling.max_tokens else room,
            stop_ids=self.eos_token_ids | frozenset(sampling.stop_token_ids),
            generator=torch.Generator(device=self._device).manual_seed(
                sampling.seed if sampling.seed is not None else secrets.randbits(63)
            ),
        )
        return self._stream(seq)

    async def _stream(self, seq: _Sequence) -> AsyncIterator[TokenChunk | Finished]:
        if self._closed:
            raise EngineError("the engine is closed")
        self._queued.append(seq)
        self._work.set()
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            if not seq.done:
                seq.cancelled = True
                with contextlib.suppress(ValueError):
                    self._queued.remove(seq)
                self._notify()

    # ---- pause ----------------------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> tuple[int, int]:
        """Stop admitting generations, then per `mode`: KEEP freezes those in flight after the current step
        (returns (0, kept)); WAIT lets them run and returns (0, 0) once none is left (or the pause changes
        mode or ends meanwhile); ABORT ends them after the current step with "abort" (returns (aborted, 0)),
        sending any text still held back in a last chunk without tokens. Generations queued (the batch was
        full) or started while paused wait for `resume`. Pausing a paused engine switches mode: ABORT after
        KEEP aborts the frozen generations, WAIT after KEEP lets them finish."""
        if self._closed:
            raise EngineError("the engine is closed")
        self._paused = True
        self._pause_mode = mode
        self._pause_epoch += 1
        epoch = self._pause_epoch
        self._work.set()
        self._notify()
        if mode is PauseMode.WAIT:
            while self.in_flight and self._pause_epoch == epoch and not self._closed:
                await self._changed.wait()
            return 0, 0
        async with self._step_lock:
            live = [seq for seq in self._active if not seq.cancelled and not seq.done]
            if mode is PauseMode.KEEP:
                return 0, len(live)
            if self._pause_epoch != epoch:
                return 0, 0  # a later pause or a resume came first and decides
            for seq in live:
                self._finish_aborted(seq)
            self._active.clear()
            self._kv = None
            self._notify()
            return len(live), 0

    async def resume(self) -> None:
        """Run again: frozen generations continue and queued ones join."""
        self._paused = False
        self._pause_mode = None
        self._pause_epoch += 1
        self._work.set()
        self._notify()

    def _finish_aborted(self, seq: _Sequence) -> None:
        seq.done = True
        rest = self.decode(seq.tokens)[seq.emitted :]
        if rest:
            seq.queue.put_nowait(TokenChunk([], [], rest, weight_version=seq.last_version))
        first = seq.first_version if seq.first_version is not None else self._version
        last = seq.last_version if seq.first_version is not None else self._version
        seq.queue.put_nowait(Finished("abort", len(seq.prompt), len(seq.tokens), first, last))

    # ---- weights --------------------------------------------------------------------------------

    def manifest(self) -> list[TensorMeta]:
        return list(self._manifest)

    def _stage_buffers(self, manifest: Sequence[TensorMeta]) -> Mapping[str, torch.Tensor]:
        self._staged = {
            meta.name: torch.empty(meta.shape, dtype=dtype_of(meta.dtype), device=self._device)
            for meta in manifest
        }
        return dict(self._staged)

    def tensor_names(self) -> set[str]:
        return {*self._served, *self._adapter}

    def stage_update(self, manifest: Sequence[TensorMeta]) -> Mapping[str, torch.Tensor]:
        """Fresh contiguous buffers for `manifest`, replacing any update staged before."""
        problems = manifest_problems(manifest, self._manifest)
        if problems:
            raise ManifestMismatch(problems)
        return self._stage_buffers(manifest)

    async def commit_update(self, version: int) -> None:
        """Copy the staged tensors into the model between two steps and serve them as `version`; the KV
        cache is dropped so later tokens are computed from the new weights alone."""
        staged = self._staged
        if staged is None:
            raise EngineError("no weight update is staged")
        loop = asyncio.get_running_loop()
        async with self._step_lock:
            await loop.run_in_executor(self._executor, self._load_staged, staged)
            if self._staged is staged:  # not replaced by a stage_update meanwhile
                self._staged = None
            self._version = version

    def _load_staged(self, staged: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in staged.items():
                target = self._served.get(name)
                (self._adapter[name] if target is None else target).copy_(tensor)
        self._kv = None

    async def stage_lora(self, manifest: Sequence[TensorMeta], spec: Any) -> Mapping[str, torch.Tensor]:
        """The first adds the adapter (peft's LoRA layers around the target modules, B zero, in the served
        dtype) between two steps; every one stages fresh buffers for the adapter's tensors."""
        from trainer import lora  # noqa: PLC0415  # peft is imported only by a worker that serves an adapter

        if self._lora is None:
            dtype = next(iter(self._served.values())).dtype
            loop = asyncio.get_running_loop()
            async with self._step_lock:
                try:
                    await loop.run_in_executor(self._executor, lora.inject, self._model, spec, dtype)
                except ValueError as exc:
                    raise LoraMismatch(
                        f"the adapter ({lora.describe(spec)}) does not fit the model: {exc}"
                    ) from None
                self._adapter = lora.served_adapter(self._model)
                self._lora = spec
        elif not lora.same_shape(self._lora, spec):
            raise LoraMismatch(
                f"the model serves an adapter of {lora.describe(self._lora)}, not {lora.describe(spec)}"
            )
        problems = manifest_problems(manifest, lora.manifest_of(self._adapter))
        if problems:
            raise ManifestMismatch(problems)
        return self._stage_buffers(manifest)

    async def commit_delta(
        self,
        version: int,
        manifest: Sequence[TensorMeta],
        changed: Sequence[int],
        wire: Mapping[str, torch.Tensor],
    ) -> str:
        """Write the delta's elements into the weights in service between two steps (the weights are not
        copied: unlike a full update, nothing is staged beside them) and serve them as `version`."""
        touched = [
            (m, c, t, delta.index_of(m, c, t))
            for m, c, t in delta.wire_tensors(manifest, changed, dict(wire))
        ]
        for meta, count, tensors, index in touched:
            delta.check(self._served[meta.name], meta, count, tensors, index)
        loop = asyncio.get_running_loop()
        async with self._step_lock:
            applied = await loop.run_in_executor(self._executor, self._apply_delta, touched)
            self._version = version
        return applied

    def _apply_delta(
        self, touched: Sequence[tuple[TensorMeta, int, Sequence[torch.Tensor], torch.Tensor | None]]
    ) -> str:
        with torch.no_grad():
            for meta, count, tensors, index in touched:
                delta.apply(self._served[meta.name], meta, count, tensors, index)
        self._kv = None
        return delta.digest(delta.read_back(self._served[m.name], m, c, t, i) for m, c, t, i in touched)

    def discard_update(self) -> None:
        self._staged = None

    async def checksums(self, names: Sequence[str]) -> list[tuple[str, str]]:
        """Checksums in manifest order; `ManifestMismatch` for a name the model lacks."""
        held = {**self._served, **self._adapter}
        unknown = sorted(set(names) - held.keys())
        if unknown:
            raise ManifestMismatch([f"{name} is not a tensor of the model" for name in unknown])
        wanted = set(names) or held.keys()
        chosen = [(name, tensor) for name, tensor in held.items() if name in wanted]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, lambda: [(name, tensor_checksum(tensor)) for name, tensor in chosen]
        )

    # ---- lifecycle ------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop the scheduler (after the step in progress) and fail every pending generation."""
        if self._closed:
            return
        self._closed = True
        self._work.set()
        self._notify()
        if self._scheduler is not None:
            await self._scheduler
        async with self._step_lock:
            for seq in [*self._active, *self._queued]:
                if not seq.done:
                    seq.done = True
                    seq.queue.put_nowait(EngineError("the engine is closed"))
            self._active.clear()
            self._queued.clear()
            self._kv = None
            self._staged = None
        self._executor.shutdown(wait=True)

    # ---- the scheduler --------------------------------------------------------------------------

    def _notify(self) -> None:
        """Wake everything waiting for the batch to change (WAIT pauses)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _runnable(self) -> bool:
        stepping = not self._paused or self._pause_mode is PauseMode.WAIT
        if stepping and any(not seq.cancelled for seq in self._active):
            return True
        return not self._paused and any(not seq.cancelled for seq in self._queued)

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            if not self._runnable():
                self._work.clear()
                await self._work.wait()
                continue
            async with self._step_lock:
                if self._closed or not self._runnable():
                    continue
                self._active = [seq for seq in self._active if not seq.cancelled]
                while not self._paused and self._queued and len(self._active) < self.max_batch:
                    seq = self._queued.popleft()
                    if not seq.cancelled:
                        self._active.append(seq)
                        self.stats.generations += 1
                if not self._active:
                    continue
                rows = list(self._active)
                version = self._version
                try:
                    sampled = await loop.run_in_executor(self._executor, self._step, rows)
                except Exception as exc:
                    log.exception("a generation step failed; failing its %d generations", len(rows))
                    self._kv = None
                    for seq in rows:
                        seq.done = True
                        error = EngineError(f"generation failed: {exc}")
                        error.__cause__ = exc
                        seq.queue.put_nowait(error)
                    self._active = []
                else:
                    self._deliver(sampled, version)
                self._notify()
            await asyncio.sleep(0)  # a pause or commit waiting for the lock gets it before the next step

    def _deliver(self, sampled: Sequence[_Sampled], version: int) -> None:
        self.stats.steps += 1
        self.stats.batch_sizes[len(sampled)] += 1
        for out in sampled:
            seq = out.seq
            if seq.first_version is None:
                seq.first_version = version
            seq.last_version = version
            if seq.cancelled:
                continue
            top = [out.top] if seq.sampling.top_logprobs else []
            seq.queue.put_nowait(
                TokenChunk([out.token], [out.logprob], out.text, top, weight_version=version)
            )
            if out.finish is not None:
                seq.done = True
                seq.queue.put_nowait(
                    Finished(out.finish, len(seq.prompt), len(seq.tokens), seq.first_version, version)
                )
        self._active = [seq for seq in self._active if not seq.done and not seq.cancelled]

    # ---- one step, on the worker thread ---------------------------------------------------------

    def _step(self, rows: list[_Sequence]) -> list[_Sampled]:
        with torch.inference_mode():
            logits = self._forward(rows)
            sampled = [self._sample(seq, logits[i]) for i, seq in enumerate(rows)]
        if all(out.finish is not None for out in sampled):
            self._kv = None
        return sampled

    def _forward(self, rows: list[_Sequence]) -> torch.Tensor:
        """Next-token logits (float32, [len(rows), vocab]) for every row, through the KV cache."""
        kv = self._kv
        wanted = set(rows)
        if kv is not None and any(seq not in wanted for seq in kv.rows):
            keep = [i for i, seq in enumerate(kv.rows) if seq in wanted]
            kv = _select_rows(kv, keep) if keep else None
        cached = set(kv.rows) if kv is not None else set()
        joining = [seq for seq in rows if seq not in cached]
        parts: dict[_Sequence, torch.Tensor] = {}
        if kv is not None:
            kv, logits = self._decode(kv)
            parts.update(zip(kv.rows, logits, strict=True))
        if joining:
            fresh, logits = self._prefill(joining)
            parts.update(zip(joining, logits, strict=True))
            if self._reuse_cache and not all(type(layer) is DynamicLayer for layer in fresh.cache.layers):
                log.info("the model's cache is not plain full attention; recomputing sequences each step")
                self._reuse_cache = False
            kv = fresh if kv is None else _merge(kv, fresh)
        self._kv = kv if self._reuse_cache else None
        return torch.stack([parts[seq] for seq in rows]).float()

    def _decode(self, kv: _KvBatch) -> tuple[_KvBatch, torch.Tensor]:
        rows = len(kv.rows)
        tokens = torch.tensor([[seq.tokens[-1]] for seq in kv.rows], device=self._device)
        positions = torch.tensor(
            [[len(seq.prompt) + len(seq.tokens) - 1] for seq in kv.rows], device=self._device
        )
        mask = torch.cat([kv.mask, kv.mask.new_ones(rows, 1)], dim=1)
        out = self._model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=kv.cache,
            use_cache=True,
        )
        self.stats.decode_tokens += rows
        return _KvBatch(kv.rows, out.past_key_values, mask), out.logits[:, -1, :]

    def _prefill(self, rows: list[_Sequence]) -> tuple[_KvBatch, torch.Tensor]:
        sequences = [seq.prompt + seq.tokens for seq in rows]
        width = max(len(tokens) for tokens in sequences)
        ids = torch.tensor([[self._pad_id] * (width - len(s)) + s for s in sequences], device=self._device)
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=self._device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        out = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats.prefill_tokens += sum(len(s) for s in sequences)
        return _KvBatch(rows, out.past_key_values, mask), out.logits[:, -1, :]

    def _sample(self, seq: _Sequence, logits: torch.Tensor) -> _Sampled:
        sampling = seq.sampling
        if sampling.temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            token = int(torch.argmax(logits))
        else:
            scaled = logits / sampling.temperature
            logp = torch.log_softmax(
                truncated(scaled, sampling.top_k, sampling.top_p, sampling.min_p), dim=-1
            )
            token = int(torch.multinomial(logp.exp(), 1, generator=seq.generator))
        top: list[tuple[int, float]] = []
        if sampling.top_logprobs:
            values, ids = logp.topk(min(sampling.top_logprobs, logp.shape[-1]))
            top = [(i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True) if math.isfinite(v)]
        seq.tokens.append(token)
        text, finish = self._advance_text(seq, token)
        return _Sampled(seq, token, float(logp[token]), top, text, finish)

    def _advance_text(self, seq: _Sequence, token: int) -> tuple[str, FinishReason | None]:
        """The text `token` adds to `seq`'s output, and whether `seq` ends with it."""
        finish: FinishReason | None = None
        if token in seq.stop_ids:
            finish = "stop"
            full = self.decode(seq.tokens[:-1])
        else:
            full = self.decode(seq.tokens)
            cut = min(
                (i for i in (full.find(stop) for stop in seq.sampling.stop if stop) if i >= 0), default=-1
            )
            if cut >= 0:
                finish, full = "stop", full[:cut]
            elif len(seq.tokens) >= seq.max_new:
                finish = "length"
        if finish is None:
            settled = full.rstrip("\ufffd")
            end = len(settled) - seq.holdback
        else:
            settled, end = full, len(full)
        if end <= seq.emitted:
            return "", finish
        text = settled[seq.emitted : end]
        seq.emitted = end
        return text, finish


# ---- helpers ------------------------------------------------------------------------------------


def _sampling_problem(sampling: Sampling) -> str:
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0:
        return f"temperature must be a finite number >= 0, not {sampling.temperature}"
    if not 0 < sampling.top_p <= 1:
        return f"top_p must be in (0, 1], not {sampling.top_p}"
    if sampling.top_k < 0:
        return f"top_k must be >= 0, not {sampling.top_k}"
    if not 0 <= sampling.min_p <= 1:
        return f"min_p must be in [0, 1], not {sampling.min_p}"
    if sampling.max_tokens < 0:
        return f"max_tokens must be >= 0, not {sampling.max_tokens}"
    if sampling.top_logprobs < 0:
        return f"top_logprobs must be >= 0, not {sampling.top_logprobs}"
    return ""


def _distinct_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each tensor once, under its first name (a tied alias is skipped)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def _embedding_rows(model: PreTrainedModel) -> int:
    weight = model.get_input_embeddings().weight
    if not isinstance(weight, torch.Tensor):
        raise ModelLoadError("the model's input embeddings have no weight matrix")
    return int(weight.shape[0])


def _cache_layers(cache: DynamicCache) -> list[tuple[DynamicLayer, torch.Tensor, torch.Tensor]]:
    """Each layer of a plain full-attention cache with its keys and values ([rows, heads, columns, dim])."""
    out = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
            raise TypeError("not a plain full-attention cache")
        out.append((layer, layer.keys, layer.values))
    return out


def _select_rows(kv: _KvBatch, keep: list[int]) -> _KvBatch:
    """The rows `keep` of `kv`, without the leading columns that are padding in all of them."""
    index = torch.tensor(keep, dtype=torch.long, device=kv.mask.device)
    mask = kv.mask.index_select(0, index)
    used = mask.any(dim=0).nonzero()
    start = int(used[0]) if len(used) else mask.shape[1]
    for layer, keys, values in _cache_layers(kv.cache):
        layer.keys = keys.index_select(0, index)[:, :, start:, :]
        layer.values = values.index_select(0, index)[:, :, start:, :]
    return _KvBatch([kv.rows[i] for i in keep], kv.cache, mask[:, start:])


def _merge(left: _KvBatch, right: _KvBatch) -> _KvBatch:
    """Both batches in one (left's rows first), the shorter left-padded to the longer's columns."""
    width = max(left.mask.shape[1], right.mask.shape[1])

    def widen(t: torch.Tensor, columns: int, dim_from_end: int) -> torch.Tensor:
        pad = width - columns
        return F.pad(t, (0, 0) * dim_from_end + (pad, 0)) if pad else t

    left_width, right_width = left.mask.shape[1], right.mask.shape[1]
    for (layer, keys, values), (_, their_keys, their_values) in zip(
        _cache_layers(left.cache), _cache_layers(right.cache), strict=True
    ):
        layer.keys = torch.cat([widen(keys, left_width, 1), widen(their_keys, right_width, 1)])
        layer.values = torch.cat([widen(values, left_width, 1), widen(their_values, right_width, 1)])
    mask = torch.cat([widen(left.mask, left_width, 0), widen(right.mask, right_width, 0)])
    return _KvBatch(left.rows + right.rows, left.cache, mask)


def _saved_adapter(model_path: str) -> tuple[str, Any] | None:
    """(base model directory, LoraAdapterSpec) of a saved LoRA adapter folder, or None for a model folder."""
    root = Path(model_path)
    if not (root / "adapter_config.json").is_file() or (root / "config.json").exists():
        return None
    from trainer import lora  # noqa: PLC0415  # peft is imported only by a worker that serves an adapter

    try:
        return lora.read_adapter(root)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None


def _load_adapter(model: PreTrainedModel, folder: Path, spec: Any) -> None:
    """Add the saved adapter at `folder` (of `spec`) to `model`, in the model's dtype."""
    from safetensors.torch import load_file  # noqa: PLC0415

    from trainer import lora  # noqa: PLC0415

    weights_file = folder / lora.ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise ModelLoadError(f"{folder} has no {lora.ADAPTER_WEIGHTS}")
    try:
        lora.inject(model, spec, model.dtype)
    except ValueError as exc:
        raise ModelLoadError(f"the adapter at {folder} does not fit its base model: {exc}") from None
    held = lora.served_adapter(model)
    saved = load_file(str(weights_file))
    problems = manifest_problems(
        lora.manifest_of({k: v.to(model.dtype) for k, v in saved.items()}), lora.manifest_of(held)
    )
    missing = sorted(held.keys() - saved.keys())
    if problems or missing:
        raise ModelLoadError(
            f"{weights_file} is not the adapter its config describes: {(problems or missing)[:3]}"
        )
    with torch.no_grad():
        for name, tensor in saved.items():
            held[name].copy_(tensor)


def _load_parts(
    model_path: str, tokenizer_path: str | None, device: str, dtype: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, frozenset[int]]:
    root = Path(model_path)
    if not root.is_dir():
        raise ModelLoadError(f"no model directory at {model_path}")
    if not (root / "config.json").is_file():
        raise ModelLoadError(f"{model_path} has no config.json")
    if not any(root.glob("*.safetensors")):
        raise ModelLoadError(f"{model_path} has no safetensors weights")
    tokenizer_root = Path(tokenizer_path) if tokenizer_path else root
    if not tokenizer_root.is_dir():
        raise ModelLoadError(f"no tokenizer directory at {tokenizer_root}")
    try:
        torch_dtype = dtype_of(dtype) if dtype else "auto"
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_root), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer at {tokenizer_root}: {exc}") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(root), dtype=torch_dtype, local_files_only=True, use_safetensors=True
        )
        # transformers types `to` through functools.wraps(Module.to), which mypy reads as unbound
        model = model.to(torch.device(device)).eval()  # type: ignore[arg-type]
    except Exception as exc:
        raise ModelLoadError(f"cannot load the model at {model_path}: {exc}") from exc
    rows = _embedding_rows(model)
    if len(tokenizer) > rows:
        raise ModelLoadError(
            f"the tokenizer at {tokenizer_root} has {len(tokenizer)} tokens but the model embeds only {rows}: "
            "they do not belong together"
        )
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"the tokenizer at {tokenizer_root} has no EOS token")
    eos = {int(tokenizer.eos_token_id)}
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        eos.add(configured)
    elif isinstance(configured, list):
        eos.update(int(token) for token in configured)
    if not hasattr(model.config, "max_position_embeddings"):
        raise ModelLoadError(f"{model_path}/config.json does not give max_position_embeddings")
    return model, tokenizer, frozenset(eos)

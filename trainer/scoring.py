"""An update's passes over the model at a real model's scale: the batch's sequences in micro-batches of a token
budget whose gradients accumulate into the whole batch's, log-probs from the final hidden states a chunk of
tokens at a time (never a batch's full-vocabulary logits), optional activation checkpointing, compute under
autocast with float32 weights, and dropout off. `trainer/train.py` calls `accumulate` from `train_shard` on
every rank; the GRPO formulas themselves are `trainer/grpo.py`'s.

    accumulate(policy, reference, sequences, advantages, job, device, scale)
        batch    = the sequences right-padded into tensors, on the CPU
        weights  = each trained token's weight in the batch's loss (grpo.token_weights), from the whole batch
        for each micro-batch (sorted by length, at most `micro_batch_tokens` padded tokens):
            forward with the hidden states; the LM head over the trained positions only, in chunks of
            about LOGIT_CHUNK_BYTES of float32 logits, each recomputed in the backward pass
            the reference model's forward on the same micro-batch, without gradient
            loss = the micro-batch's tokens' share of the batch's loss; backward at once

Because every micro-batch's loss carries the weights of the whole batch, their gradients add up to the
gradient of the batch's loss in one pass, for every aggregation (tests/trainer/test_scoring.py).

Several ranks: under DDP every micro-batch but the last runs in `no_sync`, so each rank all-reduces its
gradients once, in its last backward pass, whatever its number of micro-batches. A wrapper that gathers
parameters in every forward (FSDP2) needs every rank to run the same number of micro-batches, and the LM
head's weight unsharded where `sequence_logprobs` reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed._composable.checkpoint_activation import checkpoint as checkpoint_module
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from tandem_jobs.config import Job
from trainer import grpo, sampling

# How a turn was sampled: temperature, top_k, top_p, min_p (trainer/sampling.py).
TurnSampling = tuple[float, int, float, float]
# Per trained turn: token ids (prompt + completion), completion start, sampler log-probs, loss mask, how it
# was sampled, and whether it was sampled by older weights than the policy's (the dual clip applies).
TrainSequence = tuple[list[int], int, list[float], list[bool], TurnSampling, bool]

# float32 logits the LM head produces at once: 220 positions at a 152k vocabulary; smaller chunks run the
# head's matrix product at a fraction of the speed on a CPU (24 against 54 GFLOP/s at 110 and 440 rows here)
LOGIT_CHUNK_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class Batch:
    """Sequences right-padded into tensors. Completion position j of row i is scored by the logits at input
    position `positions[i, j]` and its token is `targets[i, j]`."""

    input_ids: torch.Tensor  # [B, W] long
    attention: torch.Tensor  # [B, W] long
    targets: torch.Tensor  # [B, C] long
    positions: torch.Tensor  # [B, C] long
    sampler: torch.Tensor  # [B, C] float32
    mask: torch.Tensor  # [B, C] bool
    temperatures: torch.Tensor  # [B] float32
    truncation: torch.Tensor  # [B, 3] float32: each row's top_k, top_p and min_p
    lagging: torch.Tensor  # [B] bool
    advantages: torch.Tensor  # [B] float32
    lengths: tuple[int, ...]  # tokens of each row, prompt and completion
    completions: tuple[int, ...]  # completion tokens of each row

    def rows(self, index: Sequence[int]) -> Batch:
        """The rows `index`, trimmed to their own longest sequence and completion."""
        picked = torch.tensor(list(index), dtype=torch.long)
        width = max(self.lengths[i] for i in index)
        completion = max((self.completions[i] for i in index), default=1) or 1
        return Batch(
            self.input_ids[picked, :width],
            self.attention[picked, :width],
            self.targets[picked, :completion],
            self.positions[picked, :completion],
            self.sampler[picked, :completion],
            self.mask[picked, :completion],
            self.temperatures[picked],
            self.truncation[picked],
            self.lagging[picked],
            self.advantages[picked],
            tuple(self.lengths[i] for i in index),
            tuple(self.completions[i] for i in index),
        )

    def to(self, device: torch.device) -> Batch:
        moved = {
            name: getattr(self, name).to(device)
            for name in ("input_ids", "attention", "targets", "positions", "sampler", "mask")
        }
        moved.update(
            temperatures=self.temperatures.to(device),
            truncation=self.truncation.to(device),
            lagging=self.lagging.to(device),
            advantages=self.advantages.to(device),
        )
        return replace(self, **moved)

    @property
    def tokens(self) -> int:
        """Padded tokens of one forward pass over the batch."""
        return len(self.lengths) * max(self.lengths)


def collate(sequences: Sequence[TrainSequence], advantages: Sequence[float]) -> Batch:
    """`sequences` right-padded into tensors on the CPU."""
    if len(sequences) != len(advantages) or not sequences:
        raise ValueError(f"{len(sequences)} sequences with {len(advantages)} advantages")
    width = max(len(ids) for ids, *_ in sequences)
    completion = max(len(ids) - start for ids, start, *_ in sequences) or 1
    count = len(sequences)
    input_ids = torch.zeros(count, width, dtype=torch.long)
    attention = torch.zeros(count, width, dtype=torch.long)
    targets = torch.zeros(count, completion, dtype=torch.long)
    sampler = torch.zeros(count, completion)
    mask = torch.zeros(count, completion, dtype=torch.bool)
    positions = torch.zeros(count, completion, dtype=torch.long)
    temperatures = torch.ones(count)
    truncation = torch.tensor([[0.0, 1.0, 0.0]]).repeat(count, 1)
    lagging = torch.zeros(count, dtype=torch.bool)
    for row, (ids, start, logprobs, loss_mask, (temperature, top_k, top_p, min_p), lags) in enumerate(
        sequences
    ):
        if start < 1:
            raise ValueError("a trained turn needs a prompt of at least one token")
        n = len(ids) - start
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        targets[row, :n] = torch.tensor(ids[start:])
        sampler[row, :n] = torch.tensor(logprobs[:n] + [0.0] * (n - len(logprobs[:n])))
        mask[row, : min(n, len(loss_mask))] = torch.tensor(loss_mask[:n], dtype=torch.bool)
        positions[row, :n] = torch.arange(start - 1, start - 1 + n)
        temperatures[row] = temperature if temperature > 0 else 1.0
        truncation[row] = torch.tensor([float(top_k), top_p, min_p])
        lagging[row] = lags
    return Batch(
        input_ids,
        attention,
        targets,
        positions,
        sampler,
        mask,
        temperatures,
        truncation,
        lagging,
        torch.tensor([float(a) for a in advantages]),
        tuple(len(ids) for ids, *_ in sequences),
        tuple(len(ids) - start for ids, start, *_ in sequences),
    )


def micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Rows grouped into micro-batches of at most `budget` padded tokens (rows x the longest row), longest
    rows first so that rows of like length share a micro-batch; a row longer than `budget` is alone."""
    if budget < 1:
        raise ValueError(f"the token budget must be at least 1, not {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for index in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def _head_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    truncation: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return scored_logits(F.linear(hidden, weight, bias), targets, temperatures, truncation)


def scored_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor, truncation: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of `targets` [N] under `logits` [N, V] as each row was sampled: its
    temperature, then its `truncation` (top_k, top_p, min_p; trainer/sampling.py), the target always kept."""
    if truncation is None or not bool((truncation != NO_TRUNCATION.to(truncation.device)).any()):
        return grpo.scored_tokens(logits, targets, temperatures)
    divisor = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures)).float()
    scaled = logits.float() / divisor.unsqueeze(-1)
    return grpo.scored_tokens(sampling.truncated_rows(scaled, targets, truncation), targets, 1.0)


# top_k 0, top_p 1, min_p 0: the full distribution at the temperature
NO_TRUNCATION = torch.tensor([0.0, 1.0, 0.0])


def head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    *,
    recompute: bool,
    truncation: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of `targets` [N] under the LM head applied to `hidden` [N, H], a chunk of
    rows at a time so that at most about LOGIT_CHUNK_BYTES of float32 logits exist at once, each under the
    distribution it was sampled from (the temperature, then `truncation` [N, 3]: top_k, top_p, min_p as
    trainer/sampling.py defines them, the target always kept). With `recompute` each chunk's logits are
    recomputed in the backward pass instead of kept."""
    weight, bias = head.weight, getattr(head, "bias", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"the LM head's weight is a {type(weight).__name__}")
    rows = max(1, LOGIT_CHUNK_BYTES // (4 * weight.shape[0]))
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], rows):
        part = slice(start, start + rows)
        cut = truncation[part] if truncation is not None else None
        args = (hidden[part], weight, bias, targets[part], temperatures[part], cut)
        if recompute:
            logp, ent = checkpoint(_head_chunk, *args, use_reentrant=False)
        else:
            logp, ent = _head_chunk(*args)
        logprobs.append(logp)
        entropies.append(ent)
    return torch.cat(logprobs), torch.cat(entropies)


def _unwrapped(model: torch.nn.Module) -> PreTrainedModel:
    inner = getattr(model, "module", model)  # DDP keeps the model as .module (and FrozenBase its policy)
    if hasattr(inner, "get_base_model"):  # a peft model (LoRA mode): the causal LM with its adapter inside
        inner = getattr(inner, "get_base_model")()  # noqa: B009
    if not isinstance(inner, PreTrainedModel):
        raise TypeError(f"expected a Hugging Face causal LM, got {type(inner).__name__}")
    return inner


@dataclass(frozen=True)
class Scores:
    logprobs: torch.Tensor  # [B, C]: the model's log-probs of the targets at the trained positions, else 0
    entropy_sum: float  # nats, summed over the trained positions


def sequence_logprobs(model: torch.nn.Module, batch: Batch) -> Scores:
    """The log-probs of `batch`'s trained targets under `model` (a Hugging Face causal LM, possibly inside
    DDP, called through its wrapper so that the wrapper sees the forward). The head runs on the final
    hidden states at the trained positions only; with gradients enabled each chunk is recomputed in the
    backward pass. A batch without a trained position still scores one (weight 0 in the loss), so every
    parameter is in the graph, as DDP requires."""
    head = _unwrapped(model).get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated upstream
    if head is None:
        raise TypeError("the model has no output embeddings (LM head)")
    # Under FSDP the head's weight is whole only inside the model's forward: there the model computes the
    # micro-batch's logits itself (the micro-batch budget bounds them), elsewhere only the last position's.
    sharded = isinstance(head.weight, DTensor)
    output = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention,
        output_hidden_states=not sharded,
        logits_to_keep=0 if sharded else 1,
        use_cache=False,
    )
    rows, cols = batch.mask.nonzero(as_tuple=True)
    if rows.numel() == 0:
        rows = cols = torch.zeros(1, dtype=torch.long, device=batch.mask.device)
    if sharded:
        logp, entropies = scored_logits(
            output.logits[rows, batch.positions[rows, cols]],
            batch.targets[rows, cols],
            batch.temperatures[rows],
            batch.truncation[rows],
        )
    else:
        hidden = output.hidden_states[-1]  # after the final norm: what the LM head reads
        logp, entropies = head_logprobs(
            hidden[rows, batch.positions[rows, cols]],
            head,
            batch.targets[rows, cols],
            batch.temperatures[rows],
            recompute=torch.is_grad_enabled(),
            truncation=batch.truncation[rows],
        )
    scattered = torch.zeros(batch.mask.shape, dtype=logp.dtype, device=logp.device).index_put(
        (rows, cols), logp
    )
    trained = batch.mask[rows, cols]
    return Scores(scattered, float(entropies[trained].sum()))


def _autocast(job: Job, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if job.compute_dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


class Scored(NamedTuple):
    """One pass over a batch: its loss (a tensor with its graph from `batch_loss`; detached from
    `accumulate`, whose gradients are already in the parameters), statistics, mean entropy, trained tokens."""

    loss: torch.Tensor
    stats: grpo.LossStats
    entropy: float
    tokens: int


def _micro_loss(
    policy: torch.nn.Module,
    reference: torch.nn.Module | None,
    part: Batch,
    weights: torch.Tensor,
    job: Job,
) -> tuple[torch.Tensor, grpo.LossStats, float]:
    scores = sequence_logprobs(policy, part)
    ref_logprobs = None
    if reference is not None:
        with torch.no_grad():
            ref_logprobs = sequence_logprobs(reference, part).logprobs
    loss, stats = grpo.policy_loss(
        scores.logprobs,
        part.sampler,
        part.advantages,
        part.mask,
        clip_low=job.clip_low,
        clip_high=job.clip_high,
        kl_coef=job.config.algorithm.kl_coef,
        ref_logprobs=ref_logprobs,
        max_ratio=job.max_importance_ratio,
        lagging=part.lagging,
        ratio_level=job.ratio_level,
        weights=weights,
        decoupled=job.decoupled,
    )
    return loss, stats, scores.entropy_sum


def _weights(batch: Batch, job: Job) -> torch.Tensor:
    usable = batch.mask & torch.isfinite(batch.sampler)
    return grpo.token_weights(usable, job.aggregation, constant_tokens=job.constant_tokens)


def _scored(losses: float | torch.Tensor, parts: list[grpo.LossStats], entropy_sum: float) -> Scored:
    stats = grpo.combine(parts)
    loss = losses if isinstance(losses, torch.Tensor) else torch.tensor(losses)
    return Scored(loss, stats, entropy_sum / stats.tokens if stats.tokens else 0.0, stats.tokens)


def batch_loss(
    policy: torch.nn.Module,
    reference: torch.nn.Module | None,
    sequences: Sequence[TrainSequence],
    advantages: Sequence[float],
    job: Job,
    device: torch.device,
) -> Scored:
    """The loss of `sequences` in one forward pass (no micro-batches), with its graph: what `accumulate`'s
    micro-batches add up to."""
    batch = collate(sequences, advantages)
    policy.train(False)  # dropout off; gradients still flow
    with _autocast(job, device):
        loss, stats, entropy_sum = _micro_loss(
            policy, reference, batch.to(device), _weights(batch, job).to(device), job
        )
    return _scored(loss, [stats], entropy_sum)


def _gradient_sync(module: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
    no_sync = getattr(module, "no_sync", None)  # DDP's
    return contextlib.nullcontext() if sync or no_sync is None else no_sync()


def accumulate(
    policy: torch.nn.Module,
    reference: torch.nn.Module | None,
    sequences: Sequence[TrainSequence],
    advantages: Sequence[float],
    job: Job,
    device: torch.device,
    *,
    scale: float = 1.0,
    budget: int | None = 0,
) -> Scored:
    """Forward and backward over `sequences` in micro-batches of `budget` tokens (0: the job's
    `micro_batch_tokens`; None: all of them in one pass): the parameters' gradients grow by `scale` times
    the gradient of the sequences' loss as one batch. Returns that loss (unscaled, detached) and its
    statistics."""
    batch = collate(sequences, advantages)
    weights = _weights(batch, job)
    policy.train(False)  # dropout off; gradients still flow
    if budget is None:
        plan = [list(range(len(batch.lengths)))]
    else:
        plan = micro_batches(batch.lengths, budget or job.micro_batch_tokens)
    parts: list[grpo.LossStats] = []
    total, entropy_sum = 0.0, 0.0
    for number, rows in enumerate(plan):
        part = batch.rows(rows).to(device)
        with _gradient_sync(policy, number == len(plan) - 1):
            with _autocast(job, device):
                share = weights[rows][:, : part.mask.shape[1]].to(device)  # trimmed as the rows are
                loss, stats, entropy = _micro_loss(policy, reference, part, share, job)
            (loss * scale).backward()  # type: ignore[no-untyped-call]
        total += float(loss.detach())
        parts.append(stats)
        entropy_sum += entropy
    return _scored(total, parts, entropy_sum)


def trained_tokens(sequence: TrainSequence) -> int:
    """How many of the sequence's completion tokens the loss trains on (its loss mask)."""
    ids, start, _, loss_mask, *_ = sequence
    return sum(1 for keep in loss_mask[: len(ids) - start] if keep)


# ---- loading -------------------------------------------------------------------------------------


def decoder_layers(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The model's decoder layers: the modules transformers marks as checkpointable layers."""
    return (m for m in model.modules() if isinstance(m, GradientCheckpointingLayer))


def load_policy(path: Path, device: torch.device, job: Job) -> Any:
    """The policy to train from the model directory `path`: float32 weights whatever the checkpoint's dtype
    (the optimizer's state follows them), each decoder layer checkpointed when the job asks. The
    composable checkpoint keeps the parameters' names, so checkpoints and weight sync are unchanged.

    In LoRA mode (`[weights] mode = "lora"`) the policy is the job's base model (`model.dir`) frozen with a
    trainable peft adapter (trainer/lora.py), and `path` a checkpoint holding a saved adapter to start from,
    or the base model's directory itself."""
    lora_mode = job.config.weights.mode == "lora"
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        Path(job.config.model.dir) if lora_mode else path, dtype=torch.float32
    )
    model.to(device)  # type: ignore[arg-type]
    if job.config.training.activation_checkpointing:
        layers = list(decoder_layers(model))
        if not layers:
            raise ValueError(f"{type(model).__name__} has no layers to checkpoint")
        for layer in layers:
            checkpoint_module(layer)
    if not lora_mode:
        return model
    from trainer import lora  # noqa: PLC0415  # peft is imported by LoRA jobs only

    with torch.random.fork_rng(devices=[]):  # the adapter's initialisation follows from the job's seed alone
        torch.manual_seed(job.config.seed)
        policy = lora.wrap(model, lora.spec_of(job.config.weights.lora))
    if (path / lora.ADAPTER_WEIGHTS).exists():
        lora.load_adapter(policy, path)
    return policy


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates: every one, or in LoRA mode the adapter's."""
    return [p for p in model.parameters() if p.requires_grad]


def master_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The float32 weights a checkpoint keeps to resume from: the trainable ones (all but a LoRA policy's
    frozen base, which the job's model directory holds)."""
    if all(p.requires_grad for p in model.parameters()):
        return model.state_dict()
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def reference_for(policy: torch.nn.Module, path: Path, device: torch.device, job: Job) -> torch.nn.Module:
    """The KL term's reference model: `load_reference` of `path`, or in LoRA mode the policy's own frozen
    base (no second copy of the weights)."""
    if job.config.weights.mode == "lora":
        from trainer import lora  # noqa: PLC0415

        return lora.FrozenBase(policy)  # type: ignore[arg-type]
    return load_reference(path, device, job)


def load_reference(path: Path, device: torch.device, job: Job) -> PreTrainedModel:
    """The frozen reference model, in the dtype the policy computes in."""
    dtype = torch.bfloat16 if job.compute_dtype == "bfloat16" else torch.float32
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device)  # type: ignore[arg-type]
    model.train(False)
    model.requires_grad_(False)
    return model

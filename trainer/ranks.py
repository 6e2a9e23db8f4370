"""Several trainer ranks: data parallelism over the job's training devices, DDP or FSDP2
(`[topology] sharding`), with rank 0 alone talking to the mesh.

Rank 0 is the `Trainer` in the launcher's process: it plays the rollouts, publishes the weights to the
inference workers, writes checkpoints and reports. Ranks 1..N-1 are child processes
(`python -m trainer.ranks`, settings in `TANDEM_RANK_*` variables) that `start_ranks` starts, each logging
to `rank-<r>/rank.log` under the job's output folder, and `Ranks.close` stops. On GPU there is one rank per
training GPU of the placement plan (NCCL for the gradients, gloo for the control messages); on CPU the job's
`topology.cpu_trainer_ranks` (gloo). The group is torch.distributed's default group, formed over a
`TCPStore` that rank 0 serves on a port the OS picks; the weight transfer to the inference workers keeps
its own group (trainer/inference/weights.py).

One job, on every rank:

1. setup (rank 0's first update, again whenever it trains another model object, e.g. after a resume): rank
   0 broadcasts its optimizer (class, hyperparameters and state); every rank wraps its policy in DDP,
   which copies rank 0's weights to all of them, and builds the same optimizer. Under FSDP every rank
   takes rank 0's weights (a broadcast per tensor), shards the policy (trainer/sharding.py: each decoder
   layer, then the root) and keeps its shard of the optimizer state; rank 0's optimizer is rebound to the
   sharded parameters in place. FSDP sets up once per job (a resume happens before the first update).
2. per update: rank 0 splits the batch into one contiguous shard per rank (`shard_batch`) and broadcasts
   every shard with the learning rate. Each rank runs forward and backward over its shard in micro-batches
   (the GRPO loss times the shard's `weight`; DDP all-reduces in the last micro-batch's backward), all of
   them exchange their losses and statistics (an all-gather), and they skip the update together when any
   loss is not finite (dropping the gradients); otherwise each clips and steps. The weight makes the DDP
   average the gradient of the whole batch: `world_size * share`, the share being the rank's fraction of
   the batch's trained tokens (token mean), of its sequences with a trained token (sequence mean) or of its
   sequences (constant). A rank without a sequence of its own (fewer sequences than ranks) trains on a copy
   of one with weight 0, so it still joins the all-reduce. FSDP's reduce-scatter averages the gradients as
   DDP's all-reduce does, so the same weights hold.
3. gather (FSDP only; rank 0's weight sync, checkpoints and finish): rank 0 sends the names of the tensors
   it wants, in groups (one per weight-sync bucket or checkpoint file), and every rank gathers the groups
   in that order (`gathered`); rank 0 keeps them, the others drop them. For a checkpoint's optimizer state,
   every rank gathers it tensor by tensor into rank 0's host memory (`optimizer_state`).
4. finish (the end of `Trainer.run`): every rank hashes its weights; rank 0 compares the digests and raises
   `RankError` naming the ranks that differ; a child exits 1 on a mismatch and 0 otherwise. Under FSDP no
   weight is held by two ranks, so each hashes the gathered whole weights together with the number of
   updates it took part in: a rank that missed or repeated an update differs.

Every wait has a timeout: `timeout_s` bounds forming the group and every collective of an update, `wait_s`
how long a child waits for rank 0's next message (a step's rollouts, weight sync and checkpoint happen in
between). A rank that dies fails the job: rank 0 names it with the end of its log.

Shortcuts: under DDP every rank holds the full weights, gradients and optimizer state, and rank 0 publishes
its own weights (they are every rank's); FSDP's shortcuts are in trainer/sharding.py. All ranks run on one
machine (the store is on loopback). The control messages are torch.save'd dicts on a gloo broadcast, read
back with `weights_only=True`.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import logging
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tandem.trainer.v1 import config_pb2
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore, TCPStore

from mesh.observability import configure_logging
from tandem_jobs.config import Job, Sharding
from trainer.grpo import Aggregation, LossStats, finite
from trainer.inference.process import ROOT, die_with_parent, stop_process
from trainer.inference.weights import checksum_digest, tensor_checksum
from trainer.scoring import load_policy, load_reference
from trainer.sharding import (
    SHARD_BYTES,
    Gathering,
    broadcast_module,
    full_optimizer_state,
    groups_by_size,
    is_sharded,
    optimizer_params,
    rebind,
    save_in_dtype,
    shard,
    shard_optimizer_state,
    write_hf_folder,
)

log = logging.getLogger("tandem.ranks")
HOST = "127.0.0.1"
TIMEOUT_S = 300.0  # forming the group; one collective of an update
WAIT_S = 3600.0  # a child waiting for rank 0's next message
_SLICE_S = 0.2  # how often a blocked rank 0 looks at its children
_DIGEST_GROUP_BYTES = 64 * 1024 * 1024  # the tensors gathered at once to hash sharded weights


class RankError(RuntimeError):
    """A trainer rank died, stalled or disagrees with rank 0; the job cannot go on."""


@dataclass(frozen=True)
class Shard:
    indices: tuple[int, ...]  # the batch's sequences this rank trains on
    weight: float  # multiplies the rank's loss, so the DDP mean of the gradients is the whole batch's
    padding: bool = False  # no sequence of its own: a copy of sequence 0 with weight 0


def shard_batch(tokens: Sequence[int], world_size: int, aggregation: Aggregation) -> list[Shard]:
    """Split a batch whose sequence i has `tokens[i]` trained tokens into `world_size` contiguous shards,
    with the weights that make DDP's averaged gradient equal the whole batch's."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    count = len(tokens)
    if count == 0:
        raise ValueError("an update needs at least one sequence")
    bounds = [count * r // world_size for r in range(world_size + 1)]
    if aggregation == "token_mean":
        shares = [float(t) for t in tokens]
    elif aggregation == "sequence_mean":
        shares = [1.0 if t > 0 else 0.0 for t in tokens]  # grpo.aggregate skips untrained sequences
    elif aggregation == "constant":
        shares = [1.0 for _ in tokens]  # grpo.aggregate divides by every completion of the batch
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}")
    total = sum(shares)
    shards = []
    for rank in range(world_size):
        indices = tuple(range(bounds[rank], bounds[rank + 1]))
        if not indices:
            shards.append(Shard((0,), 0.0, padding=True))
            continue
        share = sum(shares[i] for i in indices) / total if total else 0.0
        shards.append(Shard(indices, world_size * share))
    return shards


@dataclass(frozen=True)
class StepShard:
    """One rank's part of an update, as rank 0 sent it."""

    lr: float
    weight: float
    padding: bool
    sequences: list[Any]
    advantages: list[float]


@dataclass
class Update:
    """The whole batch's outcome of one update, the same on every rank."""

    finite: bool  # every rank's loss was finite; otherwise no rank stepped
    stats: LossStats
    entropy: float
    tokens: int
    grad_norm: float | None = None


_FIELDS = (
    12  # per rank: flag, weighted loss and policy loss, then token-weighted kl, clip, ratio, entropy, ...
)


def _local_vector(
    weighted: float, policy: float, stats: LossStats, entropy: float, tokens: int
) -> list[float]:
    trained = 0 if not finite(weighted) else tokens
    return [
        0.0 if finite(weighted) else 1.0,
        weighted if finite(weighted) else 0.0,
        policy,
        stats.kl * trained,
        stats.clip_fraction * trained,
        stats.ratio_mean * trained,
        stats.ratio_min if trained else math.inf,
        stats.ratio_max if trained else -math.inf,
        entropy * trained,
        float(trained),
        stats.mismatch_abs * trained,
        stats.mismatch_kl * trained,
    ]


def _combine(rows: Sequence[Sequence[float]]) -> Update:
    world = len(rows)
    tokens = sum(r[9] for r in rows)

    def mean(column: int) -> float:
        return sum(r[column] for r in rows) / tokens if tokens else 0.0

    low, high = min(r[6] for r in rows), max(r[7] for r in rows)
    loss = sum(r[1] for r in rows) / world
    stats = LossStats(
        loss=loss,
        policy_loss=sum(r[2] for r in rows) / world,
        kl=mean(3),
        clip_fraction=mean(4),
        ratio_mean=mean(5) if tokens else 1.0,
        ratio_min=low if math.isfinite(low) else 1.0,
        ratio_max=high if math.isfinite(high) else 1.0,
        tokens=int(tokens),
        mismatch_abs=mean(10),
        mismatch_kl=mean(11),
    )
    return Update(not any(r[0] for r in rows), stats, mean(8), int(tokens))


def _encode(message: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(message, buffer)
    return buffer.getvalue()


def _decode(data: bytes) -> dict[str, Any]:
    message: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    return message


def weights_digest(model: torch.nn.Module) -> str:
    """One SHA-256 over every parameter's checksum, in the model's order. Sharded (FSDP) parameters are
    gathered a group at a time: a collective, so every rank computes it at once."""
    named = list(model.named_parameters())
    whole = Gathering([[named[i][1] for i in group] for group in groups_by_size(named, _DIGEST_GROUP_BYTES)])
    tensors = (tensor for group in whole for tensor in group)
    return checksum_digest([(name, tensor_checksum(t)) for (name, _), t in zip(named, tensors, strict=True)])


def _agreement(model: torch.nn.Module, sharding: Sharding, updates: int) -> tuple[str, str]:
    """(the weights' digest, what the ranks compare at the end): the digest itself under DDP; under FSDP,
    where the gathered weights are the same on every rank by construction, the digest with the number of
    updates the rank took part in."""
    digest = weights_digest(model)
    if sharding != "fsdp":
        return digest, digest
    return digest, hashlib.sha256(f"{digest}:{updates}".encode()).hexdigest()


def _setup_fsdp(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Every rank at once: take rank 0's weights, shard the policy, point `optimizer` at the shards and give
    it this rank's shard of `state` (rank 0's whole optimizer state)."""
    names = {id(p): name for name, p in model.named_parameters()}
    broadcast_module(model)
    shard(model)
    rebind(optimizer, model, names)
    optimizer.load_state_dict(shard_optimizer_state(state, optimizer_params(optimizer)))


def _tensors_by_name(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_buffers()), **dict(model.named_parameters())}


@dataclass
class RankProcess:
    rank: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def describe(self) -> str:
        code = self.proc.returncode
        return f"trainer rank {self.rank} exited with {code}; the end of {self.log_path}:\n{self.tail()}"


@dataclass
class Ranks:
    """This process's place among the job's trainer ranks. Rank 0 holds the child processes; `alone` is the
    one-rank job, where every collective is a no-op."""

    rank: int
    world_size: int
    device: torch.device
    timeout_s: float = TIMEOUT_S
    wait_s: float = WAIT_S
    children: list[RankProcess] = field(default_factory=list)
    store: TCPStore | None = None  # the group's rendezvous (rank 0 serves it)
    sharding: Sharding = "ddp"
    gather_peak_bytes: int = 0  # the most whole bytes the last `gathered` held at once on this rank
    _module: torch.nn.Module | None = field(default=None, init=False)
    _wrapped: torch.nn.Module | None = field(default=None, init=False)  # the model `_module` wraps
    _finished: bool = field(default=False, init=False)
    _updates: int = field(default=0, init=False)  # updates sent to every rank

    @classmethod
    def alone(cls, device: str | torch.device = "cpu") -> Ranks:
        return cls(0, 1, torch.device(device))

    # ---- rank 0 ---------------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """Rank 0: the module to train `model` through (DDP over every rank; `model` itself, sharded in
        place, under FSDP; `model` itself alone), with every rank set up on rank 0's weights and optimizer.
        Idempotent for the same model."""
        if self.world_size == 1:
            return model
        if self._wrapped is model and self._module is not None:
            return self._module
        if self.sharding == "fsdp" and self._wrapped is not None:
            raise RankError("FSDP shards the policy once per job; this is another model object")
        whole = optimizer.state_dict()
        state = {"class": type(optimizer).__name__, "optimizer": whole}
        self._call("the setup broadcast", lambda: self._send({"kind": "setup", **state}))
        if self.sharding == "fsdp":
            self._call("sharding the policy", lambda: _setup_fsdp(model, optimizer, whole))
            self._module = model
        else:
            self._module = self._call("wrapping the policy in DDP", lambda: self._ddp(model))
        self._wrapped = model
        return self._module

    @contextlib.contextmanager
    def gathered(
        self, named: Sequence[tuple[str, torch.Tensor]], groups: Sequence[Sequence[int]]
    ) -> Iterator[Gathering]:
        """Rank 0: each group of `named` (indices) whole, in order (trainer/inference/publisher.py's
        `Gather`). Sharded tensors are gathered with every rank, which rank 0 first tells which; leaving the
        context gathers the groups not taken, so the ranks stay in step after a failed weight sync."""
        sharded = any(is_sharded(tensor) for _, tensor in named)
        if sharded and self.world_size > 1:
            names = [[named[i][0] for i in group] for group in groups]
            self._call("the gather broadcast", lambda: self._send({"kind": "gather", "groups": names}))
        gathering = Gathering([[named[i][1] for i in group] for group in groups])
        try:
            yield gathering
        finally:
            self._call("gathering the weights", gathering.finish)
            self.gather_peak_bytes = gathering.peak_bytes

    def save_pretrained(self, model: Any, folder: Path, dtype: torch.dtype | None = None) -> None:
        """Rank 0: `model` as one Hugging Face folder, its weights in `dtype` (the checkpoint's own; None:
        the parameters'). Sharded, its weights are gathered one safetensors file (`SHARD_BYTES`) at a time
        and written before the next is gathered."""
        named = list(model.named_parameters())
        if not any(is_sharded(tensor) for _, tensor in named):
            save_in_dtype(model, folder, dtype)
            return
        groups = groups_by_size(named, SHARD_BYTES)
        with self.gathered(named, groups) as tensors:
            write_hf_folder(folder, model, named, groups, tensors, dtype)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Rank 0: the optimizer's whole state (`state_dict()`'s form), gathered from every rank when the
        policy is sharded."""
        if not any(is_sharded(p) for p in optimizer_params(optimizer)):
            return optimizer.state_dict()
        if self.world_size > 1:
            self._call("the optimizer-state broadcast", lambda: self._send({"kind": "optimizer_state"}))
        state: dict[str, Any] = self._call(
            "gathering the optimizer state", lambda: full_optimizer_state(optimizer)
        )
        return state

    def scatter(
        self,
        sequences: Sequence[Any],
        advantages: Sequence[float],
        tokens: Sequence[int],
        *,
        lr: float,
        aggregation: Aggregation,
    ) -> StepShard:
        """Rank 0: send every rank its shard of the update (sequence i trains `tokens[i]` tokens) and
        return rank 0's."""
        self.check()
        shards = shard_batch(tokens, self.world_size, aggregation)
        parts = [
            {
                "weight": s.weight,
                "padding": s.padding,
                "sequences": [sequences[i] for i in s.indices],
                "advantages": [float(advantages[i]) for i in s.indices],
            }
            for s in shards
        ]
        message = {"kind": "step", "lr": lr, "shards": parts}
        if self.world_size > 1:
            self._call("the step broadcast", lambda: self._send(message))
        self._updates += 1
        return self._shard_of(message)

    def finish(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
        """Rank 0, at the end of the job: every rank hashes its weights; RankError names the ranks whose
        weights differ from rank 0's. Returns the digest."""
        if self.world_size == 1:
            return weights_digest(model)
        self.wrap(model, optimizer)
        self._call("the finish broadcast", lambda: self._send({"kind": "finish"}))
        agreement: tuple[str, str] = self._call(
            "hashing the weights", lambda: _agreement(model, self.sharding, self._updates)
        )
        mine, compared = agreement
        digests = self._call("comparing weight digests", lambda: self._digests(compared))
        self._finished = True
        differ = [r for r, d in enumerate(digests) if d != compared]
        if differ:
            raise RankError(f"trainer ranks {differ} hold other weights than rank 0 at the end of the job")
        log.info("all %d trainer ranks hold the same weights (%s)", self.world_size, mine[:12])
        return mine

    def check(self) -> None:
        """Rank 0: RankError naming a child that exited."""
        for child in self.children:
            if child.proc.poll() is not None:
                raise RankError(child.describe())

    def _call(self, what: str, work: Callable[[], Any]) -> Any:
        """Run a collective on rank 0; a failure names the child that died, if one did."""
        try:
            return work()
        except Exception as exc:
            deadline = time.monotonic() + 5  # a dead peer's socket closes before its exit status is in
            while time.monotonic() < deadline:
                self.check()
                if not self.children:
                    break
                time.sleep(_SLICE_S)
            raise RankError(f"{what} failed on trainer rank 0 with every child rank alive: {exc}") from exc

    def close(self) -> None:
        """Stop the child ranks (those that finished exit by themselves) and leave the group. Idempotent."""
        for child in self.children:
            if self._finished:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=10)
            stop_process(child.proc, 15)
        self.children = []
        self._module = self._wrapped = None
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.store = None

    # ---- every rank -----------------------------------------------------------------------------

    def exchange(
        self, weighted: float, policy: float, stats: LossStats, entropy: float, tokens: int
    ) -> Update:
        """Every rank: share this rank's weighted loss and statistics; all of them get the whole batch's."""
        local = _local_vector(weighted, policy, stats, entropy, tokens)
        if self.world_size == 1:
            return _combine([local])
        rows = self._call("exchanging the losses", lambda: self._all_gather(local))
        return _combine(rows)

    def _all_gather(self, local: list[float]) -> list[list[float]]:
        mine = torch.tensor(local, dtype=torch.float64)
        rows = [torch.zeros(_FIELDS, dtype=torch.float64) for _ in range(self.world_size)]
        dist.all_gather(rows, mine)
        return [r.tolist() for r in rows]

    def _digests(self, mine: str) -> list[str]:
        local = torch.frombuffer(bytearray(bytes.fromhex(mine)), dtype=torch.uint8)
        rows = [torch.zeros(32, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(rows, local)
        return [bytes(r.tolist()).hex() for r in rows]

    def _ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        ids = [self.device.index or 0] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)

    def _broadcast(self, tensor: torch.Tensor, timeout_s: float) -> None:
        options = BroadcastOptions()
        options.rootRank = 0
        options.timeout = timedelta(seconds=timeout_s)
        dist.distributed_c10d._get_default_group().broadcast([tensor], options).wait()

    def _send(self, message: dict[str, Any]) -> None:
        data = _encode(message)
        self._broadcast(torch.tensor([len(data)], dtype=torch.int64), self.timeout_s)
        self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), self.timeout_s)

    def _receive(self) -> dict[str, Any]:
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size, self.wait_s)
        data = torch.empty(int(size), dtype=torch.uint8)
        self._broadcast(data, self.timeout_s)
        return _decode(data.numpy().tobytes())

    def _shard_of(self, message: dict[str, Any]) -> StepShard:
        part = message["shards"][self.rank]
        return StepShard(
            float(message["lr"]),
            float(part["weight"]),
            bool(part["padding"]),
            part["sequences"],
            part["advantages"],
        )

    # ---- ranks 1..N-1 ---------------------------------------------------------------------------

    def serve(
        self,
        model: torch.nn.Module,
        train: Callable[[torch.nn.Module, torch.optim.Optimizer, StepShard], object],
    ) -> bool:
        """A child rank: follow rank 0's messages until it finishes the job; True when this rank's weights
        match rank 0's at the end."""
        module: torch.nn.Module | None = None
        optimizer: torch.optim.Optimizer | None = None
        steps = 0
        while True:
            message = self._receive()
            kind = message["kind"]
            if kind == "setup":
                if self.sharding == "fsdp" and module is not None:
                    raise RankError(f"rank {self.rank}: FSDP sets up once per job, a second setup came")
                optimizer = getattr(torch.optim, message["class"])(model.parameters())
                if self.sharding == "fsdp":
                    _setup_fsdp(model, optimizer, message["optimizer"])
                    module = model
                else:
                    optimizer.load_state_dict(message["optimizer"])
                    module = self._ddp(model)
                log.info(
                    "rank %d: set up (%s) on rank 0's weights and %s",
                    self.rank,
                    self.sharding,
                    message["class"],
                )
            elif kind == "step":
                if module is None or optimizer is None:
                    raise RankError(f"rank {self.rank}: a step came before the setup")
                train(module, optimizer, self._shard_of(message))
                steps += 1
            elif kind == "gather":
                tensors = _tensors_by_name(model)
                Gathering([[tensors[name] for name in group] for group in message["groups"]]).finish()
            elif kind == "optimizer_state":
                if optimizer is None:
                    raise RankError(f"rank {self.rank}: the optimizer state was asked for before the setup")
                full_optimizer_state(optimizer, keep=False)
            elif kind == "finish":
                digests = self._digests(_agreement(model, self.sharding, steps)[1])
                same = all(d == digests[0] for d in digests)
                log.info("rank %d: finished after %d updates; digests agree: %s", self.rank, steps, same)
                return same
            else:
                raise RankError(f"rank {self.rank}: unknown message {kind!r}")


# ---- starting the ranks ---------------------------------------------------------------------------


def _backend(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def _init_group(store: TCPStore, rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
    dist.init_process_group(
        _backend(device),
        store=PrefixStore("trainer", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def devices_for(job: Job, training_gpus: Sequence[int]) -> list[str]:
    """One device per rank: the plan's training GPUs, or `trainer_ranks` CPU ranks."""
    return [f"cuda:{g}" for g in training_gpus] if training_gpus else ["cpu"] * job.trainer_ranks


def start_ranks(
    job: Job,
    output_dir: Path,
    devices: Sequence[str],
    *,
    timeout_s: float = TIMEOUT_S,
    wait_s: float = WAIT_S,
) -> Ranks:
    """Rank 0 (this process, on `devices[0]`): start ranks 1..N-1 on the other devices and form the group.
    Blocks until every rank joined; RankError with a child's log when one exits or `timeout_s` passes."""
    world = len(devices)
    if world < 1:
        raise ValueError("a trainer needs at least one rank")
    if world == 1:
        return Ranks.alone(devices[0])
    if dist.is_initialized():
        raise RankError("torch.distributed's default group is already in use in this process")
    store = TCPStore(
        HOST, 0, world, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    ranks = Ranks(0, world, torch.device(devices[0]), timeout_s, wait_s, store=store, sharding=job.sharding)
    if ranks.device.type == "cuda":
        torch.cuda.set_device(ranks.device)
    config = base64.b64encode(job.config.SerializeToString()).decode()
    try:
        for rank in range(1, world):
            folder = output_dir / f"rank-{rank}"
            folder.mkdir(parents=True, exist_ok=True)
            env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
            env.setdefault("OMP_NUM_THREADS", "1")
            env.update(
                {
                    "TANDEM_RANK": str(rank),
                    "TANDEM_RANK_WORLD_SIZE": str(world),
                    "TANDEM_RANK_STORE": f"{HOST}:{store.port}",
                    "TANDEM_RANK_DEVICE": devices[rank],
                    "TANDEM_RANK_JOB": config,
                    "TANDEM_RANK_TIMEOUT_S": str(timeout_s),
                    "TANDEM_RANK_WAIT_S": str(wait_s),
                }
            )
            log_path = folder / "rank.log"
            with log_path.open("wb") as log_file:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "trainer.ranks"],
                    cwd=ROOT,
                    env=env,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    preexec_fn=die_with_parent,  # noqa: PLW1509 - only sets the parent-death signal
                )
            ranks.children.append(RankProcess(rank, proc, log_path))
        deadline = time.monotonic() + timeout_s
        for child in ranks.children:  # each sets its key once its model is loaded, just before joining
            while not store.check([f"ready/{child.rank}"]):
                ranks.check()
                if time.monotonic() > deadline:
                    raise RankError(
                        f"trainer rank {child.rank} not ready in {timeout_s:g} s:\n{child.tail()}"
                    )
                time.sleep(_SLICE_S)
        _init_group(store, 0, world, ranks.device, timeout_s)
    except BaseException:
        ranks.close()
        raise
    log.info("%d trainer ranks on %s", world, ", ".join(devices))
    return ranks


def main() -> int:
    """A child rank: load the policy, join rank 0's group, train the shards it is sent."""
    from trainer import train  # noqa: PLC0415 - train.py imports this module

    configure_logging("INFO", "text")
    rank, world = int(os.environ["TANDEM_RANK"]), int(os.environ["TANDEM_RANK_WORLD_SIZE"])
    host, port = os.environ["TANDEM_RANK_STORE"].rsplit(":", 1)
    device = torch.device(os.environ["TANDEM_RANK_DEVICE"])
    timeout_s, wait_s = float(os.environ["TANDEM_RANK_TIMEOUT_S"]), float(os.environ["TANDEM_RANK_WAIT_S"])
    job = Job(config_pb2.TrainerConfig.FromString(base64.b64decode(os.environ["TANDEM_RANK_JOB"])))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    policy = load_policy(Path(job.config.model.dir), device, job)
    reference = None
    if job.config.algorithm.kl_coef > 0:
        reference = load_reference(Path(job.config.model.dir), device, job)
    store = TCPStore(host, int(port), world, is_master=False, timeout=timedelta(seconds=timeout_s))
    store.set(f"ready/{rank}", "1")
    _init_group(store, rank, world, device, timeout_s)
    ranks = Ranks(rank, world, device, timeout_s, wait_s, store=store, sharding=job.sharding)
    log.info("rank %d of %d on %s joined (%s)", rank, world, device, job.sharding)

    def step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, shard: StepShard) -> object:
        return train.train_shard(ranks, module, reference, optimizer, shard, job, device)

    try:
        same = ranks.serve(policy, step)
    finally:
        dist.destroy_process_group()
    if not same:
        log.error("rank %d: the ranks' weights differ at the end of the job", rank)
    return 0 if same else 1


def run_child() -> None:
    """A child rank's process: `main`, then an exit that skips the interpreter's finalization. Gloo's worker
    threads can still hold the last asynchronous collectives' work (FSDP's reduce-scatters), whose tensors
    reach back into Python; freed during finalization they take the GIL of an interpreter being torn down,
    and the process dies of SIGABRT after a job that succeeded. Logs and streams are flushed first."""
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a child reports every failure in its log and its exit status
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_child()

"""The online-RL loop: rollouts through the taskapp-proxy, traces from the inference workers, GRPO updates,
new weights back to the workers. Read `Trainer.run` top to bottom; everything else is a helper it calls.

    for step in steps:
        batch  = groups of episodes for this step (played by the Task App through the proxy, each turn
                 recorded by a worker as a token trace), generated with weights at most `max_staleness`
                 versions old; a producer task plays the next batches while this one trains
        train  = GRPO on the batch: group advantages, the clipped objective against the sampler's
                 log-probs, the KL term when configured; skipped when the loss is not finite
        sync   = the new weights to every worker (`WeightPublisher`), version = the step's number
        eval   = with an eval split, one episode per eval seed every `eval_interval` steps and at the end
        report = a `train.step` event with the step's metrics, a line of metrics.jsonl, the reward plot;
                 a checkpoint every N steps, when TrainerService asks, and at the end

Several trainer ranks (trainer/ranks.py): this process is rank 0, the only one that talks to the mesh;
each update runs on every rank at once (DDP or FSDP, each on its shard of the batch) on a worker thread;
under FSDP the weights are gathered from every rank for weight sync and checkpoints (`Ranks.gathered`).

Shortcuts, on purpose: the policy is a Hugging Face causal LM loaded from a local directory; a group whose
episodes all failed or were too stale is dropped whole (GRPO needs at least two episodes to compare).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from opentelemetry import trace
from tandem.events.v1 import event_pb2, events_service_pb2
from tandem.inference.v1 import generation_pb2, trace_pb2
from tandem.inference.v1 import inference_service_pb2 as ipb
from tandem.taskapp.v1 import rollout_pb2
from tandem.taskapp.v1 import taskapp_service_pb2 as tpb

from tandem_jobs.config import Job
from trainer import checkpoints, dump, grpo, scoring
from trainer.checkpoints import STATE_FILE, TRIGGERS, CheckpointInfo, Trigger
from trainer.control import Control
from trainer.inference.publisher import WeightPublisher
from trainer.inference.weights import dtype_of
from trainer.progress import Progress
from trainer.ranks import Ranks, StepShard, Update
from trainer.scoring import (
    TrainSequence,
    batch_loss,
    load_policy,
    master_weights,
    reference_for,
    trainable,
    trained_tokens,
)
from trainer.seeds import episode_seed

log = logging.getLogger("tandem.trainer")
_tracer = trace.get_tracer("tandem.trainer")
MAX_BAD_STEPS = 3  # consecutive non-finite losses before the job stops
MAX_EMPTY_STEPS = 5  # consecutive steps without one usable group before the job stops
WORKER_PROBE_S = 10.0  # how long a worker has to answer GetWorkerInfo after a batch with failed episodes
STREAM_ATTEMPTS = 3  # StreamRollouts calls per batch: the first and two reopenings after a broken stream


@dataclass(frozen=True)
class WorkerEndpoint:
    stub: Any  # InferenceServiceStub
    openai_base_url: str  # ends in /v1
    model: str


@dataclass
class Environment:
    """What the trainer talks to: every outbound call goes through these stubs."""

    proxy: Any  # TaskAppServiceStub
    workers: Sequence[WorkerEndpoint]
    task_app: str  # orgs/{org}/taskApps/{app}
    job: str  # orgs/{org}/jobs/{job}
    output_dir: Path
    events: Any | None = None  # EventServiceStub
    control: Control = field(default_factory=Control)  # what TrainerService reads and asks
    ranks: Ranks | None = None  # the other trainer ranks (trainer/ranks.py); None: this process trains alone
    rpc_timeout_s: float = 120.0
    batch_timeout_s: float = 3600.0  # one batch's StreamRollouts call, all of its episodes together


@dataclass(frozen=True)
class Planned:
    """One episode to play: its correlation id, seed, the worker whose endpoint its policy calls go to, and
    its sampling seed (trainer/seeds.py)."""

    cid: str
    seed: int
    worker: WorkerEndpoint
    sampling_seed: int


@dataclass
class Episode:
    seed: int
    reward: float | None  # None: the rollout failed
    trace: trace_pb2.Trace | None
    error: str = ""


@dataclass(frozen=True)
class Played:
    """A played batch as the producer hands it over: the step it trains, its groups of episodes, how long
    playing it took, and how long the producer waited before it could start (the staleness bound: the
    generation side idle)."""

    index: int
    groups: list[list[Episode]]
    rollouts_s: float
    idle_s: float


@dataclass
class StepReport:
    step: int
    version: int
    metrics: dict[str, float] = field(default_factory=dict)
    skipped: bool = False


class Trainer:
    def __init__(self, job: Job, env: Environment, *, device: str | None = None) -> None:
        self.job = job
        self.env = env
        self.ranks = env.ranks or Ranks.alone(device or "cpu")
        self.device = torch.device(device) if device else self.ranks.device
        config = job.config
        self.model_dir = Path(config.model.dir)
        if job.weights_mode == "lora" and self.ranks.world_size > 1:
            raise ValueError(
                f'[weights] mode = "lora" trains on one trainer rank; this placement has {self.ranks.world_size}'
            )
        self.policy = load_policy(self.model_dir, self.device, job)  # float32 whatever the checkpoint's dtype
        # Workers serve, and checkpoints store, the model's own dtype unless the job names another.
        self.serve_dtype = dtype_of(config.model.dtype or checkpoints.model_dtype(self.model_dir))
        self.reference: torch.nn.Module | None = None
        if config.algorithm.kl_coef > 0:
            self.reference = reference_for(self.policy, self.model_dir, self.device, job)
        self.optimizer = torch.optim.AdamW(
            trainable(self.policy),
            lr=job.learning_rate(0),
            weight_decay=config.optimizer.weight_decay,
        )
        self.publisher = WeightPublisher(
            [w.stub for w in env.workers],
            bucket_size_bytes=32 * 1024 * 1024,
            rpc_timeout_s=env.rpc_timeout_s,
            events=env.events,
            job=env.job,
            gather=self.ranks.gathered,  # whole tensors a bucket at a time, from every rank under FSDP
            mode=job.weights_mode,
            full_every=config.weights.full_every or 20,
            lora=self._lora_spec(),
        )
        self.step = 0  # steps completed
        self.version = 0  # the weights in service on the workers
        self.run_id = secrets.token_hex(4)
        self.history: list[StepReport] = []
        self.control = env.control
        self.progress = Progress(env.output_dir, env.job)
        self.dumps = dump.RolloutDump.of(job, self.checkpoints(), env.events, env.job)  # None: off
        self._step_done = asyncio.Condition()
        self._bad_steps = 0
        self._empty_steps = 0
        self._seeds = job.seeds("train")
        random.Random(config.seed).shuffle(self._seeds)  # noqa: S311 - a reproducible order, not a secret
        torch.manual_seed(config.seed)

    # ---- the loop -----------------------------------------------------------------------------

    async def run(
        self, on_step: Callable[[StepReport], Awaitable[None] | None] | None = None
    ) -> list[StepReport]:
        steps = self.job.config.algorithm.steps
        control = self.control  # TrainerService: status, checkpoint and stop requests
        producer: asyncio.Task[None] | None = None
        try:
            self.resume()
            await self.publisher.connect()
            if self.version:  # resumed: the workers start from the checkpoint the job began with
                await self.publisher.publish(
                    self.version, self._named_weights(), in_flight=self.job.config.weights.in_flight
                )
            control.training(self.step, self.version, steps)
            batches: asyncio.Queue[Played] = asyncio.Queue()
            producer = asyncio.create_task(self._produce(batches, steps), name="rollouts")
            while self.step < steps and not control.stop_requested:  # a stop ends it after this step
                waited = time.perf_counter()
                played = await _next_batch(batches, producer)
                waited = time.perf_counter() - waited
                timings = {
                    "time/rollouts_s": played.rollouts_s,
                    "time/generation_idle_s": played.idle_s,
                    "time/trainer_idle_s": waited,
                }
                report = await self._train(played.index, played.groups, timings)
                self.history.append(report)
                if self._eval_due(steps):
                    report.metrics.update(await self.evaluate())
                control.stepped(report.step, report.version, report.metrics)
                self.progress.record(report.step, report.version, report.metrics, skipped=report.skipped)
                if self.progress.plot_due(report.step, self.step >= steps or control.stop_requested):
                    await asyncio.to_thread(self.progress.plot)
                if on_step is not None:
                    result = on_step(report)
                    if result is not None:
                        await result
                trigger = self._checkpoint_due(steps)
                if trigger is not None:
                    await self.save_checkpoint(trigger)
            await asyncio.to_thread(self.ranks.finish, self.policy, self.optimizer)  # every rank agrees
        except Exception as exc:
            control.failed(exc)
            raise
        finally:
            if producer is not None:
                producer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await producer
            self.publisher.close()
            control.ended()
        return self.history

    def _eval_due(self, steps: int) -> bool:
        if not self.job.config.data.HasField("eval"):
            return False
        interval = self.job.config.eval_interval
        return (
            self.step == steps or self.control.stop_requested or bool(interval and self.step % interval == 0)
        )

    def _checkpoint_due(self, steps: int) -> Trigger | None:
        """Why this step boundary gets a checkpoint, if it does: the end (unless a stop skips it), the
        interval, or a SaveCheckpoint waiting for it."""
        if (self.step == steps or self.control.stop_requested) and not self.control.skip_final_checkpoint:
            return Trigger.FINAL
        interval = self.job.config.checkpoint_interval
        if interval and self.step % interval == 0:
            return Trigger.INTERVAL
        return Trigger.REQUESTED if self.control.save_wanted else None

    async def _produce(self, batches: asyncio.Queue[Played], steps: int) -> None:
        """Play batch k once step k - max_staleness is done: its weights (or, after a skipped step, the
        unchanged ones) are in service, so no episode of batch k is more than max_staleness versions old."""
        lag = self.job.max_staleness
        for index in range(self.step, steps):
            idle = time.perf_counter()
            async with self._step_done:
                await self._step_done.wait_for(lambda index=index: self.step >= index - lag)  # type: ignore[misc]
            started = time.perf_counter()
            groups = await self._play(index)
            await batches.put(Played(index, groups, time.perf_counter() - started, started - idle))

    async def _play(self, index: int) -> list[list[Episode]]:
        algorithm = self.job.config.algorithm
        count, size, workers = len(self._seeds), algorithm.group_size, self.env.workers
        planned = []
        for prompt in range(algorithm.prompts_per_step):
            seed = self._seeds[(index * algorithm.prompts_per_step + prompt) % count]
            planned.append(
                [
                    Planned(
                        f"{self.run_id}-{index}-{prompt}-{member}",
                        seed,
                        workers[(prompt * size + member) % len(workers)],
                        episode_seed(self.job.config.seed, index + 1, prompt * size + member),
                    )
                    for member in range(size)
                ]
            )
        played = await self._play_planned(planned, self.job.config.data.train.env_config)
        if any(e.reward is None for group in played for e in group):
            await self._check_workers()  # failed episodes: a lost worker ends the job here, by name
        return played

    async def _check_workers(self) -> None:
        for number, worker in enumerate(self.env.workers):
            try:
                await worker.stub.GetWorkerInfo(ipb.GetWorkerInfoRequest(), timeout=WORKER_PROBE_S)
            except Exception as exc:
                raise WorkerLost(
                    f"inference worker {number} ({worker.openai_base_url}) does not answer: {exc}; "
                    "the job stops rather than train on the other workers' share alone"
                ) from exc

    async def _play_planned(self, planned: list[list[Planned]], env_config: Any) -> list[list[Episode]]:
        """Every planned episode over one `StreamRollouts` call; each trace is sealed on its worker as soon as
        its result arrives. A broken stream is reopened for the episodes without a result (the correlation id
        makes the repeat idempotent: the proxy answers finished ones from its record and joins running ones)."""
        plans = {p.cid: p for group in planned for p in group}
        # One span over the step's rollouts: the trace every rollout of the step follows through the proxy,
        # the Task App and its policy calls to the workers.
        with _tracer.start_as_current_span("trainer.rollouts", attributes={"tandem.episodes": len(plans)}):
            return await self._play_stream(plans, planned, env_config)

    async def _play_stream(
        self, plans: dict[str, Planned], planned: list[list[Planned]], env_config: Any
    ) -> list[list[Episode]]:
        done: dict[str, Episode] = {}
        answered: set[str] = set()
        sealing: list[asyncio.Task[None]] = []
        error = ""

        async def seal(plan: Planned, result: rollout_pb2.RolloutResult) -> None:
            done[plan.cid] = await self._seal(plan, result)

        for _attempt in range(STREAM_ATTEMPTS):
            pending = [p for p in plans.values() if p.cid not in answered]
            if not pending:
                break
            requests = [
                tpb.StreamRolloutsRequest(
                    task_app=self.env.task_app, spec=self._spec(p, env_config), job=self.env.job
                )
                for p in pending
            ]
            try:
                call = self.env.proxy.StreamRollouts(iter(requests), timeout=self.env.batch_timeout_s)
                async for answer in call:
                    plan = plans.get(answer.result.trace_correlation_id)
                    if plan is not None and plan.cid not in answered:
                        answered.add(plan.cid)
                        sealing.append(asyncio.create_task(seal(plan, answer.result)))
                error = ""
                break
            except Exception as exc:  # the step goes on with the episodes that finished, and reports the rest
                error = f"rollout stream: {exc}"
                log.warning("rollout stream broke (%s); resending the episodes without a result", exc)
        await asyncio.gather(*sealing)
        return [
            [done.get(p.cid) or Episode(p.seed, None, None, error or "rollout: no result") for p in group]
            for group in planned
        ]

    def _spec(self, plan: Planned, env_config: Any) -> rollout_pb2.RolloutSpec:
        settings = self.job.config.sampling
        policy = rollout_pb2.RolloutPolicyConfig(
            model=plan.worker.model, inference_url=f"{plan.worker.openai_base_url}/traces/{plan.cid}"
        )
        policy.temperature = self.job.temperature
        if settings.max_tokens:
            policy.max_completion_tokens = settings.max_tokens
        # The app passes these on to the worker, which records them in the turn the trainer scores.
        if self.job.top_p < 1:
            policy.top_p = self.job.top_p
        if self.job.top_k:
            policy.top_k = self.job.top_k
        if self.job.min_p:
            policy.min_p = self.job.min_p
        policy.seed = plan.sampling_seed
        spec = rollout_pb2.RolloutSpec(
            trace_correlation_id=plan.cid,
            env=rollout_pb2.RolloutEnv(seed=plan.seed, config=env_config),
            policy=rollout_pb2.RolloutPolicy(config=policy),
        )
        if self.job.config.task_app.HasField("limits"):
            spec.limits.CopyFrom(self.job.config.task_app.limits)
        return spec

    async def _seal(self, plan: Planned, result: rollout_pb2.RolloutResult) -> Episode:
        try:
            trace = (
                await plan.worker.stub.FinishTrace(
                    ipb.FinishTraceRequest(correlation_id=plan.cid), timeout=self.env.rpc_timeout_s
                )
            ).trace
        except Exception as exc:
            return Episode(plan.seed, None, None, f"trace: {exc}")
        if result.HasField("error") and result.error.message:
            return Episode(plan.seed, None, trace, f"rollout: {result.error.message}")
        return Episode(plan.seed, result.metrics.outcome_reward, trace)

    async def evaluate(self) -> dict[str, float]:
        """One episode per seed of the eval split, played with the weights in service now and the job's
        sampling settings; nothing is trained on. Announced as an `eval.completed` event."""
        workers, split = self.env.workers, self.job.config.data.eval
        planned = [
            [
                Planned(
                    f"{self.run_id}-eval{self.step}-{i}",
                    seed,
                    workers[i % len(workers)],
                    episode_seed(self.job.config.seed, self.step, i, "eval"),
                )
            ]
            for i, seed in enumerate(self.job.seeds("eval"))
        ]
        played = [e for group in await self._play_planned(planned, split.env_config) for e in group]
        rewards = [e.reward for e in played if e.reward is not None]
        metrics = {
            "eval/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "eval/episodes": float(len(rewards)),
            "eval/failed": float(len(played) - len(rewards)),
        }
        if self.env.events is not None:
            event = event_pb2.Event(
                type="eval.completed",
                message=f"eval at step {self.step}: reward {metrics['eval/reward_mean']:.3f} "
                f"over {len(rewards)} episodes",
            )
            event.payload.update({"step": self.step, "weight_version": self.version, **metrics})
            try:
                await self.env.events.Publish(
                    events_service_pb2.PublishRequest(job=self.env.job, events=[event]), timeout=30
                )
            except Exception:
                log.warning("could not publish the eval at step %d", self.step, exc_info=True)
        return metrics

    # ---- one update ---------------------------------------------------------------------------

    async def _train(
        self, index: int, groups: list[list[Episode]], timings: dict[str, float] | None = None
    ) -> StepReport:
        """One step on a played batch; `timings` (how long it was played, and how long each side waited for
        the other) join its metrics."""
        started = time.perf_counter()
        job = self.job
        failed = sum(1 for g in groups for e in g if e.reward is None)
        decisions: list[grpo.Staleness] = []
        kept: list[list[Episode]] = []
        for group in groups:
            usable = []
            for episode in group:
                if episode.reward is None or episode.trace is None or not episode.trace.turns:
                    continue
                decision = grpo.staleness(episode.trace.min_weight_version, self.version, job.max_staleness)
                decisions.append(decision)
                if decision.used:
                    usable.append(episode)
            if len(usable) >= 2:
                kept.append(usable)
        rewards = [e.reward for g in groups for e in g if e.reward is not None]
        metrics: dict[str, float] = {
            "reward/mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "episodes/failed": float(failed),
            **{f"staleness/{k}": float(v) for k, v in grpo.staleness_counts(decisions).items()},
            **(timings or {}),
        }
        report = StepReport(index + 1, self.version, metrics)
        if not kept:
            report.skipped = True  # nothing to learn from: the weights stay as they are
            log.warning("step %d: no usable group (%d failed episodes)", index + 1, failed)
            self._empty_steps += 1
            if self._empty_steps >= MAX_EMPTY_STEPS:
                errors = sorted({e.error for g in groups for e in g if e.error})[:3]
                raise RuntimeError(f"{MAX_EMPTY_STEPS} steps in a row had nothing to train on: {errors}")
            await self._finish_step(report, started, update=False)
            return report
        sequences, advantages, counts = self._sequences(kept)
        metrics.update(counts)
        rng_state = torch.get_rng_state()  # what a replay of the step starts from
        # On a worker thread, so the producer keeps playing the next batches while this one trains.
        update = await asyncio.to_thread(self._update, sequences, advantages, job.learning_rate(index))
        if self.dumps is not None:  # the batch and its outcome, for `tandem rl replay` (trainer/dump.py)
            await self.dumps.record(
                index + 1,
                version=self.version,
                lr=job.learning_rate(index),
                job=job,
                ranks=self.ranks.world_size,
                groups=kept,
                sequences=sequences,
                advantages=advantages,
                rng_state=rng_state,
                update=update,
            )
        if not update.finite:  # on any rank: every rank skipped it
            self._bad_steps += 1
            report.skipped = True
            metrics["loss/non_finite"] = 1.0
            log.warning("step %d: the loss is not finite; update skipped", index + 1)
            if self._bad_steps >= MAX_BAD_STEPS:
                raise RuntimeError(f"{MAX_BAD_STEPS} steps in a row had a non-finite loss; stopping")
            await self._finish_step(report, started, update=False)
            return report
        self._bad_steps = 0
        self._empty_steps = 0
        if update.grad_norm is not None:
            metrics["grad_norm"] = update.grad_norm
        stats = update.stats  # the whole batch's, over every rank
        metrics.update(
            {
                "loss": stats.loss,
                "kl": stats.kl,
                "entropy": update.entropy,
                "clip_fraction": stats.clip_fraction,
                "ratio/mean": stats.ratio_mean,
                "ratio/max": stats.ratio_max,
                "mismatch/ratio_abs": stats.mismatch_abs,
                "mismatch/kl": stats.mismatch_kl,
                "lr": job.learning_rate(index),
                "tokens": float(update.tokens),
                "reward/std": float(torch.tensor([e.reward for g in kept for e in g]).std()),
            }
        )
        await self._finish_step(report, started, update=True)
        return report

    async def _finish_step(self, report: StepReport, started: float, *, update: bool) -> None:
        if update:
            sync = await self.publisher.publish(
                report.step, self._named_weights(), in_flight=self.job.config.weights.in_flight
            )
            report.metrics["weight_sync_s"] = sync.total_s
            if self.publisher.mode != "full":  # what went on the wire (LoRA: the adapter)
                report.metrics["weight_sync/bytes"] = float(sync.bytes)
            if self.publisher.mode == "delta":  # against a whole update
                report.metrics["weight_sync/full_bytes"] = float(sync.full_bytes)
        async with self._step_done:
            self.step = report.step
            if update:
                self.version = report.step
            self._step_done.notify_all()
        report.version = self.version
        elapsed = time.perf_counter() - started
        report.metrics["step_s"] = elapsed
        if report.metrics.get("tokens"):
            report.metrics["tokens_per_s"] = report.metrics["tokens"] / elapsed
        log.info("step %d", report.step, extra={"metrics": report.metrics})
        await self._publish_metrics(report, elapsed)

    def _sequences(
        self, groups: list[list[Episode]]
    ) -> tuple[list[TrainSequence], list[float], dict[str, float]]:
        """Per trained turn: (token ids, completion start, sampler log-probs, loss mask, how it was
        sampled, whether older weights sampled it), each turn's advantage (its episode's), and the counts
        the step reports: groups without signal, trained tokens dropped for a non-finite sampler log-prob, truncated
        completions (left out of the loss with `mask_truncated`)."""
        sequences: list[TrainSequence] = []
        advantages: list[float] = []
        zero = dropped = truncated = 0
        job = self.job
        for group in groups:
            rewards = torch.tensor([e.reward for e in group], dtype=torch.float64)
            adv, stats = grpo.group_advantages(
                rewards, len(group), normalize_std=job.normalize_std, std_floor=job.std_floor
            )
            zero += stats.zero_variance
            for episode, value in zip(group, adv.tolist(), strict=True):
                assert episode.trace is not None
                for turn in episode.trace.turns:
                    if not turn.completion_token_ids:
                        continue
                    logprobs, mask, bad = grpo.drop_non_finite(turn.sampler_logprobs, turn.loss_mask)
                    dropped += bad
                    if turn.finish_reason == generation_pb2.FINISH_REASON_LENGTH:
                        truncated += 1
                        if job.config.algorithm.mask_truncated:
                            mask = [False] * len(mask)
                    prompt = list(turn.prompt_token_ids)
                    sequences.append(
                        (
                            prompt + list(turn.completion_token_ids),
                            len(prompt),
                            logprobs,
                            mask,
                            (turn.temperature, turn.top_k, turn.top_p or 1.0, turn.min_p),
                            turn.weight_version < self.version,
                        )
                    )
                    advantages.append(value)
        counts = {
            "groups/zero_variance": float(zero),
            "tokens/non_finite_logprob": float(dropped),
            "completions/truncated": float(truncated),
        }
        return sequences, advantages, counts

    def _update(self, sequences: list[TrainSequence], advantages: list[float], lr: float) -> Update:
        """One GRPO update on every trainer rank at once: rank 0 sends each rank its shard of the batch
        (trainer/ranks.py), and each runs `train_shard` on it."""
        module = self.ranks.wrap(self.policy, self.optimizer)  # DDP over the ranks; the policy when alone
        tokens = [trained_tokens(s) for s in sequences]
        shard = self.ranks.scatter(sequences, advantages, tokens, lr=lr, aggregation=self.job.aggregation)
        return train_shard(self.ranks, module, self.reference, self.optimizer, shard, self.job, self.device)

    def _loss(
        self, sequences: list[TrainSequence], advantages: list[float]
    ) -> tuple[torch.Tensor, grpo.LossStats, float, int]:
        """The loss of `sequences` under this process's policy alone (no other rank is involved)."""
        return batch_loss(self.policy, self.reference, sequences, advantages, self.job, self.device)

    def _lora_spec(self) -> Any:
        """LoRA mode: the adapter's shape with the module names peft matched (what the workers add)."""
        if self.job.weights_mode != "lora":
            return None
        from trainer import lora  # noqa: PLC0415

        return lora.resolved(self.policy)

    def _named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters in checkpoint naming, a tied one once (as the workers' manifest lists them), in the
        dtype the workers serve (a copy when it is not the trainer's float32); in LoRA mode the adapter's
        tensors in peft's saved naming."""
        if self.job.weights_mode == "lora":
            from trainer import lora  # noqa: PLC0415

            return lora.adapter_weights(self.policy, self.serve_dtype)
        return [
            (name, parameter.detach().to(self.serve_dtype))
            for name, parameter in self.policy.named_parameters()
        ]

    # ---- progress and checkpoints -------------------------------------------------------------

    async def _publish_metrics(self, report: StepReport, elapsed: float) -> None:
        if self.env.events is None:
            return
        event = event_pb2.Event(
            type="train.step",
            message=f"step {report.step}: reward {report.metrics.get('reward/mean', 0):.3f}",
        )
        event.train_step.step = report.step
        event.train_step.weight_version = report.version
        for name, value in report.metrics.items():
            if grpo.finite(value):
                event.train_step.metrics[name] = value
        event.train_step.duration.FromNanoseconds(int(elapsed * 1e9))
        try:
            await self.env.events.Publish(
                events_service_pb2.PublishRequest(job=self.env.job, events=[event]), timeout=30
            )
        except Exception:  # progress reporting must not stop training
            log.warning("could not publish step %d", report.step, exc_info=True)

    def checkpoints(self) -> Path:
        return self.env.output_dir / "checkpoints"

    async def save_checkpoint(self, trigger: Trigger = Trigger.INTERVAL) -> CheckpointInfo | None:
        """Hugging Face files plus the state to resume, written beside, synced and renamed into place. A
        failed write (a full disk) removes its partial folder and leaves the previous checkpoint intact;
        training goes on without this one, except that a final checkpoint that cannot be written fails the
        job, since it is the job's result."""
        self.control.checkpointing()
        started = time.perf_counter()
        try:
            saved = await asyncio.to_thread(self._write_checkpoint, trigger)
        except Exception as exc:
            self.control.checkpoint_failed(self.step, exc)
            if trigger is Trigger.FINAL:
                raise RuntimeError(
                    f"the final checkpoint (step {self.step}) could not be written: {exc}"
                ) from exc
            log.error(
                "the checkpoint at step %d could not be written; training goes on", self.step, exc_info=True
            )
            return None
        await self._announce_checkpoint(saved, time.perf_counter() - started)
        self.control.checkpointed(saved)
        return saved

    def _write_checkpoint(self, trigger: Trigger) -> CheckpointInfo:
        final = checkpoints.folder(self.checkpoints(), self.step)
        partial = final.with_name(final.name + checkpoints.PARTIAL_SUFFIX)
        shutil.rmtree(partial, ignore_errors=True)
        try:
            partial.mkdir(parents=True)
            self._save_weights(partial)
            for item in self.model_dir.iterdir():
                if "token" in item.name or item.name in ("chat_template.jinja", "special_tokens_map.json"):
                    shutil.copy2(item, partial / item.name)
            state = {
                "step": self.step,
                "version": self.version,
                "optimizer": self.ranks.optimizer_state(self.optimizer),
                "torch_rng": torch.get_rng_state(),
                "run_id": self.run_id,
            }
            if self.serve_dtype != torch.float32 or self.job.weights_mode == "lora":
                state["master_weights"] = master_weights(self.policy)  # the folder's are rounded
            torch.save(state, partial / STATE_FILE)
            last = self.history[-1] if self.history else None
            checkpoints.write_metadata(
                partial,
                job=self.env.job,
                step=self.step,
                weight_version=self.version,
                trigger=trigger,
                metrics=last.metrics if last is not None and last.step == self.step else {},
            )
            checkpoints.make_durable(partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)  # gives back what a full disk let it write
            raise
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        checkpoints.sync_folder(final.parent)
        saved = checkpoints.read(final)
        assert saved is not None, f"{final} has no readable {checkpoints.METADATA_FILE}"
        return saved

    def _save_weights(self, folder: Path) -> None:
        """The checkpoint's model files: a Hugging Face folder (gathered a file at a time under FSDP), or in
        LoRA mode the adapter's (and the merged model, when the job asks)."""
        if self.job.weights_mode != "lora":
            self.ranks.save_pretrained(self.policy, folder, self.serve_dtype)
            return
        from trainer import lora  # noqa: PLC0415

        merged = self.job.config.weights.lora.merged_checkpoints
        lora.save_checkpoint(self.policy, folder, self.serve_dtype, merged=merged)

    async def _announce_checkpoint(self, saved: CheckpointInfo, seconds: float) -> None:
        if self.env.events is None:
            return
        event = event_pb2.Event(
            type="checkpoint.saved", message=f"checkpoint at step {saved.step}: {saved.path}"
        )
        announced = event.checkpoint_saved
        announced.checkpoint = f"{self.env.job}/checkpoints/{saved.id}"
        announced.step = saved.step
        announced.weight_version = saved.weight_version
        announced.uri = saved.path.as_uri()
        announced.size_bytes = saved.size_bytes
        announced.save_duration.FromNanoseconds(int(seconds * 1e9))
        if saved.trigger is not None:
            announced.trigger = TRIGGERS[saved.trigger]
        announced.resumable = saved.resumable
        try:
            await self.env.events.Publish(
                events_service_pb2.PublishRequest(job=self.env.job, events=[event]), timeout=30
            )
        except Exception:
            log.warning("could not announce the checkpoint at step %d", saved.step, exc_info=True)

    def resume(self) -> bool:
        """Continue from the newest complete checkpoint in the output folder, if there is one."""
        for stale in self.checkpoints().glob(f"step-*{checkpoints.PARTIAL_SUFFIX}"):
            shutil.rmtree(stale, ignore_errors=True)  # a write the previous process did not finish
        found = checkpoints.list_all(self.checkpoints())  # the complete ones, newest first
        if not found:
            return False
        self.control.last_checkpoint = found[0]
        latest = found[0].path
        self.policy = load_policy(latest, self.device, self.job)
        state = torch.load(latest / STATE_FILE, weights_only=False)
        if "master_weights" in state:
            self.policy.load_state_dict(state["master_weights"], strict=self.job.weights_mode != "lora")
        self.optimizer = torch.optim.AdamW(
            trainable(self.policy),
            lr=self.job.learning_rate(0),
            weight_decay=self.job.config.optimizer.weight_decay,
        )
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self.step = int(state["step"])
        self.version = int(state["version"]) or self.step
        self.run_id = f"{state['run_id']}r{self.step}"
        log.info("resumed from %s at step %d", latest, self.step)
        return True


class WorkerLost(RuntimeError):
    """An inference worker of the job stopped answering."""


async def _next_batch(batches: asyncio.Queue[Played], producer: asyncio.Task[None]) -> Played:
    """The next played batch, or the producer's error if it fails first (it would never put the batch)."""
    getter = asyncio.ensure_future(batches.get())
    await asyncio.wait({getter, producer}, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    producer.result()  # raises the producer's error
    raise RuntimeError("the rollout producer ended before the last step")


def train_shard(
    ranks: Ranks,
    policy: torch.nn.Module,
    reference: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    shard: StepShard,
    job: Job,
    device: torch.device,
) -> Update:
    """One rank's part of a GRPO update, the same code on every rank: forward and backward over its shard in
    micro-batches (trainer/scoring.py), the loss weighted so that DDP's mean of the ranks' gradients is the
    whole batch's; then the ranks share their losses, and unless every rank's is finite none of them steps
    (each drops its gradients); otherwise clip and step."""
    for param_group in optimizer.param_groups:
        param_group["lr"] = shard.lr
    optimizer.zero_grad(set_to_none=True)
    # Under FSDP each rank's shard is one pass for now: with micro-batches (every rank running as many, so
    # that the all-gathers line up) a 2-rank update came out about 2e-3 off one process's in
    # tests/trainer/test_ranks.py, where one pass matches it to 1e-5.
    budget = None if job.sharding == "fsdp" else job.micro_batch_tokens
    loss, stats, entropy, tokens = scoring.accumulate(
        policy, reference, shard.sequences, shard.advantages, job, device, scale=shard.weight, budget=budget
    )
    update = ranks.exchange(
        float(loss) * shard.weight,
        stats.policy_loss * shard.weight,
        stats,
        entropy,
        0 if shard.padding else tokens,
    )
    if not update.finite:
        optimizer.zero_grad(set_to_none=True)
        return update
    if job.max_grad_norm > 0:
        update.grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), job.max_grad_norm))
    optimizer.step()
    return update

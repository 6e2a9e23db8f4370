"""The loop's guards, on its update step alone: a step with nothing usable and a step whose loss is not
finite leave the weights untouched, and a run of them stops the job with a clear error."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tandem.inference.v1 import trace_pb2

from tandem_jobs.config import Job, parse_job
from trainer.models import build_tiny_model
from trainer.train import MAX_BAD_STEPS, MAX_EMPTY_STEPS, Environment, Episode, Trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def trainer(model_dir: Path, tmp_path: Path) -> Trainer:
    job = Job(
        parse_job(
            {
                "model": {"dir": str(model_dir)},
                "task_app": {"name": "orgs/demo/taskApps/single-turn"},
                "data": {"train": {"seeds": [{"start": 0, "end": 10}]}},
                "algorithm": {"group_size": 2, "prompts_per_step": 1, "steps": 10},
                "optimizer": {"learning_rate": 1e-2},
            }
        )
    )
    env = Environment(
        proxy=None,
        workers=[],
        task_app="orgs/demo/taskApps/single-turn",
        job="orgs/demo/jobs/j",
        output_dir=tmp_path,
    )
    return Trainer(job, env)


def episode(
    reward: float, logprob: float, *, logprobs: list[float] | None = None, mask: list[bool] | None = None
) -> Episode:
    trace = trace_pb2.Trace(correlation_id="c", min_weight_version=0)
    turn = trace.turns.add(temperature=1.0)
    turn.prompt_token_ids.extend([5, 6, 7])
    turn.completion_token_ids.extend([8, 9, 10])
    turn.sampler_logprobs.extend(logprobs or [logprob] * 3)
    turn.loss_mask.extend(mask or [True] * 3)
    return Episode(seed=1, reward=reward, trace=trace)


def weights(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.policy.parameters()]


async def test_a_step_with_only_failed_episodes_changes_nothing_and_a_run_of_them_stops(
    model_dir: Path, tmp_path: Path
) -> None:
    t = trainer(model_dir, tmp_path)
    before = weights(t)
    failed = [
        [Episode(1, None, None, "rollout: the app answered 500"), Episode(1, None, None, "rollout: timeout")]
    ]
    report = await t._train(0, failed)
    assert report.skipped and report.metrics["episodes/failed"] == 2 and t.version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, weights(t), strict=True))
    with pytest.raises(RuntimeError, match="nothing to train on") as info:
        for index in range(1, MAX_EMPTY_STEPS):
            await t._train(index, failed)
    assert "500" in str(info.value)


async def test_a_non_finite_loss_skips_the_update_and_a_run_of_them_stops(
    model_dir: Path, tmp_path: Path
) -> None:
    t = trainer(model_dir, tmp_path)
    before = weights(t)
    poisoned = [[episode(math.nan, -1.0), episode(0.0, -1.0)]]  # a NaN reward: NaN advantages
    report = await t._train(0, poisoned)
    assert report.skipped and report.metrics["loss/non_finite"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, weights(t), strict=True))
    with pytest.raises(RuntimeError, match="non-finite"):
        for index in range(1, MAX_BAD_STEPS):
            await t._train(index, poisoned)


async def test_a_non_finite_sampler_logprob_changes_nothing_where_masked_and_is_dropped_and_counted_where_trained(
    model_dir: Path, tmp_path: Path
) -> None:
    first = {
        "clean": ([-1.0, -1.2, -0.7], [True, True, False]),
        "masked_nan": ([-1.0, -1.2, math.nan], [True, True, False]),
        "masked_inf": ([-1.0, -1.2, -math.inf], [True, True, False]),
        "trained_nan": ([-1.0, math.nan, -0.7], [True, True, True]),
        "without": ([-1.0, -1.2, -0.7], [True, False, True]),
    }
    after: dict[str, list[torch.Tensor]] = {}
    metrics: dict[str, dict[str, float]] = {}
    for name, (logprobs, mask) in first.items():
        t = trainer(model_dir, tmp_path / name)  # each from the same initial weights
        report = await t._train(0, [[episode(1.0, 0, logprobs=logprobs, mask=mask), episode(0.0, -1.5)]])
        assert not report.skipped, report.metrics
        after[name], metrics[name] = weights(t), report.metrics
    for name in ("masked_nan", "masked_inf"):  # exactly the clean step
        assert all(torch.equal(a, b) for a, b in zip(after["clean"], after[name], strict=True))
        assert metrics[name]["tokens/non_finite_logprob"] == 0.0
    # At a trained position the token is dropped: the same step as with that token masked off, and counted.
    assert all(torch.equal(a, b) for a, b in zip(after["without"], after["trained_nan"], strict=True))
    assert metrics["trained_nan"]["tokens/non_finite_logprob"] == 1.0
    assert metrics["trained_nan"]["tokens"] == metrics["without"]["tokens"] == 5.0

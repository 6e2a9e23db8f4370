"""Rollout dump and replay on CPU: a short job with `[rollout_dump]` on (the embedded mesh, the example
single-turn Task App, a real inference worker), then each step recomputed from its dump and the checkpoint
before it, in a process of its own, bit-identical to what the job recorded; a bad step (a non-finite loss,
a NaN sampler log-prob) dumped as it went and replayed the same; the budget pruning the oldest
dumps with its event; the clear refusals (a step not dumped, no checkpoint before it, a damaged dump); and
`tandem rl replay` finding the dump from the job's checkpoints through the gateway."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tandem.events.v1 import event_pb2
from tandem.events.v1 import events_service_pb2 as epb

from tandem_jobs.config import Job
from tests.cli.test_cli import Cli, publisher
from tests.support.mesh import mesh_settings, running_mesh
from tests.trainer.test_train_faults import episode
from tests.trainer.test_train_loop import demo_job
from trainer import dump
from trainer.dump import DumpError
from trainer.launch import local_environment
from trainer.models import build_tiny_model
from trainer.replay import NotReplayable, replay, same
from trainer.train import Environment, Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def dumping_job(model_dir: Path, steps: int, budget_mib: float = 0.0) -> Job:
    """test_train_loop's job with a KL term (the reference model is loaded to replay it), top-k sampling,
    several micro-batches per update, a checkpoint every step and the dump on."""
    job = demo_job(model_dir, steps, sampling={"top_k": 40}, kl_coef=0.05)
    job.config.checkpoint_interval = 1
    job.config.training.micro_batch_tokens = 64
    job.config.rollout_dump.enabled = True
    job.config.rollout_dump.budget_mib = budget_mib
    return job


async def _train(job: Job, output: Path) -> list[event_pb2.Event]:
    """Run `job` into `output`; its `rollout_dump.pruned` events."""
    async with local_environment(job, output) as env:
        await Trainer(job, env).run()
        listed = await env.events.ListEvents(
            epb.ListEventsRequest(job=env.job, types=["rollout_dump.pruned"])
        )
        return list(listed.events)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def run(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of a 3-step job that dumped every step and checkpointed every step."""
    output = tmp_path_factory.mktemp("run") / "out"
    asyncio.run(_train(dumping_job(model_dir, STEPS), output))
    return output


def recorded_metrics(output: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def replay_process(*args: str) -> tuple[int, str, str]:
    """`python -m trainer.replay` as a user runs it, in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "gen" / "python")])}
    done = subprocess.run(
        [sys.executable, "-m", "trainer.replay", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    return done.returncode, done.stdout, done.stderr


def test_every_step_replays_bit_identically_in_a_process_of_its_own(run: Path, model_dir: Path) -> None:
    rollouts = run / "checkpoints" / "rollouts"
    assert dump.steps(rollouts) == [1, 2, 3]
    metrics = recorded_metrics(run)
    for step in range(1, STEPS + 1):
        code, out, err = replay_process("--dump", str(rollouts), "--step", str(step), "--json")
        assert code == 0, out + err
        result = json.loads(out)
        assert result["identical"] and result["differing"] == []
        replayed, recorded = result["replayed"], result["recorded"]
        assert replayed == recorded
        # What the dump says the step recorded is what the job reported for it (metrics.jsonl, train.step).
        assert same(recorded["loss"], metrics[step]["loss"])
        assert same(recorded["grad_norm"], metrics[step]["grad_norm"])
        assert same(recorded["kl"], metrics[step]["kl"])
        assert recorded["tokens"] == metrics[step]["tokens"] > 0
        before = model_dir.resolve() if step == 1 else run / "checkpoints" / f"step-{step - 1:06d}"
        assert result["weights"] == str(before)


def test_the_table_says_bit_identical_and_names_a_figure_that_differs(run: Path, tmp_path: Path) -> None:
    code, out, _ = replay_process("--checkpoint", str(run / "checkpoints"), "--step", "2")
    assert code == 0, out
    assert "grad_norm" in out and "step 2: bit-identical to what the job recorded" in out
    code, out, _ = replay_process("--checkpoint", str(run / "checkpoints" / "step-000001"), "--step", "2")
    assert code == 0 and "step 2, replayed from " + str(run / "checkpoints" / "step-000001") in out
    # A dump whose recorded loss is not what the batch gives: the replay finds it and says by how much.
    copy = tmp_path / "checkpoints"
    shutil.copytree(run / "checkpoints", copy)
    meta = dump.metadata_file(copy / "rollouts", 2)
    document = json.loads(meta.read_text())
    document["recorded"]["loss"] += 1e-9
    meta.write_text(json.dumps(document))
    result = replay(copy / "rollouts", 2)
    assert result.differing == ["loss"]
    code, out, _ = replay_process("--checkpoint", str(copy), "--step", "2")
    assert code == 1 and "step 2: differs in loss" in out and "DIFFERS by -1.000e-09" in out


def test_the_dump_holds_the_batch_as_it_was_trained(run: Path) -> None:
    step = dump.read(run / "checkpoints" / "rollouts", 3)
    t = step.tensors
    assert step.step == 3 and step.version == 2 and step.ranks == 1
    assert t["episode_seeds"].numel() == t["episode_rewards"].numel() == 16  # 4 groups of 4, none failed
    assert set(t["episode_groups"].tolist()) == {0, 1, 2, 3}
    rewards = t["episode_rewards"].view(4, 4)
    per_sequence = t["advantages"]
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    for row, played in enumerate(t["sequence_episodes"].tolist()):
        group, member = divmod(played, 4)
        assert (per_sequence[row] == 0) == bool(centred[group, member] == 0)
    # The trainer's log-probs are the trace's wherever those are finite; every sequence has its versions.
    finite = torch.isfinite(t["trace_logprobs"])
    assert torch.equal(t["sampler_logprobs"][finite], t["trace_logprobs"][finite])
    assert set(t["weight_versions"].tolist()) <= {1, 2}
    assert t["lagging"].tolist() == [v < 2 for v in t["weight_versions"].tolist()]


def test_a_step_that_cannot_be_replayed_says_why_and_which_can(run: Path, tmp_path: Path) -> None:
    rollouts = run / "checkpoints" / "rollouts"
    with pytest.raises(DumpError, match=r"step 9 is not in the rollout dump .*\(steps dumped: 1-3\)"):
        replay(rollouts, 9)
    # Without the checkpoint of step 1 (a longer checkpoint interval), step 2 has no weights to start from.
    copy = tmp_path / "checkpoints"
    shutil.copytree(run / "checkpoints", copy)
    shutil.rmtree(copy / "step-000001")
    with pytest.raises(NotReplayable, match=r"no checkpoint of step 1 .*replayed from this dump: 1, 3$"):
        replay(copy / "rollouts", 2)
    code, _, err = replay_process("--checkpoint", str(copy), "--step", "2")
    assert (
        code == 2 and err.startswith("error: step 2 trained the weights of step 1") and "Traceback" not in err
    )
    # A damaged dump: one flipped byte in the tensors, then a JSON cut short.
    data = dump.tensors_file(copy / "rollouts", 3)
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(DumpError, match="does not match the SHA-256 its JSON recorded: the dump is damaged"):
        replay(copy / "rollouts", 3)
    meta = dump.metadata_file(copy / "rollouts", 1)
    meta.write_text(meta.read_text()[:100])
    with pytest.raises(DumpError, match=r"the dump of step 1 .* cannot be read: JSONDecodeError"):
        replay(copy / "rollouts", 1)


async def test_a_bad_step_is_dumped_as_it_went_and_replays_the_same(model_dir: Path, tmp_path: Path) -> None:
    # The update step alone, fed by hand as tests/trainer/test_train_faults.py does: no mesh, no workers.
    env = Environment(
        proxy=None, workers=[], task_app="orgs/demo/taskApps/single-turn", job="j", output_dir=tmp_path
    )
    t = Trainer(dumping_job(model_dir, 10), env)
    rollouts = tmp_path / "checkpoints" / "rollouts"
    # A NaN reward makes NaN advantages and a non-finite loss: the update is skipped, and the dump keeps it.
    report = await t._train(0, [[episode(math.nan, -1.0), episode(0.0, -1.0)]])
    assert report.skipped and report.metrics["loss/non_finite"] == 1.0
    result = replay(rollouts, 1)
    assert not result.recorded.finite and not result.replayed.finite and result.identical
    assert math.isnan(float(dump.read(rollouts, 1).tensors["advantages"][0]))
    await t.save_checkpoint()  # the weights step 2 trains
    # A NaN sampler log-prob at a trained position: dropped from the loss, kept in the dump's trace log-probs.
    poisoned = [[episode(1.0, -1.0, logprobs=[-1.0, math.nan, -0.7]), episode(0.0, -1.0)]]
    report = await t._train(1, poisoned)
    assert not report.skipped and report.metrics["tokens/non_finite_logprob"] == 1.0
    result = replay(rollouts, 2)
    assert result.identical and result.recorded.finite and result.recorded.tokens == 5
    assert result.batch["non_finite_trace_logprobs"] == 1 and result.weights.endswith("step-000001")
    step = dump.read(rollouts, 2)
    assert math.isnan(float(step.tensors["trace_logprobs"][1]))
    assert step.sequences[0][2] == pytest.approx([-1.0, 0.0, -0.7]) and step.sequences[0][3] == [
        True,
        False,
        True,
    ]


async def test_the_budget_keeps_the_newest_dumps_and_an_event_names_what_it_removed(
    model_dir: Path, tmp_path: Path
) -> None:
    # A budget below one step's dump: each step's write removes the step before it, never its own.
    events = await _train(dumping_job(model_dir, 3, budget_mib=0.001), tmp_path / "out")
    rollouts = tmp_path / "out" / "checkpoints" / "rollouts"
    assert dump.steps(rollouts) == [3]
    assert sorted(p.name for p in rollouts.iterdir()) == ["step-000003.json", "step-000003.safetensors"]
    pruned = list(events)
    assert [list(e.payload["pruned_steps"]) for e in pruned] == [[1.0], [2.0]]
    assert [e.payload["step"] for e in pruned] == [2.0, 3.0]
    assert all(e.payload["freed_bytes"] > e.payload["budget_bytes"] == 1048 for e in pruned)
    assert "removed steps 1" in pruned[0].message


async def test_tandem_rl_replay_finds_the_dump_from_the_jobs_checkpoints(run: Path, tmp_path: Path) -> None:
    async with running_mesh(mesh_settings(tmp_path / "mesh")) as mesh:
        cli = Cli(mesh.address("gateway"), mesh.settings.state_dir)
        code, out, err = await cli.run("orgs", "create", "acme", "--state-dir", str(cli.state_dir), "--json")
        assert code == 0, err
        cli.key = json.loads(out)["key"]
        code, _, err = await cli.run("rl", "replay", "replayed", "--step", "3")
        assert code == 1 and "JOB_NOT_FOUND" in err
        # The job's events as its trainer publishes them: first a step, then its checkpoints, which
        # `tandem checkpoints list` shows and `tandem rl replay` finds the output folder by.
        channel, events = await publisher(mesh.settings, mesh.address("events"))
        first = event_pb2.Event(type="train.step", message="step 1")
        first.train_step.step = 1
        await events.Publish(epb.PublishRequest(job="orgs/acme/jobs/replayed", events=[first]))
        code, _, err = await cli.run("rl", "replay", "replayed", "--step", "3")
        assert code == 1 and "has saved no checkpoint yet" in err and "python -m trainer.replay" in err
        announced = []
        for step in range(1, STEPS + 1):
            event = event_pb2.Event(type="checkpoint.saved", message=f"checkpoint at step {step}")
            event.checkpoint_saved.checkpoint = f"orgs/acme/jobs/replayed/checkpoints/step-{step}"
            event.checkpoint_saved.step = step
            event.checkpoint_saved.uri = (run / "checkpoints" / f"step-{step:06d}").as_uri()
            announced.append(event)
        await events.Publish(epb.PublishRequest(job="orgs/acme/jobs/replayed", events=announced))
        await channel.close()
        code, out, err = await cli.run("rl", "replay", "replayed", "--step", "3")
        assert code == 0, out + err
        assert "step 3: bit-identical to what the job recorded" in out
        code, out, err = await cli.run("rl", "replay", "replayed", "--step", "7", "--json")
        assert code == 2 and "step 7 is not in the rollout dump" in err and "1-3" in err

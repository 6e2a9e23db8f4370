"""The online-RL loop end to end on CPU: the embedded mesh, the example single-turn Task App through the real
proxy, a real inference worker process, GRPO steps with weight sync, events, checkpoints and resume."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import httpx
import pytest
import torch
from tandem.events.v1 import events_service_pb2 as epb
from tandem.inference.v1 import inference_service_pb2 as ipb

from tandem_jobs.config import Job, parse_job
from tests.support.workers import running_worker, worker_stub
from trainer.inference.publisher import WeightPublisher
from trainer.launch import local_environment
from trainer.models import build_tiny_model
from trainer.seeds import episode_seed
from trainer.train import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def demo_job(
    model_dir: Path,
    steps: int,
    sampling: dict[str, object] | None = None,
    weights: dict[str, object] | None = None,
    learning_rate: float = 1e-3,
    **algorithm: object,
) -> Job:
    return Job(
        parse_job(
            {
                **({"weights": weights} if weights else {}),
                "seed": 3,
                "checkpoint_interval": 2,
                "model": {"dir": str(model_dir)},
                "task_app": {"name": "orgs/demo/taskApps/single-turn"},
                "data": {"train": {"seeds": [{"start": 0, "end": 1000}]}},
                "algorithm": {"group_size": 4, "prompts_per_step": 4, "steps": steps, **algorithm},
                "optimizer": {"learning_rate": learning_rate},
                "sampling": {"max_tokens": 3, **(sampling or {})},
            }
        )
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


async def test_the_jobs_sampling_and_seeds_reach_the_sampler_and_the_ratio_stays_one(
    model_dir: Path, tmp_path: Path
) -> None:
    # The job's truncations and each episode's seed go trainer -> proxy -> the example app's SDK policy ->
    # the worker, which samples with them and records them in the turn; the trainer scores under the
    # truncations, so on-policy the ratio is 1.
    job = demo_job(model_dir, steps=1, sampling={"top_p": 0.9, "top_k": 40})
    async with local_environment(job, tmp_path / "run") as env:
        trainer = Trainer(job, env)
        (report,) = await trainer.run()
        stream = env.workers[0].stub.StreamTraces(ipb.StreamTracesRequest())
        turns, seeds = [], {}
        async for item in stream:
            if not item.HasField("trace"):
                break  # a heartbeat: every sealed trace has been read
            turns.extend(item.trace.turns)
            seeds[item.trace.correlation_id] = [t.seed for t in item.trace.turns if t.HasField("seed")]
            if len(turns) >= 16:
                break
        stream.cancel()
    assert len(turns) == 16 and {(round(t.top_p, 6), t.top_k) for t in turns} == {(0.9, 40)}
    # Each episode's sampling seed, derived from the job's seed 3, step 1 and its index, went the same way.
    for cid, turn_seeds in seeds.items():
        prompt, member = (int(part) for part in cid.split("-")[-2:])
        assert turn_seeds == [episode_seed(3, 1, prompt * 4 + member)], cid
    assert not report.skipped and report.metrics["tokens"] > 0
    assert report.metrics["ratio/mean"] == pytest.approx(1.0, abs=1e-3)
    assert report.metrics["ratio/max"] < 1.01


async def test_steps_train_sync_report_checkpoint_and_resume(model_dir: Path, tmp_path: Path) -> None:
    job = demo_job(model_dir, steps=3, max_staleness=1, kl_coef=0.01)
    async with local_environment(job, tmp_path / "run") as env:
        trainer = Trainer(job, env)
        reports = await trainer.run()
        assert [r.step for r in reports] == [1, 2, 3]
        assert all(r.metrics["staleness/dropped"] == 0 for r in reports)
        trained = [r for r in reports if not r.skipped]
        assert trained and all("loss" in r.metrics and r.metrics["tokens"] > 0 for r in trained)
        info = (await env.workers[0].stub.GetWeightInfo(ipb.GetWeightInfoRequest())).weight_info
        assert info.weight_version == trainer.version >= 1
        await trainer.publisher.verify(trainer._named_weights())  # the worker serves exactly the policy
        listed = await env.events.ListEvents(
            epb.ListEventsRequest(job=env.job, types=["train.step", "checkpoint.saved"])
        )
        kinds = [e.type for e in listed.events]
        assert kinds.count("train.step") == 3 and kinds.count("checkpoint.saved") == 2  # steps 2 and 3
        checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
        assert checkpoints == ["step-000002", "step-000003"]
        assert (tmp_path / "run" / "checkpoints" / "reward.png").stat().st_size > 0  # drawn at the last step
        logged = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in logged] == [1, 2, 3]

    # A new job process over the same output folder continues from step 3, with the workers on its weights.
    longer = demo_job(model_dir, steps=4, max_staleness=1, kl_coef=0.01)
    async with local_environment(longer, tmp_path / "run") as env:
        resumed = Trainer(longer, env)
        reports = await resumed.run()
        assert [r.step for r in reports] == [4]
        await resumed.publisher.verify(resumed._named_weights())

    # The final checkpoint is a model directory a fresh worker serves: exactly the trained weights, and it
    # answers a chat request over the OpenAI-compatible endpoint.
    final = tmp_path / "run" / "checkpoints" / "step-000004"
    mesh_key = secrets.token_hex(32)
    with running_worker(final, tmp_path / "serve", mesh_key) as worker:
        channel, stub = worker_stub(worker, mesh_key)
        async with channel:
            await WeightPublisher([stub]).verify(resumed._named_weights())
        async with httpx.AsyncClient(timeout=60) as http:
            answer = await http.post(
                f"{worker.openai_base_url}/chat/completions",
                json={"messages": [{"role": "user", "content": "Copy this letter: B"}], "max_tokens": 2},
            )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["role"] == "assistant"


async def test_in_flight_weight_updates_train_without_pausing_the_worker(
    model_dir: Path, tmp_path: Path
) -> None:
    # [weights] in_flight: each step's weights land while the next batch's episodes generate (max_staleness
    # 1 overlaps them), with no pause; every token's version is recorded and the worker ends on the policy.
    job = demo_job(model_dir, steps=2, weights={"in_flight": True}, max_staleness=1)
    async with local_environment(job, tmp_path / "run") as env:
        trainer = Trainer(job, env)
        reports = await trainer.run()
        assert [r.step for r in reports] == [1, 2]
        info = (await env.workers[0].stub.GetWeightInfo(ipb.GetWeightInfoRequest())).weight_info
        assert info.weight_version == trainer.version == 2 and not info.paused
        await trainer.publisher.verify(trainer._named_weights())
        listed = await env.events.ListEvents(epb.ListEventsRequest(job=env.job, types=["weights.updated"]))
        updates = [e.weights_updated for e in listed.events]
        assert [u.weight_version for u in updates] == [1, 2]
        assert all(u.paused_duration.ToNanoseconds() == 0 for u in updates)
        assert all(e.payload["in_flight"] for e in listed.events)
        stream = env.workers[0].stub.StreamTraces(ipb.StreamTracesRequest())
        turns = []
        async for item in stream:
            if not item.HasField("trace"):
                break  # a heartbeat: every sealed trace has been read
            turns.extend(item.trace.turns)
        stream.cancel()
    assert turns and all(len(t.completion_weight_versions) == len(t.completion_token_ids) for t in turns)
    assert all(t.completion_weight_versions[0] == t.weight_version for t in turns if t.completion_token_ids)


async def test_delta_weight_updates_send_only_the_bf16_elements_a_step_changed(tmp_path: Path) -> None:
    # [weights] mode = "delta" on a bf16 model at a small learning rate: the first update goes whole, the
    # later ones carry only the bf16 values the float32 step moved across a rounding boundary, and the
    # worker ends holding exactly the trainer's weights.
    model_dir = build_tiny_model(tmp_path / "bf16", dtype="bfloat16")
    job = demo_job(
        model_dir,
        steps=3,
        weights={"mode": "delta"},
        learning_rate=5e-5,
        max_staleness=0,
        group_size=8,
        prompts_per_step=8,
    )
    async with local_environment(job, tmp_path / "run") as env:
        trainer = Trainer(job, env)
        reports = await trainer.run()
        await trainer.publisher.verify(trainer._named_weights())
        listed = await env.events.ListEvents(epb.ListEventsRequest(job=env.job, types=["weights.updated"]))
    updates = [e.weights_updated for e in listed.events]
    assert updates and updates[0].mode == "full"
    assert listed.events[0].payload["why_full"] == "no earlier update to start from"
    deltas = [u for u in updates if u.mode == "delta"]
    assert deltas and all(0 < u.bytes_transferred < u.full_bytes for u in deltas)
    trained = [r for r in reports if "weight_sync/bytes" in r.metrics]
    assert [r.metrics["weight_sync/bytes"] for r in trained] == [float(u.bytes_transferred) for u in updates]


async def test_a_bf16_model_trains_in_float32_and_its_workers_and_checkpoints_hold_bf16(
    tmp_path: Path,
) -> None:
    model_dir = build_tiny_model(tmp_path / "bf16", dtype="bfloat16")
    job = demo_job(model_dir, steps=2, max_staleness=0)
    async with local_environment(job, tmp_path / "run") as env:
        trainer = Trainer(job, env)
        reports = await trainer.run()
        assert any(not r.skipped for r in reports)
        assert {p.dtype for p in trainer.policy.parameters()} == {torch.float32}
        info = (await env.workers[0].stub.GetWorkerInfo(ipb.GetWorkerInfoRequest())).worker_info
        assert info.dtype == "bfloat16"
        await trainer.publisher.verify(trainer._named_weights())  # the worker serves the bf16 rounding
    final = tmp_path / "run" / "checkpoints" / "step-000002"
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"

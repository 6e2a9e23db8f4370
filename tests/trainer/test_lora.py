"""LoRA mode (`[weights] mode = "lora"`) end to end on CPU: the trainer trains a peft adapter on the frozen
base, each update sends the adapter alone to a real torch-engine worker, which then serves exactly what peft
computes from the base and the checkpoint's adapter; checkpoints are adapter folders (and merged models on
request) that peft loads, and a job resumes from them."""

from __future__ import annotations

import secrets
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file
from tandem.events.v1 import events_service_pb2 as epb
from tandem.inference.v1 import generation_pb2, weights_pb2
from tandem.inference.v1 import inference_service_pb2 as ipb
from tandem.trainer.v1 import config_pb2
from transformers import AutoModelForCausalLM

from mesh.status import RpcError
from tandem_jobs.config import Job
from tests.support.workers import running_worker, worker_stub
from tests.trainer.test_train_loop import demo_job
from trainer import lora
from trainer.launch import local_environment
from trainer.models import build_tiny_model
from trainer.scoring import load_policy
from trainer.train import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_adapter_spec_fills_in_its_defaults() -> None:
    spec = lora.spec_of(config_pb2.LoraConfig())
    assert (spec.rank, spec.alpha, list(spec.target_modules)) == (16, 32.0, ["all-linear"])
    spec = lora.spec_of(config_pb2.LoraConfig(rank=4, alpha=4, target_modules=["q_proj", "v_proj"]))
    assert (spec.rank, spec.alpha, list(spec.target_modules)) == (4, 4.0, ["q_proj", "v_proj"])


def test_the_adapter_s_initialisation_follows_from_the_job_s_seed_alone(tmp_path: Path) -> None:
    """Whatever the process drew from torch's generator before (a run's start is not the same twice), the
    job's seed fixes the adapter's random A matrices, so a LoRA run is reproducible from its seed."""
    model_dir = build_tiny_model(tmp_path / "tiny", layers=1)
    job = lora_job(model_dir, steps=1)
    torch.manual_seed(1)
    first = dict(lora.adapter_weights(load_policy(model_dir, torch.device("cpu"), job), torch.float32))
    torch.rand(7)  # another history
    again = dict(lora.adapter_weights(load_policy(model_dir, torch.device("cpu"), job), torch.float32))
    assert first.keys() == again.keys() and all(torch.equal(first[n], again[n]) for n in first)
    other = Job(config_pb2.TrainerConfig.FromString(job.config.SerializeToString()))
    other.config.seed = job.config.seed + 1
    moved = dict(lora.adapter_weights(load_policy(model_dir, torch.device("cpu"), other), torch.float32))
    assert any(not torch.equal(first[n], moved[n]) for n in first if ".lora_A." in n)


def lora_job(model_dir: Path, steps: int) -> Job:
    """The demo at rank 4 with a merged model in each checkpoint, a KL term against the base, and groups large
    enough that the first steps have a signal."""
    weights = {"mode": "lora", "lora": {"rank": 4, "merged_checkpoints": True}}
    return demo_job(
        model_dir,
        steps=steps,
        weights=weights,
        learning_rate=2e-2,
        kl_coef=0.01,
        max_staleness=0,
        group_size=8,
        prompts_per_step=8,
    )


async def greedy(stub: object, cid: str) -> tuple[list[int], list[int]]:
    """The worker's greedy answer to one prompt: (prompt ids, completion ids), from its trace."""
    request = ipb.GenerateRequest(
        correlation_id=cid,
        messages=[generation_pb2.ChatMessage(role="user", content="Copy this letter: C")],
        sampling=generation_pb2.SamplingParams(max_tokens=8, temperature=0.0),
    )
    [_ async for _ in stub.Generate(request)]  # type: ignore[attr-defined]
    turn = (await stub.GetTrace(ipb.GetTraceRequest(correlation_id=cid))).trace.turns[0]  # type: ignore[attr-defined]
    return list(turn.prompt_token_ids), list(turn.completion_token_ids)


def peft_greedy(model: torch.nn.Module, prompt: list[int], count: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, do_sample=False
        )  # type: ignore[operator]
    return out[0, len(prompt) :].tolist()


async def test_a_lora_job_sends_only_the_adapter_and_its_worker_serves_base_plus_adapter(
    tmp_path: Path,
) -> None:
    model_dir = build_tiny_model(tmp_path / "tiny")
    job = lora_job(model_dir, steps=2)
    async with local_environment(job, tmp_path / "run") as env:
        trainer = Trainer(job, env)
        reports = await trainer.run()
        assert any(r.metrics.get("grad_norm", 0) > 0 for r in reports)
        trained = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
        assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
        assert isinstance(trainer.reference, lora.FrozenBase)  # the base itself: no second model
        assert reports[-1].metrics["kl"] > 0  # the adapter moved the policy away from its base
        await trainer.publisher.verify(trainer._named_weights())  # the worker holds the adapter bit for bit
        stub = env.workers[0].stub
        info = (await stub.GetWorkerInfo(ipb.GetWorkerInfoRequest())).worker_info
        assert weights_pb2.WEIGHT_UPDATE_MODE_LORA in info.weight_update_modes
        assert info.weight_transfer_ranks == 1
        prompt, served = await greedy(stub, "ep-lora-greedy")
        listed = await env.events.ListEvents(epb.ListEventsRequest(job=env.job, types=["weights.updated"]))
        await refusals(stub, trainer)

    updates = [e.weights_updated for e in listed.events]
    assert [u.mode for u in updates] == ["lora", "lora"]
    base_bytes = sum(
        t.numel() * t.element_size() for t in load_file(str(model_dir / "model.safetensors")).values()
    )
    assert all(0 < u.bytes_transferred < 0.2 * base_bytes for u in updates)

    # The checkpoint is an adapter folder peft loads over the base, and what it computes is what the worker
    # served: the same greedy answer.
    final = tmp_path / "run" / "checkpoints" / "step-000002"
    assert {lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS} <= {p.name for p in final.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, final)
    saved = dict(lora.adapter_weights(loaded, torch.float32))
    for name, tensor in trainer._named_weights():
        assert torch.equal(saved[name], tensor), name
    assert peft_greedy(loaded, prompt, len(served)) == served
    # merged/ is a whole model folder computing the same as base + adapter.
    merged = AutoModelForCausalLM.from_pretrained(final / lora.MERGED, dtype=torch.float32)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=ids).logits, loaded(input_ids=ids).logits, atol=1e-4, rtol=1e-4
        )

    # A worker started on the checkpoint folder serves base + adapter: the same greedy answer again.
    mesh_key = secrets.token_hex(32)
    with running_worker(final, tmp_path / "serve", mesh_key) as worker:
        channel, fresh = worker_stub(worker, mesh_key)
        async with channel:
            assert await greedy(fresh, "ep-lora-checkpoint") == (prompt, served)

    # A new job process over the same output folder resumes the adapter (and its optimizer) at step 2.
    longer = lora_job(model_dir, steps=3)
    async with local_environment(longer, tmp_path / "run") as env:
        resumed = Trainer(longer, env)
        resumed.resume()
        for name, tensor in resumed._named_weights():
            assert torch.equal(saved[name], tensor), name
        reports = await resumed.run()
        assert [r.step for r in reports] == [3]
        await resumed.publisher.verify(resumed._named_weights())


async def refusals(stub: object, trainer: Trainer) -> None:
    """A worker refuses a LoRA update it cannot take, before any byte moves, and keeps serving."""
    named = trainer._named_weights()
    specs = [weights_pb2.TensorSpec(name=n, dtype="float32", shape=list(t.shape)) for n, t in named]
    spec = lora.resolved(trainer.policy)
    other = weights_pb2.LoraAdapterSpec(
        rank=spec.rank * 2, alpha=spec.alpha, target_modules=spec.target_modules
    )
    held = (await stub.GetWeightInfo(ipb.GetWeightInfoRequest())).weight_info  # type: ignore[attr-defined]
    version = held.weight_version + 1
    await stub.PauseGeneration(ipb.PauseGenerationRequest(mode=weights_pb2.PAUSE_MODE_KEEP))  # type: ignore[attr-defined]
    mode = weights_pb2.WEIGHT_UPDATE_MODE_LORA
    cases = [
        ({"mode": mode}, "INVALID_ARGUMENT"),  # no spec
        ({"lora": spec}, "INVALID_ARGUMENT"),  # a spec on a full update
        ({"mode": mode, "lora": other}, "WEIGHT_UPDATE_MODE_UNSUPPORTED"),  # another shape than served
    ]
    for fields, reason in cases:
        with pytest.raises(RpcError) as refused:
            await stub.BeginWeightUpdate(
                ipb.BeginWeightUpdateRequest(weight_version=version, manifest=specs, **fields)
            )  # type: ignore[attr-defined]
        assert reason in (refused.value.reason, refused.value.code.name), fields
    wrong = [weights_pb2.TensorSpec(name=named[0][0], dtype="float32", shape=[1, 2])]
    with pytest.raises(RpcError) as refused:
        await stub.BeginWeightUpdate(
            ipb.BeginWeightUpdateRequest(weight_version=version, manifest=wrong, mode=mode, lora=spec)
        )  # type: ignore[attr-defined]
    assert refused.value.reason == "WEIGHT_MANIFEST_MISMATCH"
    after = (await stub.GetWeightInfo(ipb.GetWeightInfoRequest())).weight_info  # type: ignore[attr-defined]
    assert after.weight_version == held.weight_version
    assert after.transfer_state == weights_pb2.WeightInfo.TRANSFER_STATE_READY
    await stub.ResumeGeneration(ipb.ResumeGenerationRequest())  # type: ignore[attr-defined]

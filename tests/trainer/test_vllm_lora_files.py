"""What a vLLM worker in LoRA mode derives without vLLM (trainer/inference/vllm_lora.py, trainer/lora.py):
the adapter's tensors from the base checkpoint's headers, the peft folder it writes for vLLM to load, and the
plan a worker's settings and model folder give. The folder is checked against peft itself, which must load
it and compute what the trainer's policy computes."""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
from tandem.trainer.v1 import config_pb2
from transformers import AutoModelForCausalLM

from trainer import lora
from trainer.inference.vllm_engine import checkpoint_manifest
from trainer.inference.vllm_lora import adapter_manifest, lora_plan, vllm_max_rank
from trainer.models import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("base") / "tiny", layers=2, tie_embeddings=False)


def policy_of(model_dir: Path, **config: object) -> peft.PeftModel:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return lora.wrap(base, lora.spec_of(config_pb2.LoraConfig(**config)))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "targets", [[], ["q_proj", "v_proj"], ["down_proj"]], ids=["all-linear", "qv", "down"]
)
def test_the_adapter_manifest_from_the_checkpoint_is_peft_s(model_dir: Path, targets: list[str]) -> None:
    policy = policy_of(model_dir, rank=4, target_modules=targets)
    spec = lora.resolved(policy)
    expected = {m.name: m for m in lora.manifest_of(dict(lora.adapter_weights(policy, torch.float32)))}
    derived = {m.name: m for m in adapter_manifest(checkpoint_manifest(model_dir), spec, "float32")}
    assert derived == expected
    assert not adapter_manifest(
        checkpoint_manifest(model_dir),
        lora.spec_of(config_pb2.LoraConfig(target_modules=["nope"])),
        "float32",
    )


def test_the_folder_written_for_vllm_is_one_peft_loads_and_computes_the_policy_with(
    model_dir: Path, tmp_path: Path
) -> None:
    policy = policy_of(model_dir, rank=4, alpha=8)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, parameter in lora.adapter_parameters(policy):
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    spec = lora.resolved(policy)
    folder = tmp_path / "adapter"
    lora.write_spec_adapter(folder, spec, str(model_dir), dict(lora.adapter_weights(policy, torch.float32)))
    base_dir, read = lora.read_adapter(folder)
    assert (base_dir, read) == (str(model_dir), spec)
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), folder)
    ids = torch.tensor([[11, 42, 7, 300, 5]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, policy(input_ids=ids).logits)


def test_a_worker_s_settings_and_folder_give_its_lora_plan(model_dir: Path, tmp_path: Path) -> None:
    assert lora_plan(model_dir, 0) is None  # whole weights
    plan = lora_plan(model_dir, 5)
    assert plan is not None and (plan.max_rank, plan.vllm_rank, plan.saved) == (5, 8, None)
    assert [vllm_max_rank(r) for r in (1, 2, 16, 17, 300, 512)] == [1, 8, 16, 32, 320, 512]
    with pytest.raises(ValueError, match="MAX_LORA_RANK=513"):
        lora_plan(model_dir, 513)
    # A saved adapter folder: its base model, served with it; the rank is at least the adapter's.
    policy = policy_of(model_dir, rank=32)
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    policy.peft_config[lora.ADAPTER].base_model_name_or_path = str(model_dir)
    lora.save_checkpoint(policy, folder, torch.float32, merged=False)
    plan = lora_plan(folder, 8)
    assert plan is not None
    assert (plan.base, plan.saved, plan.max_rank, plan.vllm_rank) == (
        str(model_dir.resolve()),
        folder,
        32,
        32,
    )
    assert plan.spec == lora.resolved(policy)
    (folder / lora.ADAPTER_WEIGHTS).unlink()
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors"):
        lora_plan(folder, 0)
    (folder / lora.ADAPTER_CONFIG).write_text('{"r": 4}')
    with pytest.raises(ValueError, match="not a LoRA adapter's config"):
        lora_plan(folder, 0)

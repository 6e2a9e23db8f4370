"""The placement planner: which GPU runs what, and refusals that say what to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mesh.errors import InvalidArgument
from tandem_jobs.placement import Memory, parameters_of, plan, read_parameters, training_bytes_per_gpu


def test_eight_gpus_tp2_auto_is_three_replicas_and_two_trainer_gpus() -> None:
    placed = plan(8, "auto", tensor_parallel=2)
    assert placed.inference == ((0, 1), (2, 3), (4, 5))
    assert placed.trainer == (6, 7)
    assert placed.reference is None
    assert placed.visible_devices() == {
        "inference-0": "0,1",
        "inference-1": "2,3",
        "inference-2": "4,5",
        "trainer": "6,7",
    }


def test_a_reference_of_its_own_takes_the_last_gpu_and_stacked_sits_beside_inference() -> None:
    own = plan(8, "auto", tensor_parallel=2, reference="own")
    assert own.inference == ((0, 1), (2, 3)) and own.trainer == (4, 5, 6) and own.reference == (7,)
    assert own.visible_devices()["reference"] == "7"
    stacked = plan(8, 6, tensor_parallel=1, reference="stacked")
    assert len(stacked.inference) == 6 and stacked.trainer == (6, 7)
    assert stacked.reference == (0,) and stacked.reference_stacked
    assert "reference" not in stacked.visible_devices()


def test_gpus_a_tp_group_cannot_use_go_to_training() -> None:
    placed = plan(7, "auto", tensor_parallel=4)
    assert placed.inference == ((0, 1, 2, 3),) and placed.trainer == (4, 5, 6)


def test_the_cpu_plan() -> None:
    placed = plan(0, reference="stacked")
    assert placed.cpu and placed.inference == ((),) and placed.trainer == ()
    assert placed.reference_stacked


@pytest.mark.parametrize(
    ("args", "advice"),
    [
        ((8, 8, 1), "at most 7"),
        ((8, 6, 4), "multiple of tensor_parallel = 4"),
        ((2, "auto", 2), "lower tensor_parallel"),
        ((3, "auto", 2, "own"), "stack the reference"),
        ((0, 2, 1), "use auto"),
        ((0, "auto", 2), "set it to 1"),
        ((-1, "auto", 1), "0 (CPU) or more"),
    ],
)
def test_refusals_say_what_to_change(args: tuple[object, ...], advice: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        plan(*args)  # type: ignore[arg-type]
    assert advice in info.value.message
    assert info.value.reason_name == "PLACEMENT_INVALID"


# Hugging Face config.json shapes (the values the model cards' configs hold).
QWEN2_0_5B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
LLAMA_3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def test_parameter_counts_of_qwen2_0_5b_and_llama_3_8b_by_hand() -> None:
    # Qwen2-0.5B: embeddings 151936 x 896 (tied, once); a layer: q and o 896 x 896 each, k and v
    # 896 x (2 x 64) each, biases on q, k, v (896 + 128 + 128), the MLP 3 x 896 x 4864, two norms of 896.
    layer = 2 * 896 * 896 + 2 * 896 * 128 + (896 + 2 * 128) + 3 * 896 * 4864 + 2 * 896
    assert layer == 14_912_384
    assert parameters_of(QWEN2_0_5B) == 151936 * 896 + 24 * layer + 896 == 494_032_768
    # Llama-3-8B: untied embeddings and head, 128256 x 4096 each; a layer: q and o 4096 x 4096, k and v
    # 4096 x (8 x 128), no biases, the MLP 3 x 4096 x 14336, two norms.
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert parameters_of(LLAMA_3_8B) == 2 * 128256 * 4096 + 32 * layer + 4096 == 8_030_261_248


@pytest.mark.parametrize(
    "config",
    [
        QWEN2_0_5B,
        LLAMA_3_8B,
        {**LLAMA_3_8B, "num_hidden_layers": 2, "attention_bias": True, "mlp_bias": True},
        {
            "model_type": "qwen3",
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 96,
            "vocab_size": 1000,
            "tie_word_embeddings": True,
        },
        {"model_type": "mistral", **{k: v for k, v in LLAMA_3_8B.items() if k != "model_type"}},
    ],
    ids=["qwen2-0.5b", "llama-3-8b", "llama-biases", "qwen3-head-dim", "mistral"],
)
def test_parameter_counts_equal_transformers_models_of_the_same_config(config: dict[str, object]) -> None:
    import torch  # noqa: PLC0415 - the planner itself is torch-free
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    settings = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(str(config["model_type"]), **settings)
    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(hf_config)
    assert parameters_of(config) == sum(p.numel() for p in model.parameters())


def test_parameters_are_read_from_a_model_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_0_5B))
    assert read_parameters(tmp_path) == 494_032_768
    with pytest.raises(ValueError, match="model_parameters"):
        parameters_of({**QWEN2_0_5B, "num_local_experts": 8})
    with pytest.raises(ValueError, match="model_parameters"):
        parameters_of({"model_type": "llama"})


H100 = 80e9
LLAMA_8B = 8_030_261_248


def test_an_8b_model_trains_on_two_h100s_with_fsdp_and_not_with_ddp() -> None:
    placed = plan(8, 6, 1, "stacked", Memory(LLAMA_8B, H100, "fsdp"))
    assert len(placed.inference) == 6 and placed.trainer == (6, 7)
    # 8.03e9 x 16 B / 2 = 64.2 GB a GPU, within 80 GB less the 15% margin (68 GB).
    assert training_bytes_per_gpu(LLAMA_8B, 2, "fsdp") == LLAMA_8B * 16 / 2
    with pytest.raises(InvalidArgument) as info:
        plan(8, 6, 1, "stacked", Memory(LLAMA_8B, H100, "ddp"))
    message = info.value.message
    assert "8.03e+09 parameters x 16 B" in message and "= 128.5 GB on each training GPU" in message
    assert "80.0 GB less the 15% margin" in message and "= 68.0 GB" in message
    assert 'sharding = "SHARDING_FSDP" (64.2 GB a GPU over 2)' in message
    assert info.value.reason_name == "PLACEMENT_INVALID"


def test_memory_refusals_give_the_arithmetic_and_what_to_change() -> None:
    # FSDP over one training GPU is the whole state on it: 128.5 GB; it takes ceil(128.5 / 68) = 2 GPUs.
    with pytest.raises(InvalidArgument, match=r"/ 1 training GPU \(FSDP\) = 128.5 GB a GPU.*at least 2 GPUs"):
        plan(8, 7, 1, "none", Memory(LLAMA_8B, H100, "fsdp"))
    # DDP of 8B on 4 training GPUs of 24 GB: even sharded (32.1 GB a GPU) it needs 7 of them.
    with pytest.raises(InvalidArgument, match=r"SHARDING_FSDP\" and give training at least 7 GPUs"):
        plan(8, 4, 1, "none", Memory(LLAMA_8B, 24e9, "ddp"))
    # A stacked reference doubles the first inference GPU's weights: 16.1 + 16.1 GB > 20.4 GB.
    with pytest.raises(InvalidArgument, match=r"plus the stacked reference's 16.1 GB, = 32.1 GB.*own GPU"):
        plan(16, 8, 1, "stacked", Memory(LLAMA_8B, 24e9, "fsdp"))
    assert plan(16, 8, 1, "own", Memory(LLAMA_8B, 24e9, "fsdp")).reference == (15,)
    # A replica's share shrinks with tensor parallelism: 16.1 GB does not fit a 12 GB GPU's 10.2, 8.0 does.
    with pytest.raises(
        InvalidArgument, match=r"an inference GPU.*/ tensor_parallel 1 = 16.1 GB.*raise tensor"
    ):
        plan(32, 8, 1, "none", Memory(LLAMA_8B, 12e9, "fsdp"))
    assert len(plan(32, 8, 2, "none", Memory(LLAMA_8B, 12e9, "fsdp")).inference) == 4
    assert plan(0, memory=Memory(LLAMA_8B, H100)).cpu  # the CPU plan is not checked


@pytest.mark.parametrize(
    ("parameters", "training", "sharding", "fits"),
    [
        (494_032_768, 2, "ddp", True),  # 7.9 GB
        (3_085_938_688, 2, "ddp", True),  # Qwen2.5-3B, 49.4 GB
        (7_615_616_512, 2, "ddp", False),  # Qwen2.5-7B, 121.8 GB
        (7_615_616_512, 2, "fsdp", True),  # 60.9 GB
        (7_615_616_512, 4, "ddp", False),  # DDP does not divide by the GPUs
        (LLAMA_8B, 4, "fsdp", True),  # 32.1 GB
    ],
)
def test_which_sizes_fit_which_split(parameters: int, training: int, sharding: str, fits: bool) -> None:
    memory = Memory(parameters, H100, sharding)  # type: ignore[arg-type]
    if fits:
        assert len(plan(8, 8 - training, 1, "none", memory).trainer) == training
    else:
        with pytest.raises(InvalidArgument, match="the training state does not fit"):
            plan(8, 8 - training, 1, "none", memory)

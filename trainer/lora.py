"""LoRA mode (`[weights] mode = "lora"`): the trainer trains a peft LoRA adapter on the frozen base model and
each weight update sends only the adapter (WEIGHT_UPDATE_MODE_LORA).

The trainer's side (`wrap`, `adapter_weights`, `FrozenBase`, `save_checkpoint`) and the inference worker's
(`inject`, `served_adapter`) share one naming: the keys of peft's `adapter_model.safetensors`,
`base_model.model.<module>.lora_A.weight` and `...lora_B.weight`, so a received update is also a file
`vllm serve --lora-modules` and `PeftModel.from_pretrained` load, and a checkpoint's adapter is exactly what
the workers served.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import peft
import torch
from safetensors.torch import save_file
from tandem.inference.v1 import weights_pb2
from tandem.trainer.v1 import config_pb2

from trainer.inference.engine import TensorMeta
from trainer.inference.weights import dtype_name

DEFAULT_RANK = 16
SAVED_PREFIX = "base_model.model."  # how peft's saved adapter names the wrapped model's modules
ADAPTER = "default"  # peft's adapter name, which saved names leave out
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED = "merged"  # the checkpoint's subfolder with the adapter folded into the base


def spec_of(config: config_pb2.LoraConfig) -> weights_pb2.LoraAdapterSpec:
    """The adapter a job trains, its defaults filled in; `target_modules` as the job names them (peft's
    `all-linear` when unset; `resolved` gives the module names it matched)."""
    rank = config.rank or DEFAULT_RANK
    return weights_pb2.LoraAdapterSpec(
        rank=rank,
        alpha=config.alpha or 2.0 * rank,
        target_modules=list(config.target_modules) or ["all-linear"],
    )


def _peft_config(spec: weights_pb2.LoraAdapterSpec) -> peft.LoraConfig:
    targets: str | list[str] = list(spec.target_modules)
    if targets == ["all-linear"]:
        targets = "all-linear"
    alpha: Any = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    return peft.LoraConfig(
        r=spec.rank,
        lora_alpha=alpha,
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def resolved(model: torch.nn.Module) -> weights_pb2.LoraAdapterSpec:
    """The spec of the adapter a peft-wrapped or injected model holds, with the module names peft matched."""
    config: Any = getattr(model, "peft_config")[ADAPTER]  # noqa: B009
    return weights_pb2.LoraAdapterSpec(
        rank=int(config.r), alpha=float(config.lora_alpha), target_modules=sorted(config.target_modules)
    )


def wrap(model: torch.nn.Module, spec: weights_pb2.LoraAdapterSpec) -> peft.PeftModel:
    """The policy of a LoRA job: `model` frozen, an adapter of `spec` trainable (A random, B zero, so the
    policy starts as the base). The initialisation draws from torch's global generator: `load_policy` seeds
    it with the job's seed for the call."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a model, got {type(model).__name__}")
    try:
        return peft.get_peft_model(model, _peft_config(spec))
    except ValueError as exc:  # e.g. a target module the model lacks
        raise ValueError(f"the LoRA adapter cannot be built on this model: {exc}") from None


def _saved_name(parameter_name: str) -> str | None:
    """A parameter's name in the saved adapter's naming, or None when it is not an adapter weight."""
    for part in ("lora_A", "lora_B"):
        marker = f".{part}.{ADAPTER}."
        if marker in parameter_name:
            name = parameter_name.replace(marker, f".{part}.")
            return name if name.startswith(SAVED_PREFIX) else SAVED_PREFIX + name
    return None


def adapter_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter's parameters in saved naming, in the model's module order (a stable manifest order)."""
    found = []
    for name, parameter in model.named_parameters():
        saved = _saved_name(name.removeprefix("module."))  # DDP's wrapper adds `module.`
        if saved is not None:
            found.append((saved, parameter))
    return found


def adapter_weights(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """What a LoRA update sends: the adapter's tensors in saved naming, in `dtype` (a copy when it is not the
    parameters')."""
    return [(name, parameter.detach().to(dtype)) for name, parameter in adapter_parameters(model)]


class FrozenBase(torch.nn.Module):
    """The reference model of a LoRA job: the policy's own base, with the adapter switched off for the
    forward. It holds no weights of its own."""

    def __init__(self, policy: peft.PeftModel) -> None:
        super().__init__()
        self.module = policy  # `scoring._unwrapped` finds the causal LM through it

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.module.disable_adapter():
            return self.module(*args, **kwargs)


def write_adapter(folder: Path, config: Any, weights: dict[str, torch.Tensor]) -> None:
    """An adapter folder as peft saves one: `adapter_config.json` from the peft `config` (its base an absolute
    path where it is a directory here, so a worker started anywhere finds it) and `adapter_model.safetensors`
    holding `weights` (saved naming)."""
    save_file(
        {name: tensor.contiguous() for name, tensor in weights.items()},
        str(folder / ADAPTER_WEIGHTS),
        metadata={"format": "pt"},
    )
    saved = config.to_dict()
    saved["target_modules"] = sorted(config.target_modules)  # a set in memory, a list on disk
    saved["inference_mode"] = True
    base = Path(str(saved.get("base_model_name_or_path") or ""))
    if base.is_dir():
        saved["base_model_name_or_path"] = str(base.resolve())
    (folder / ADAPTER_CONFIG).write_text(json.dumps(saved, indent=2, sort_keys=True, default=str))


def write_spec_adapter(
    folder: Path, spec: weights_pb2.LoraAdapterSpec, base_model: str, weights: dict[str, torch.Tensor]
) -> None:
    """`write_adapter` for an adapter of `spec` over `base_model` (a new folder), with no peft model at hand:
    what a vLLM worker writes for vLLM to load each update from."""
    folder.mkdir(parents=True)
    config = _peft_config(spec)
    config.base_model_name_or_path = base_model
    write_adapter(folder, config, weights)


def read_adapter(folder: Path) -> tuple[str, weights_pb2.LoraAdapterSpec]:
    """(base model directory, LoraAdapterSpec) of a saved adapter folder; ValueError when its config is not a
    LoRA adapter's, its base is not a directory here, or its weights file is missing."""
    config_file = folder / ADAPTER_CONFIG
    try:
        config = json.loads(config_file.read_text())
        base = str(config["base_model_name_or_path"])
        targets = config["target_modules"]
        spec = weights_pb2.LoraAdapterSpec(
            rank=int(config["r"]),
            alpha=float(config["lora_alpha"]),
            target_modules=sorted([targets] if isinstance(targets, str) else targets),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{config_file} is not a LoRA adapter's config: {exc}") from None
    if not Path(base).is_dir():
        raise ValueError(f"the adapter at {folder} names base model {base}, which is not a directory here")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{folder} has no {ADAPTER_WEIGHTS}")
    return base, spec


def save_checkpoint(policy: peft.PeftModel, folder: Path, dtype: torch.dtype, *, merged: bool) -> None:
    """The adapter as peft saves it (`adapter_config.json`, `adapter_model.safetensors`, its tensors in
    `dtype`: what the workers served), and with `merged` the base with the adapter folded in, as a whole
    model folder in `dtype`, under `merged/`."""
    write_adapter(folder, policy.peft_config[ADAPTER], dict(adapter_weights(policy, dtype)))
    if merged:
        whole = copy.deepcopy(policy).merge_and_unload()
        whole.to(dtype).save_pretrained(folder / MERGED)


def load_adapter(policy: peft.PeftModel, folder: Path) -> None:
    """Put a checkpoint's saved adapter into the policy's adapter (resuming)."""
    peft.set_peft_model_state_dict(policy, peft.load_peft_weights(str(folder), device="cpu"))


# ---- the worker's side -------------------------------------------------------------------------


def inject(model: torch.nn.Module, spec: weights_pb2.LoraAdapterSpec, dtype: torch.dtype) -> None:
    """Add an adapter of `spec` to a served model in place (B zero: it serves the base until an update),
    its weights in `dtype`."""
    peft.inject_adapter_in_model(_peft_config(spec), model)
    with torch.no_grad():
        for _, parameter in adapter_parameters(model):
            parameter.data = parameter.data.to(dtype)
    model.requires_grad_(False)


def served_adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter a served model holds, by saved name."""
    return {name: parameter.data for name, parameter in adapter_parameters(model)}


def manifest_of(adapter: dict[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in adapter.items()]


def same_shape(a: weights_pb2.LoraAdapterSpec, b: weights_pb2.LoraAdapterSpec) -> bool:
    return a.rank == b.rank and a.alpha == b.alpha and sorted(a.target_modules) == sorted(b.target_modules)


def describe(spec: weights_pb2.LoraAdapterSpec) -> str:
    return f"rank {spec.rank}, alpha {spec.alpha:g}, modules {', '.join(spec.target_modules)}"

"""An online-RL job as a researcher writes it: a TOML file parsed into the contract's `TrainerConfig`.

The schema is `tandem.trainer.v1.TrainerConfig` (protos/tandem/trainer/v1/config.proto): every `[section]`
is a nested message and every key a field of the same name, documented there. `load_job` parses the file,
refuses unknown keys and values of the wrong type (named as the file spells them, e.g.
`algorithm.prompts_per_stepz: is not a key of [algorithm]; the valid keys are ...`, never in the protobuf
parser's words), checks the contract's field rules (ranges, patterns, required fields) and the rules that
span fields, and names each offending field in the error. `Job` gives
the effective values, with every unset optional field at the default its comment names. No torch here.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from tandem.trainer.v1 import config_pb2

from mesh.errors import FieldViolation, InvalidArgument, R
from mesh.validation import violations

Aggregation = Literal["token_mean", "sequence_mean", "constant"]
RatioLevel = Literal["token", "sequence"]
Reference = Literal["none", "stacked", "own"]
Sharding = Literal["ddp", "fsdp"]
ComputeDtype = Literal["float32", "bfloat16"]
MICRO_BATCH_TOKENS = 2048  # the default token budget of one forward pass of an update
STD_FLOOR = 1e-3  # the default least std that group advantages are divided by
ROLLOUT_DUMP_BUDGET_MIB = 1024  # the default size budget of a job's rollout dumps


def _invalid(message: str, found: list[FieldViolation]) -> InvalidArgument:
    return InvalidArgument(message, reason=R.ERROR_REASON_INVALID_JOB_SPEC, violations=found)


_INT64 = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def _kind(field: FieldDescriptor) -> tuple[str, tuple[type, ...]]:
    """What a TOML value of `field` must be: a word for the message and the Python types TOML gives it."""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return "a table", (dict,)
    if field.enum_type is not None:
        return "one of " + ", ".join(v.name for v in field.enum_type.values[1:]), (str,)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return "true or false", (bool,)
    if field.type == FieldDescriptor.TYPE_STRING:
        return "a string", (str,)
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return "a number", (int, float)
    return "an integer", (int,)


def _shape(table: dict[str, Any], message: Descriptor, path: str) -> list[FieldViolation]:
    """Every key of `table` that is not a field of `message`, and every value of the wrong kind, named as
    the file spells it (snake_case, dotted from the top) with what was expected: the valid keys of that
    table, or the kind of value. Tables of a well-known type (e.g. `env_config`, a free-form Struct) are
    left as they are."""
    found: list[FieldViolation] = []
    fields = {f.name: f for f in message.fields}
    by_json = {f.json_name: f for f in message.fields}
    for key, value in table.items():
        where = f"{path}.{key}" if path else str(key)
        field = fields.get(key) or by_json.get(key)
        if field is None:
            section = f"[{path}]" if path else "the top level"
            valid = ", ".join(sorted(fields))
            found.append(FieldViolation(where, f"is not a key of {section}; the valid keys are {valid}"))
            continue
        values = value if _is_repeated(field) and isinstance(value, list) else [value]
        if _is_repeated(field) and not isinstance(value, list):
            found.append(FieldViolation(where, "must be a list"))
            continue
        kind, types = _kind(field)
        for index, item in enumerate(values):
            at = f"{where}[{index}]" if _is_repeated(field) else where
            if field.type in _INT64 and isinstance(item, str) and item.lstrip("-").isdigit():
                continue  # proto3 JSON's spelling of a 64-bit integer, as a TOML the gateway wrote has it
            if not isinstance(item, types) or (bool not in types and isinstance(item, bool)):
                found.append(FieldViolation(at, f"must be {kind}, not {_toml_type(item)}"))
            elif field.enum_type is not None and item not in field.enum_type.values_by_name:
                found.append(FieldViolation(at, f"must be {kind}, not {item!r}"))
            elif (
                isinstance(item, dict)
                and field.message_type is not None
                and not field.message_type.full_name.startswith("google.protobuf.")
            ):
                found.extend(_shape(item, field.message_type, at))
    return found


def _is_repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _toml_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}
    return names.get(type(value), "a table" if isinstance(value, dict) else type(value).__name__)


def parse_job(document: dict[str, Any]) -> config_pb2.TrainerConfig:
    """A TOML document (as a dict) -> a validated TrainerConfig; InvalidArgument naming every bad field.
    Unknown keys and values of the wrong kind are named as the file spells them (snake_case), with the valid
    keys of their table or the kind expected."""
    config = config_pb2.TrainerConfig()
    shape = _shape(document, config.DESCRIPTOR, "")
    if shape:
        names = ", ".join(f"{v.field} ({v.description})" for v in shape[:5])
        raise _invalid(f"invalid job config: {names}", shape)
    try:
        json_format.ParseDict(document, config, ignore_unknown_fields=False)
    except json_format.ParseError:  # what the walk above lets through: say where, not the parser's words
        raise _invalid(
            "the job config does not fit the schema", [FieldViolation("(config)", "does not fit the schema")]
        ) from None
    found = violations(config)
    found.extend(_cross_field(config))
    if found:
        names = ", ".join(f"{v.field} ({v.description})" for v in found[:5])
        raise _invalid(f"invalid job config: {names}", found)
    return config


def load_job(path: Path, overrides: dict[str, dict[str, Any]] | None = None) -> config_pb2.TrainerConfig:
    """Parse the TOML file at `path`; `overrides` replaces keys of its sections (`{"topology": {"gpus": 8}}`)
    before validation, as the launcher's placement flags do."""
    try:
        document = tomllib.loads(path.read_text())
    except OSError as exc:
        raise InvalidArgument(f"cannot read the job config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise _invalid(f"{path} is not valid TOML: {exc}", []) from None
    for section, values in (overrides or {}).items():
        if values:
            table = document.setdefault(section, {})
            if not isinstance(table, dict):
                raise _invalid(
                    f"{path}: {section} must be a table", [FieldViolation(section, "is not a table")]
                )
            table.update(values)
    return parse_job(document)


def _cross_field(config: config_pb2.TrainerConfig) -> list[FieldViolation]:
    found: list[FieldViolation] = []
    target = config.task_app
    if bool(target.name) == bool(target.base_url):
        found.append(FieldViolation("task_app", "set exactly one of name and base_url"))
    if target.secret_name and not target.base_url:
        found.append(FieldViolation("task_app.secret_name", "is used only with base_url"))
    for split in ("train", "eval"):
        if not config.data.HasField(split):
            continue
        for index, seeds in enumerate(getattr(config.data, split).seeds):
            if seeds.end <= seeds.start:
                found.append(
                    FieldViolation(
                        f"data.{split}.seeds[{index}]", f"end {seeds.end} must be above start {seeds.start}"
                    )
                )
    algorithm, topology = config.algorithm, config.topology
    placement = topology.reference_placement
    if algorithm.kl_coef > 0 and placement == config_pb2.REFERENCE_PLACEMENT_NONE:
        found.append(FieldViolation("topology.reference_placement", "kl_coef > 0 needs a reference model"))
    if topology.HasField("inference_gpus") and topology.inference_gpus >= max(topology.gpus, 1):
        found.append(
            FieldViolation(
                "topology.inference_gpus", f"must be below gpus ({topology.gpus}): the trainer needs one"
            )
        )
    if (
        topology.HasField("inference_gpus")
        and topology.HasField("tensor_parallel_size")
        and topology.inference_gpus % topology.tensor_parallel_size
    ):
        found.append(FieldViolation("topology.tensor_parallel_size", "must divide inference_gpus"))
    if topology.cpu_trainer_ranks and topology.gpus:
        found.append(
            FieldViolation(
                "topology.cpu_trainer_ranks", "is for CPU jobs (gpus = 0); with GPUs, ranks follow the plan"
            )
        )
    if (
        algorithm.loss_aggregation == config_pb2.LOSS_AGGREGATION_CONSTANT
        and not algorithm.HasField("constant_tokens")
        and not config.sampling.max_tokens
    ):
        found.append(
            FieldViolation(
                "algorithm.constant_tokens", "the CONSTANT aggregation needs it, or sampling.max_tokens"
            )
        )
    found.extend(_inference(config.inference))
    found.extend(_weights(config))
    found.extend(_model_build(config.model))
    if config.optimizer.warmup_steps > algorithm.steps:
        found.append(FieldViolation("optimizer.warmup_steps", f"is more than the {algorithm.steps} steps"))
    return found


def _inference(inference: config_pb2.InferenceConfig) -> list[FieldViolation]:
    if inference.max_batch and inference.engine == "vllm":
        return [
            FieldViolation("inference.max_batch", "is the torch engine's; vLLM schedules its own batches")
        ]
    return []


def _weights(config: config_pb2.TrainerConfig) -> list[FieldViolation]:
    found: list[FieldViolation] = []
    if config.weights.in_flight and config.inference.engine == "vllm":
        found.append(
            FieldViolation(
                "weights.in_flight",
                "needs the torch engine: vLLM loads weights in place, so its workers must pause for an update "
                '(drop it, or set [inference] engine = "torch")',
            )
        )
    # mode = "delta" takes either engine: the torch engine and vLLM on a CPU (Tandem's gloo transfer engine)
    # apply deltas; vLLM on GPUs (NCCL, IPC: vLLM's own transfer engines) lists no DELTA in its WorkerInfo,
    # so the publisher sends those workers every update whole, saying why in each weights.updated event.
    if config.weights.full_every and config.weights.mode != "delta":
        found.append(FieldViolation("weights.full_every", 'is for mode = "delta"'))
    found.extend(_lora(config))
    return found


def _lora(config: config_pb2.TrainerConfig) -> list[FieldViolation]:
    if config.weights.mode != "lora":
        if config.weights.HasField("lora"):
            return [FieldViolation("weights.lora", 'is for mode = "lora"')]
        return []
    found: list[FieldViolation] = []
    if config.inference.engine == "vllm" and config.weights.lora.rank > 512:
        found.append(FieldViolation("weights.lora.rank", "vLLM serves LoRA adapters up to rank 512"))
    if config.topology.cpu_trainer_ranks > 1 or config.topology.sharding == config_pb2.SHARDING_FSDP:
        found.append(
            FieldViolation(
                "weights.mode",
                '"lora" trains on one trainer rank (leave topology.cpu_trainer_ranks and sharding unset)',
            )
        )
    return found


def _model_build(model: config_pb2.ModelConfig) -> list[FieldViolation]:
    if not model.HasField("build"):
        return []
    found: list[FieldViolation] = []
    hidden, heads = model.build.hidden_size or 128, model.build.heads or 4
    if hidden % heads:
        found.append(
            FieldViolation("model.build.hidden_size", f"{hidden} is not a multiple of heads ({heads})")
        )
    if model.build.vocab_size and model.build.vocab_size < 259:
        found.append(
            FieldViolation("model.build.vocab_size", "must be at least 259 (256 bytes + 3 specials)")
        )
    return found


@dataclass(frozen=True)
class Job:
    """A validated config with its defaults applied."""

    config: config_pb2.TrainerConfig

    @property
    def clip_low(self) -> float:
        a = self.config.algorithm
        return a.clip_low if a.HasField("clip_low") else 0.2

    @property
    def clip_high(self) -> float:
        a = self.config.algorithm
        return a.clip_high if a.HasField("clip_high") else 0.2

    @property
    def max_staleness(self) -> int:
        a = self.config.algorithm
        return a.max_staleness if a.HasField("max_staleness") else 1

    @property
    def max_importance_ratio(self) -> float:
        a = self.config.algorithm
        return a.max_importance_ratio if a.HasField("max_importance_ratio") else 2.0

    @property
    def normalize_std(self) -> bool:
        a = self.config.algorithm
        return a.normalize_std if a.HasField("normalize_std") else True

    @property
    def trainer_ranks(self) -> int:
        """Trainer processes on CPU (gloo); GPU jobs take theirs from the placement plan."""
        return max(1, self.config.topology.cpu_trainer_ranks)

    @property
    def sharding(self) -> Sharding:
        """How the trainer ranks hold the training state: `ddp` (each all of it) or `fsdp` (1/N each)."""
        return "fsdp" if self.config.topology.sharding == config_pb2.SHARDING_FSDP else "ddp"

    @property
    def std_floor(self) -> float:
        a = self.config.algorithm
        return a.std_floor if a.HasField("std_floor") else STD_FLOOR

    @property
    def aggregation(self) -> Aggregation:
        how = self.config.algorithm.loss_aggregation
        if how == config_pb2.LOSS_AGGREGATION_SEQUENCE_MEAN:
            return "sequence_mean"
        return "constant" if how == config_pb2.LOSS_AGGREGATION_CONSTANT else "token_mean"

    @property
    def constant_tokens(self) -> int | None:
        """The tokens per completion of the CONSTANT aggregation's divisor (None for the other two)."""
        if self.aggregation != "constant":
            return None
        a = self.config.algorithm
        return a.constant_tokens if a.HasField("constant_tokens") else self.config.sampling.max_tokens

    @property
    def ratio_level(self) -> RatioLevel:
        sequence = self.config.algorithm.ratio_level == config_pb2.RATIO_LEVEL_SEQUENCE
        return "sequence" if sequence else "token"

    @property
    def decoupled(self) -> bool:
        """Whether lagging turns get the decoupled objective (`staleness_correction = DECOUPLED`)."""
        correction = self.config.algorithm.staleness_correction
        return correction == config_pb2.STALENESS_CORRECTION_DECOUPLED

    @property
    def compute_dtype(self) -> ComputeDtype:
        return "bfloat16" if self.config.training.compute_dtype == "bfloat16" else "float32"

    @property
    def micro_batch_tokens(self) -> int:
        return self.config.training.micro_batch_tokens or MICRO_BATCH_TOKENS

    @property
    def temperature(self) -> float:
        s = self.config.sampling
        return s.temperature if s.HasField("temperature") else 1.0

    @property
    def top_p(self) -> float:
        s = self.config.sampling
        return s.top_p if s.HasField("top_p") else 1.0

    @property
    def top_k(self) -> int:
        """0: every token."""
        return self.config.sampling.top_k

    @property
    def min_p(self) -> float:
        """0: none."""
        return self.config.sampling.min_p

    @property
    def max_grad_norm(self) -> float:
        o = self.config.optimizer
        return o.max_grad_norm if o.HasField("max_grad_norm") else 1.0

    @property
    def rollout_dump_budget_mib(self) -> float:
        """The most MiB the rollout dumps may take together (trainer/dump.py)."""
        return self.config.rollout_dump.budget_mib or ROLLOUT_DUMP_BUDGET_MIB

    @property
    def reference(self) -> Reference:
        placement = self.config.topology.reference_placement
        if placement == config_pb2.REFERENCE_PLACEMENT_UNSPECIFIED:
            return "stacked" if self.config.algorithm.kl_coef > 0 else "none"
        return {
            config_pb2.REFERENCE_PLACEMENT_NONE: "none",
            config_pb2.REFERENCE_PLACEMENT_STACKED: "stacked",
            config_pb2.REFERENCE_PLACEMENT_OWN: "own",
        }[placement]  # type: ignore[return-value]

    @property
    def weights_mode(self) -> Literal["full", "delta", "lora"]:
        """`[weights] mode`: what each weight update sends."""
        mode = self.config.weights.mode
        return "delta" if mode == "delta" else "lora" if mode == "lora" else "full"

    def learning_rate(self, step: int) -> float:
        """The learning rate at `step` (0-based): linear warm-up, then the schedule to `min_lr_ratio`."""
        import math  # noqa: PLC0415

        o, steps = self.config.optimizer, self.config.algorithm.steps
        if o.warmup_steps and step < o.warmup_steps:
            return o.learning_rate * (step + 1) / o.warmup_steps
        span = max(steps - o.warmup_steps, 1)
        progress = min(max(step - o.warmup_steps, 0) / span, 1.0)
        floor = o.learning_rate * o.min_lr_ratio
        if o.schedule == config_pb2.LR_SCHEDULE_LINEAR:
            return floor + (o.learning_rate - floor) * (1.0 - progress)
        if o.schedule == config_pb2.LR_SCHEDULE_COSINE:
            return floor + (o.learning_rate - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return o.learning_rate

    def seeds(self, split: Literal["train", "eval"] = "train") -> list[int]:
        data = getattr(self.config.data, split)
        return [seed for r in data.seeds for seed in range(r.start, r.end)]

"""Job configs in TOML: the contract's schema, its field rules, the cross-field rules, and the defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.errors import InvalidArgument
from tandem_jobs.config import Job, load_job

GOOD = """
seed = 7
checkpoint_interval = 10

[model]
dir = "/models/tiny"

[task_app]
base_url = "http://127.0.0.1:8001"

[data.train]
seeds = [{start = 0, end = 100}, {start = 1000, end = 1010}]

[algorithm]
group_size = 8
prompts_per_step = 4
steps = 50
kl_coef = 0.05
loss_aggregation = "LOSS_AGGREGATION_SEQUENCE_MEAN"

[optimizer]
learning_rate = 1e-3
schedule = "LR_SCHEDULE_COSINE"
warmup_steps = 5
min_lr_ratio = 0.1

[sampling]
temperature = 0.8
max_tokens = 32
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_a_good_config_loads_with_its_defaults(tmp_path: Path) -> None:
    job = Job(load_job(write(tmp_path, GOOD)))
    assert job.config.algorithm.group_size == 8 and job.config.seed == 7
    assert (job.clip_low, job.clip_high, job.max_staleness, job.max_importance_ratio) == (0.2, 0.2, 1, 2.0)
    assert job.aggregation == "sequence_mean" and job.reference == "stacked"  # kl_coef > 0
    assert (job.temperature, job.top_p, job.max_grad_norm) == (0.8, 1.0, 1.0)
    assert len(job.seeds()) == 110
    assert job.learning_rate(0) == pytest.approx(1e-3 / 5)  # warm-up
    assert job.learning_rate(5) == pytest.approx(1e-3)
    assert job.learning_rate(50) == pytest.approx(1e-4)  # cosine down to min_lr_ratio
    assert (job.std_floor, job.ratio_level, job.constant_tokens) == (1e-3, "token", None)
    assert not job.config.algorithm.mask_truncated
    assert (job.compute_dtype, job.micro_batch_tokens) == ("float32", 2048)
    assert not job.config.training.activation_checkpointing


def test_the_loss_options_and_the_training_section_load(tmp_path: Path) -> None:
    text = GOOD.replace('"LOSS_AGGREGATION_SEQUENCE_MEAN"', '"LOSS_AGGREGATION_CONSTANT"') + (
        '\n[training]\ncompute_dtype = "bfloat16"\nmicro_batch_tokens = 1024\nactivation_checkpointing = true\n'
    )
    text = text.replace(
        "kl_coef = 0.05", 'kl_coef = 0.05\nratio_level = "RATIO_LEVEL_SEQUENCE"\nstd_floor = 0.01'
    )
    job = Job(load_job(write(tmp_path, text)))
    assert (job.aggregation, job.constant_tokens) == ("constant", 32)  # sampling.max_tokens
    assert (job.ratio_level, job.std_floor) == ("sequence", 0.01)
    assert (job.compute_dtype, job.micro_batch_tokens) == ("bfloat16", 1024)
    assert job.config.training.activation_checkpointing
    own = Job(load_job(write(tmp_path, text.replace("std_floor = 0.01", "constant_tokens = 100"))))
    assert own.constant_tokens == 100


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (("group_size = 8", "group_size = 1"), "algorithm.group_size"),
        (('base_url = "http://127.0.0.1:8001"', 'base_url = "ftp://x"'), "task_app.base_url"),
        (("{start = 0, end = 100}", "{start = 10, end = 10}"), "data.train.seeds[0]"),
        (("temperature = 0.8", "temperature = 3"), "sampling.temperature"),
        (("warmup_steps = 5", "warmup_steps = 500"), "optimizer.warmup_steps"),
        (('dir = "/models/tiny"', 'dir = ""'), "model.dir"),
        (("kl_coef = 0.05", "kl_coef = 0.05\nstd_floor = -1"), "algorithm.std_floor"),
        (
            ("max_tokens = 32", 'max_tokens = 32\n[training]\ncompute_dtype = "float16"'),
            "training.compute_dtype",
        ),
    ],
)
def test_each_bad_field_is_named(tmp_path: Path, change: tuple[str, str], field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        load_job(write(tmp_path, GOOD.replace(*change)))
    assert field in [v.field for v in info.value.violations]
    assert info.value.reason_name == "INVALID_JOB_SPEC"


def test_unknown_keys_wrong_types_and_bad_toml_are_refused(tmp_path: Path) -> None:
    for text, words in [
        (GOOD + "\n[algorithm2]\nx = 1\n", "algorithm2"),
        (GOOD.replace("steps = 50", 'steps = "many"'), "steps"),
        ("[model\n", "not valid TOML"),
    ]:
        with pytest.raises(InvalidArgument) as info:
            load_job(write(tmp_path, text))
        assert words in info.value.message


def test_rules_across_fields(tmp_path: Path) -> None:
    both = GOOD.replace(
        'base_url = "http://127.0.0.1:8001"', 'base_url = "http://x"\nname = "orgs/a/taskApps/b"'
    )
    no_ref = GOOD + '\n[topology]\nreference_placement = "REFERENCE_PLACEMENT_NONE"\n'
    split = GOOD + "\n[topology]\ngpus = 8\ninference_gpus = 6\ntensor_parallel_size = 4\n"
    constant = GOOD.replace('"LOSS_AGGREGATION_SEQUENCE_MEAN"', '"LOSS_AGGREGATION_CONSTANT"')
    for text, field in [
        (constant.replace("max_tokens = 32", "max_tokens = 0"), "algorithm.constant_tokens"),
        (both, "task_app"),
        (no_ref, "topology.reference_placement"),
        (split, "topology.tensor_parallel_size"),
    ]:
        with pytest.raises(InvalidArgument) as info:
            load_job(write(tmp_path, text))
        assert field in [v.field for v in info.value.violations]


def test_the_inference_engine_is_torch_unless_the_job_asks_for_vllm(tmp_path: Path) -> None:
    assert Job(load_job(write(tmp_path, GOOD))).config.inference.engine == ""  # unset: the torch engine
    vllm = Job(load_job(write(tmp_path, GOOD + '\n[inference]\nengine = "vllm"\nenforce_eager = true\n')))
    assert vllm.config.inference.engine == "vllm" and vllm.config.inference.enforce_eager
    with pytest.raises(InvalidArgument) as info:
        load_job(write(tmp_path, GOOD + '\n[inference]\nengine = "tensorrt"\n'))
    assert "inference.engine" in [v.field for v in info.value.violations]


def test_max_batch_is_the_torch_engines(tmp_path: Path) -> None:
    one = Job(load_job(write(tmp_path, GOOD + "\n[inference]\nmax_batch = 1\n")))
    assert one.config.inference.max_batch == 1
    with pytest.raises(InvalidArgument) as info:
        load_job(write(tmp_path, GOOD + '\n[inference]\nengine = "vllm"\nmax_batch = 1\n'))
    assert [v.field for v in info.value.violations] == ["inference.max_batch"]
    with pytest.raises(InvalidArgument) as info:
        load_job(write(tmp_path, GOOD + "\n[inference]\nmax_batch = 5000\n"))
    assert "inference.max_batch" in [v.field for v in info.value.violations]


def test_the_weight_sync_mode_is_full_or_delta_with_either_engine(tmp_path: Path) -> None:
    assert Job(load_job(write(tmp_path, GOOD))).config.weights.mode == ""  # unset: full
    chosen = Job(load_job(write(tmp_path, GOOD + '\n[weights]\nmode = "delta"\nfull_every = 5\n')))
    assert (chosen.config.weights.mode, chosen.config.weights.full_every) == ("delta", 5)
    # vLLM too: on a CPU its gloo transfer engine applies deltas; on GPUs its workers get whole updates
    vllm = Job(
        load_job(write(tmp_path, GOOD + '\n[weights]\nmode = "delta"\n\n[inference]\nengine = "vllm"\n'))
    )
    assert (vllm.config.weights.mode, vllm.config.inference.engine) == ("delta", "vllm")
    cases = [
        ('mode = "sparse"', "weights.mode"),
        ("full_every = 5", "weights.full_every"),
        ('mode = "delta"\nfull_every = 100001', "weights.full_every"),
    ]
    for body, field in cases:
        with pytest.raises(InvalidArgument) as info:
            load_job(write(tmp_path, GOOD + f"\n[weights]\n{body}\n"))
        assert field in [v.field for v in info.value.violations], body


def test_lora_mode_takes_its_adapter_table_and_one_torch_trainer(tmp_path: Path) -> None:
    chosen = Job(
        load_job(
            write(
                tmp_path,
                GOOD
                + '\n[weights]\nmode = "lora"\n\n[weights.lora]\nrank = 8\ntarget_modules = ["q_proj", "v_proj"]\n',
            )
        )
    )
    assert chosen.weights_mode == "lora"
    assert (chosen.config.weights.lora.rank, list(chosen.config.weights.lora.target_modules)) == (
        8,
        ["q_proj", "v_proj"],
    )
    served_by_vllm = Job(
        load_job(write(tmp_path, GOOD + '\n[weights]\nmode = "lora"\n\n[inference]\nengine = "vllm"\n'))
    )
    assert (served_by_vllm.weights_mode, served_by_vllm.config.inference.engine) == ("lora", "vllm")
    cases = [
        ("[weights.lora]\nrank = 8", "weights.lora"),  # a table without the mode
        ('mode = "lora"\n\n[weights.lora]\nrank = 1024\n\n[inference]\nengine = "vllm"', "weights.lora.rank"),
        ('mode = "lora"\n\n[topology]\ncpu_trainer_ranks = 2', "weights.mode"),
        ('mode = "lora"\n\n[weights.lora]\nrank = 2000', "weights.lora.rank"),
        ('mode = "lora"\n\n[weights.lora]\ntarget_modules = ["q proj"]', "weights.lora.target_modules[0]"),
    ]
    for body, field in cases:
        with pytest.raises(InvalidArgument) as info:
            load_job(write(tmp_path, GOOD + f"\n[weights]\n{body}\n"))
        assert field in [v.field for v in info.value.violations], body


def test_in_flight_weight_updates_are_the_torch_engines(tmp_path: Path) -> None:
    assert not Job(load_job(write(tmp_path, GOOD))).config.weights.in_flight  # unset: workers pause
    torch = Job(load_job(write(tmp_path, GOOD + "\n[weights]\nin_flight = true\n")))
    assert torch.config.weights.in_flight
    with pytest.raises(InvalidArgument) as info:
        load_job(write(tmp_path, GOOD + '\n[weights]\nin_flight = true\n\n[inference]\nengine = "vllm"\n'))
    assert [v.field for v in info.value.violations] == ["weights.in_flight"]
    assert "vLLM loads weights in place" in info.value.violations[0].description
    assert "weights.in_flight" in str(info.value)
    with pytest.raises(InvalidArgument) as info:
        load_job(write(tmp_path, GOOD + "\n[weights]\nin_flite = true\n"))
    assert "in_flight" in info.value.violations[0].description  # the valid keys of [weights]


def test_an_unknown_key_is_named_as_the_file_spells_it_with_the_valid_keys(tmp_path: Path) -> None:
    text = GOOD.replace("steps = 50", "steps = 50\nprompts_per_stepz = 4").replace(
        "max_tokens = 32", 'topP = "high"'
    )
    with pytest.raises(InvalidArgument) as info:
        load_job(write(tmp_path, text))
    by_field = {v.field: v.description for v in info.value.violations}
    assert set(by_field) == {"algorithm.prompts_per_stepz", "sampling.topP"}, by_field
    unknown = by_field["algorithm.prompts_per_stepz"]
    assert unknown.startswith("is not a key of [algorithm]; the valid keys are ")
    assert "prompts_per_step" in unknown and "group_size" in unknown and "promptsPerStep" not in unknown
    assert by_field["sampling.topP"] == "must be a number, not a string"  # a camelCase key still reads
    for words in (info.value.message, *by_field.values()):
        assert "Message type" not in words and "TrainerConfig" not in words  # no protobuf parser text
    with pytest.raises(InvalidArgument) as info:
        load_job(write(tmp_path, "learning_rate = 1\n" + GOOD))
    assert [v.field for v in info.value.violations] == ["learning_rate"]
    assert info.value.violations[0].description.startswith(
        "is not a key of the top level; the valid keys are "
    )

"""`TorchEngine` on the tiny local model: generation checked token by token against the model run directly,
batching, the sampler's log-probs, pause modes, staged weight updates and load errors; and the model builder.

The reference is the same checkpoint loaded with transformers and run one unpadded sequence at a time with
no cache. No assertion depends on timing: ordering is forced with pauses and the engine's queue counters.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.trainer.conftest import Reference
from trainer.inference.engine import (
    EngineError,
    Finished,
    ManifestMismatch,
    ModelLoadError,
    PauseMode,
    PromptTooLong,
    Sampling,
    TensorMeta,
    TokenChunk,
)
from trainer.inference.torch_engine import TorchEngine
from trainer.inference.weights import tensor_checksum
from trainer.models import EOS_TOKEN, build_tiny_model, build_tokenizer, main

GREEDY = Sampling(temperature=0)


@dataclass
class Result:
    chunks: list[TokenChunk] = field(default_factory=list)
    finished: Finished | None = None

    @property
    def tokens(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.token_ids]

    @property
    def logprobs(self) -> list[float]:
        return [lp for chunk in self.chunks for lp in chunk.logprobs]

    @property
    def text(self) -> str:
        return "".join(chunk.text for chunk in self.chunks)

    @property
    def reason(self) -> str:
        assert self.finished is not None
        return self.finished.reason


async def collect(engine: TorchEngine, prompt: Sequence[int], sampling: Sampling) -> Result:
    result = Result()
    async for item in engine.generate(prompt, sampling):
        if isinstance(item, TokenChunk):
            result.chunks.append(item)
        else:
            assert result.finished is None
            result.finished = item
    assert result.finished is not None
    return result


class Stream:
    """A generation consumed step by step by the test, so it can act between chunks."""

    def __init__(self, engine: TorchEngine, prompt: Sequence[int], sampling: Sampling) -> None:
        self.items = engine.generate(prompt, sampling)
        self.result = Result()

    async def next_chunk(self) -> TokenChunk:
        item = await anext(self.items)
        assert isinstance(item, TokenChunk)
        self.result.chunks.append(item)
        return item

    async def rest(self) -> Result:
        async for item in self.items:
            if isinstance(item, TokenChunk):
                self.result.chunks.append(item)
            else:
                self.result.finished = item
        return self.result


async def until(condition: Callable[[], bool]) -> None:
    """Let the event loop run until `condition()` holds (the engine's counters move on the loop); a bound,
    not a measurement: it fails only when the condition never comes."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the condition never held")


@pytest.fixture
async def engine(tiny_model: Path) -> AsyncIterator[TorchEngine]:
    served = await TorchEngine.load(str(tiny_model))
    try:
        yield served
    finally:
        await served.close()


@pytest.fixture(scope="session")
def prompt(reference: Reference) -> list[int]:
    messages = [{"role": "user", "content": "Name three rivers, then count to ten."}]
    text = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids: list[int] = reference.tokenizer.encode(text, add_special_tokens=False)
    return ids


# ---- the model builder --------------------------------------------------------------------------


def test_tiny_model_loads_offline_and_is_deterministic(tiny_model: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), local_files_only=True)
    assert model.config.model_type == "llama"
    assert len(tokenizer) <= model.get_input_embeddings().num_embeddings
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.pad_token_id is not None and tokenizer.bos_token_id is not None
    text = "Grüße, 世界! Tabs\tnewlines\n  3.14159 🤖 <tags> and the river"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert (
        rendered
        == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )

    again = build_tiny_model(tmp_path / "again")
    other = build_tiny_model(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model / name).read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (tiny_model / "model.safetensors").read_bytes()


def test_model_builder_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", str(tmp_path / "m"), "--layers", "1", "--hidden-size", "64", "--untied"]) == 0
    assert "parameters" in capsys.readouterr().out
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["tie_word_embeddings"]) == (
        1,
        64,
        False,
    )
    assert "lm_head.weight" in load_file(str(tmp_path / "m" / "model.safetensors"))


# ---- generation ---------------------------------------------------------------------------------


async def test_greedy_matches_a_direct_argmax_loop(
    engine: TorchEngine, reference: Reference, prompt: list[int]
) -> None:
    result = await collect(engine, prompt, Sampling(temperature=0, max_tokens=24, top_logprobs=3))
    reference.assert_same_greedy(prompt, result.tokens, reference.greedy(prompt, 24))
    assert result.reason == "length"
    assert result.finished == Finished("length", len(prompt), 24, 0, 0)

    logits = reference.logits(prompt + result.tokens)[len(prompt) - 1 : -1]
    want = torch.log_softmax(logits, dim=-1)  # greedy reports the raw model distribution
    for i, (token, chunk) in enumerate(zip(result.tokens, result.chunks, strict=True)):
        assert chunk.logprobs[0] == pytest.approx(float(want[i, token]), abs=1e-4)
        (best_id, best_logprob), *_ = chunk.top_logprobs[0]
        assert best_id == token and best_logprob == pytest.approx(chunk.logprobs[0], abs=1e-6)
        assert len(chunk.top_logprobs[0]) == 3
    assert result.text == engine.decode(result.tokens)

    again = await collect(engine, prompt, Sampling(temperature=0, max_tokens=24))
    assert again.tokens == result.tokens and again.text == result.text


async def test_max_tokens_and_the_context_end_generation_with_length(
    engine: TorchEngine, prompt: list[int]
) -> None:
    result = await collect(engine, prompt, Sampling(temperature=0, max_tokens=5))
    assert len(result.tokens) == 5
    assert result.finished == Finished("length", len(prompt), 5, 0, 0)

    context = engine.info.max_context_tokens
    long_prompt = (prompt * (context // len(prompt) + 1))[: context - 3]
    result = await collect(
        engine, long_prompt, Sampling(temperature=1.0, seed=3)
    )  # max_tokens 0: to the context
    assert (len(result.tokens), result.reason) == (3, "length")
    result = await collect(engine, long_prompt, Sampling(temperature=0, max_tokens=50))
    assert (len(result.tokens), result.reason) == (3, "length")


async def test_prompt_too_long_is_raised_before_anything_is_yielded(engine: TorchEngine) -> None:
    context = engine.info.max_context_tokens
    with pytest.raises(PromptTooLong) as raised:
        engine.generate([5] * context, GREEDY)
    assert (raised.value.prompt_tokens, raised.value.max_context_tokens) == (context, context)
    result = await collect(engine, [5] * (context - 1), GREEDY)
    assert (len(result.tokens), result.reason) == (1, "length")
    with pytest.raises(EngineError, match="empty"):
        engine.generate([], GREEDY)
    with pytest.raises(EngineError, match="vocabulary"):
        engine.generate([10**6], GREEDY)
    with pytest.raises(EngineError, match="top_p"):
        engine.generate([5], Sampling(top_p=0))


async def test_stop_token_ids_end_generation_and_stay_in_the_tokens(
    engine: TorchEngine, reference: Reference, prompt: list[int]
) -> None:
    free = await collect(engine, prompt, Sampling(temperature=0, max_tokens=20))
    at = next(i for i in range(3, 20) if free.tokens[i] not in free.tokens[:i])
    stop_id = free.tokens[at]
    result = await collect(engine, prompt, Sampling(temperature=0, max_tokens=20, stop_token_ids=(stop_id,)))
    assert result.tokens == free.tokens[: at + 1]
    assert result.finished == Finished("stop", len(prompt), at + 1, 0, 0)
    assert result.text == engine.decode(free.tokens[:at])  # the stop token's own text is left out


async def test_eos_from_the_tokenizer_and_the_generation_config_ends_generation(
    tiny_model: Path, tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    first = await TorchEngine.load(str(copy))
    try:
        prompt = first.render([{"role": "user", "content": "hello"}], {})
        eos = first.encode(EOS_TOKEN)
        assert len(eos) == 1 and eos[0] in first.eos_token_ids
        free = await collect(first, prompt, Sampling(temperature=0, max_tokens=12))
    finally:
        await first.close()
    at = next(i for i in range(2, 12) if free.tokens[i] not in free.tokens[:i])
    config = json.loads((copy / "generation_config.json").read_text())
    config["eos_token_id"] = [eos[0], free.tokens[at]]
    (copy / "generation_config.json").write_text(json.dumps(config))

    second = await TorchEngine.load(str(copy))
    try:
        assert second.eos_token_ids == {eos[0], free.tokens[at]}
        result = await collect(second, prompt, Sampling(temperature=0, max_tokens=12))
    finally:
        await second.close()
    assert result.tokens == free.tokens[: at + 1]
    assert result.reason == "stop"


async def test_stop_strings_cut_the_text_and_keep_the_tokens(engine: TorchEngine, prompt: list[int]) -> None:
    free = await collect(engine, prompt, Sampling(temperature=0, max_tokens=30))
    text = free.text
    start = next(
        i
        for i in range(4, len(text) - 3)
        if "\ufffd" not in text[i : i + 3] and text.find(text[i : i + 3]) == i
    )
    stop = text[start : start + 3]
    result = await collect(engine, prompt, Sampling(temperature=0, max_tokens=30, stop=("never there", stop)))
    assert result.reason == "stop"
    assert result.text == text[:start]
    completes = next(k for k in range(1, 31) if stop in engine.decode(free.tokens[:k]))
    assert result.tokens == free.tokens[:completes]


async def test_seeded_sampling_is_reproducible(engine: TorchEngine, prompt: list[int]) -> None:
    sampling = Sampling(temperature=1.5, max_tokens=30, seed=7)
    first = await collect(engine, prompt, sampling)
    second = await collect(engine, prompt, sampling)
    other = await collect(engine, prompt, Sampling(temperature=1.5, max_tokens=30, seed=8))
    assert first.tokens == second.tokens and first.logprobs == second.logprobs
    assert other.tokens != first.tokens
    both = await asyncio.gather(collect(engine, prompt, sampling), collect(engine, prompt, sampling))
    assert both[0].tokens == both[1].tokens == first.tokens


async def test_each_generation_samples_from_its_own_generator(engine: TorchEngine, prompt: list[int]) -> None:
    seeded = [Sampling(temperature=1.5, max_tokens=20, seed=seed) for seed in (21, 22)]
    alone = [await collect(engine, prompt, sampling) for sampling in seeded]
    assert alone[0].tokens != alone[1].tokens
    # Three generations in every step, one of them unseeded: a shared generator would hand each one draws
    # meant for the others.
    await engine.pause(PauseMode.KEEP)
    mixed = [seeded[0], Sampling(temperature=1.5, max_tokens=20), seeded[1]]
    tasks = [asyncio.create_task(collect(engine, prompt, sampling)) for sampling in mixed]
    await until(lambda: engine.queued == 3)
    await engine.resume()
    together = await asyncio.gather(*tasks)
    assert engine.stats.max_batch_seen == 3  # (the unseeded one may end early, at a random EOS)
    assert (together[0].tokens, together[2].tokens) == (alone[0].tokens, alone[1].tokens)
    assert together[0].logprobs == pytest.approx(alone[0].logprobs, abs=1e-4)


async def test_one_generation_a_step_makes_seeded_output_exact_whatever_runs_beside(
    tiny_model: Path, prompt: list[int]
) -> None:
    """With `max_batch` 1 no row is padded against another, so a seeded generation's tokens and log-probs
    are the same bits however requests arrive: what a reproducible run relies on."""
    engine = await TorchEngine.load(str(tiny_model), max_batch=1)
    try:
        requests = [(prompt, 31), (prompt[:7], 32), (prompt + prompt, 33)]
        samplings = [Sampling(temperature=1.0, max_tokens=12, seed=seed) for _, seed in requests]
        alone = [await collect(engine, p, s) for (p, _), s in zip(requests, samplings, strict=True)]
        await engine.pause(PauseMode.KEEP)
        tasks = [
            asyncio.create_task(collect(engine, p, s))
            for (p, _), s in reversed(list(zip(requests, samplings, strict=True)))
        ]
        await until(lambda: engine.queued == 3)
        await engine.resume()
        together = list(reversed(await asyncio.gather(*tasks)))
    finally:
        await engine.close()
    assert engine.stats.max_batch_seen == 1
    for one, other in zip(alone, together, strict=True):
        assert (one.tokens, one.logprobs) == (other.tokens, other.logprobs)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5)])
async def test_sampler_logprobs_are_those_of_the_distribution_sampled_from(
    engine: TorchEngine, reference: Reference, prompt: list[int], temperature: float, top_p: float
) -> None:
    sampling = Sampling(temperature=temperature, top_p=top_p, max_tokens=20, seed=11, top_logprobs=4)
    result = await collect(engine, prompt, sampling)
    logits = reference.logits(prompt + result.tokens)[len(prompt) - 1 : -1] / temperature
    for i, (token, chunk) in enumerate(zip(result.tokens, result.chunks, strict=True)):
        probs = torch.softmax(logits[i], dim=-1)
        ordered, order = probs.sort(descending=True)
        mass_before = ordered.cumsum(0) - ordered
        nucleus = order[(mass_before < top_p) | (torch.arange(len(order)) == 0)]
        kept = torch.full_like(logits[i], -math.inf)
        kept[nucleus] = logits[i][nucleus]
        want = torch.log_softmax(kept, dim=-1)
        assert token in nucleus.tolist()
        assert chunk.logprobs[0] == pytest.approx(float(want[token]), abs=1e-4)
        top = chunk.top_logprobs[0]
        assert [t for t, _ in top] == want.topk(len(top)).indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(want.topk(len(top)).values.tolist(), abs=1e-4)
        assert len(top) == min(4, len(nucleus))


# ---- batching -----------------------------------------------------------------------------------


async def test_thirty_two_concurrent_generations_share_forward_passes(
    engine: TorchEngine, reference: Reference, prompt: list[int]
) -> None:
    base = prompt * 4
    requests = [(base[: 4 + 2 * i], Sampling(temperature=0, max_tokens=3 + i % 9)) for i in range(32)]
    await engine.pause(PauseMode.KEEP)  # so all 32 are queued before the first step
    tasks = [asyncio.create_task(collect(engine, p, s)) for p, s in requests]
    await until(lambda: engine.queued == 32)
    await engine.resume()
    batched = await asyncio.gather(*tasks)

    assert engine.stats.max_batch_seen == 32
    assert engine.stats.batch_sizes[32] == 3  # the shortest generations have 3 tokens
    assert sum(engine.stats.batch_sizes.values()) == engine.stats.steps == 3 + 8

    for (p, s), together in zip(requests, batched, strict=True):
        alone = await collect(engine, p, s)
        reference.assert_same_greedy(p, together.tokens, alone.tokens)
        assert len(together.tokens) == s.max_tokens
        assert together.text == engine.decode(together.tokens)  # chunk by chunk, multi-byte characters whole
        assert together.logprobs == pytest.approx(alone.logprobs[: len(together.logprobs)], abs=1e-4)


async def test_generations_joining_a_running_batch_match_their_solo_runs(
    engine: TorchEngine, reference: Reference, prompt: list[int]
) -> None:
    first = Stream(engine, prompt, Sampling(temperature=0, max_tokens=30))
    for _ in range(3):
        await first.next_chunk()
    short, long = prompt[:5], prompt + prompt
    joined = await asyncio.gather(
        collect(engine, short, Sampling(temperature=0, max_tokens=10)),
        collect(engine, long, Sampling(temperature=0, max_tokens=20)),
        first.rest(),
    )
    assert engine.stats.max_batch_seen >= 2
    for p, together in zip((short, long, prompt), joined, strict=True):
        reference.assert_same_greedy(p, together.tokens, reference.greedy(p, len(together.tokens)))


async def test_max_batch_bounds_the_batch_and_the_rest_wait(
    tiny_model: Path, reference: Reference, prompt: list[int]
) -> None:
    engine = await TorchEngine.load(str(tiny_model), max_batch=4)
    try:
        results = await asyncio.gather(
            *[collect(engine, prompt, Sampling(temperature=0, max_tokens=4)) for _ in range(10)]
        )
    finally:
        await engine.close()
    assert engine.stats.max_batch_seen == 4
    assert engine.stats.generations == 10
    want = reference.greedy(prompt, 4)
    for result in results:
        reference.assert_same_greedy(prompt, result.tokens, want)


async def test_a_cancelled_generation_leaves_the_batch(engine: TorchEngine, prompt: list[int]) -> None:
    stream = Stream(engine, prompt, Sampling(temperature=0, max_tokens=400))
    other = asyncio.create_task(collect(engine, prompt[:6], Sampling(temperature=0, max_tokens=40)))
    await stream.next_chunk()
    await stream.items.aclose()  # type: ignore[attr-defined]
    assert (await other).finished is not None
    await until(lambda: engine.in_flight == 0)
    assert engine.stats.decode_tokens + engine.stats.prefill_tokens < 400 + 40 + 2 * len(prompt)


# ---- pause --------------------------------------------------------------------------------------


async def test_pause_keep_freezes_generations_and_resume_continues_them(
    engine: TorchEngine, reference: Reference, prompt: list[int]
) -> None:
    streams = [Stream(engine, prompt, Sampling(temperature=0, max_tokens=30)) for _ in range(2)]
    for stream in streams:
        await stream.next_chunk()
    assert await engine.pause(PauseMode.KEEP) == (0, 2)
    assert engine.paused and engine.pause_mode is PauseMode.KEEP
    steps = engine.stats.steps
    late = asyncio.create_task(collect(engine, prompt, Sampling(temperature=0, max_tokens=5)))
    await until(lambda: engine.queued == 1)
    for _ in range(100):
        await asyncio.sleep(0)
    assert engine.stats.steps == steps and engine.in_flight == 2 and not late.done()

    await engine.resume()
    assert not engine.paused
    results = [await stream.rest() for stream in streams]
    want = reference.greedy(prompt, 30)
    for result in results:
        assert result.finished == Finished("length", len(prompt), 30, 0, 0)
        reference.assert_same_greedy(prompt, result.tokens, want)
    reference.assert_same_greedy(prompt, (await late).tokens, want[:5])


async def test_pause_wait_returns_once_generations_in_flight_have_finished(
    engine: TorchEngine, prompt: list[int]
) -> None:
    streams = [Stream(engine, prompt, Sampling(temperature=0, max_tokens=12 + 5 * i)) for i in range(2)]
    for stream in streams:
        await stream.next_chunk()
    assert await engine.pause(PauseMode.WAIT) == (0, 0)
    assert engine.in_flight == 0 and engine.paused
    for stream in streams:
        result = await stream.rest()
        assert result.reason == "length"

    late = asyncio.create_task(collect(engine, prompt, Sampling(temperature=0, max_tokens=5)))
    await until(lambda: engine.queued == 1)
    steps = engine.stats.steps
    for _ in range(100):
        await asyncio.sleep(0)
    assert engine.stats.steps == steps and not late.done()
    await engine.resume()
    assert len((await late).tokens) == 5


async def test_pause_abort_ends_generations_with_their_partial_output(
    engine: TorchEngine, prompt: list[int]
) -> None:
    streams = [Stream(engine, prompt, Sampling(temperature=0, max_tokens=400)) for _ in range(2)]
    for stream in streams:
        await stream.next_chunk()
    assert await engine.pause(PauseMode.ABORT) == (2, 0)
    assert engine.in_flight == 0
    for stream in streams:
        result = await stream.rest()
        assert result.finished is not None and result.finished.reason == "abort"
        assert 1 <= result.finished.completion_tokens == len(result.tokens) < 400
        assert result.text == engine.decode(result.tokens)

    late = asyncio.create_task(collect(engine, prompt, Sampling(temperature=0, max_tokens=3)))
    await until(lambda: engine.queued == 1)
    await engine.resume()
    assert len((await late).tokens) == 3


async def test_abort_after_keep_aborts_the_frozen_generations(engine: TorchEngine, prompt: list[int]) -> None:
    streams = [Stream(engine, prompt, Sampling(temperature=0, max_tokens=400)) for _ in range(3)]
    for stream in streams:
        await stream.next_chunk()
    assert await engine.pause(PauseMode.KEEP) == (0, 3)
    assert await engine.pause(PauseMode.ABORT) == (3, 0)
    for stream in streams:
        assert (await stream.rest()).reason == "abort"
    await engine.resume()
    assert len((await collect(engine, prompt, Sampling(temperature=0, max_tokens=2))).tokens) == 2


# ---- weights ------------------------------------------------------------------------------------


def perturbed(engine: TorchEngine, staged: dict[str, torch.Tensor]) -> None:
    """Fill `staged` with weights unlike the served ones (served * 0.5 + noise), deterministically."""
    served = dict(engine._served.items())  # the engine's own tensors, read only
    generator = torch.Generator().manual_seed(0)
    for name, buffer in staged.items():
        noise = torch.randn(buffer.shape, generator=generator, dtype=buffer.dtype) * 0.2
        buffer.copy_(served[name] * 0.5 + noise)


async def test_manifest_lists_each_tensor_once_in_checkpoint_naming(
    engine: TorchEngine, tiny_model: Path
) -> None:
    manifest = engine.manifest()
    names = [meta.name for meta in manifest]
    checkpoint = load_file(str(tiny_model / "model.safetensors"))
    assert set(names) == set(checkpoint)  # tied lm_head.weight is model.embed_tokens.weight, listed once
    assert names[0] == "model.embed_tokens.weight" and "lm_head.weight" not in names
    for meta in manifest:
        assert meta == TensorMeta(meta.name, "float32", tuple(checkpoint[meta.name].shape))
    assert await engine.checksums([]) == [(name, tensor_checksum(checkpoint[name])) for name in names]


async def test_staged_weights_change_nothing_until_commit(tiny_model: Path, prompt: list[int]) -> None:
    engine = await TorchEngine.load(str(tiny_model))
    try:
        before = await engine.checksums([])
        old = await collect(engine, prompt, Sampling(temperature=0, max_tokens=16))
        staged = dict(engine.stage_update(engine.manifest()))
        assert all(t.is_contiguous() for t in staged.values())
        perturbed(engine, staged)
        assert await engine.checksums([]) == before
        assert (await collect(engine, prompt, Sampling(temperature=0, max_tokens=16))).tokens == old.tokens

        await engine.commit_update(1)
        assert engine.weight_version == 1
        after = await engine.checksums([])
        assert after == [(name, tensor_checksum(staged[name])) for name, _ in before]
        new = await collect(engine, prompt, Sampling(temperature=0, max_tokens=16))
        assert all(chunk.weight_version == 1 for chunk in new.chunks)
        assert (
            new.finished is not None and new.finished.weight_version == new.finished.last_weight_version == 1
        )
    finally:
        await engine.close()

    updated = Reference(tiny_model)
    updated.model.load_state_dict(staged, strict=False)
    updated.assert_same_greedy(prompt, new.tokens, updated.greedy(prompt, 16))
    assert new.tokens != old.tokens


async def test_a_commit_during_keep_serves_the_rest_with_the_new_weights(
    engine: TorchEngine, prompt: list[int]
) -> None:
    stream = Stream(engine, prompt, Sampling(temperature=0, max_tokens=24))
    await stream.next_chunk()
    await stream.next_chunk()
    assert await engine.pause(PauseMode.KEEP) == (0, 1)
    staged = dict(engine.stage_update(engine.manifest()))
    perturbed(engine, staged)
    await engine.commit_update(7)
    await engine.resume()
    result = await stream.rest()
    versions = [chunk.weight_version for chunk in result.chunks]
    switch = versions.index(7)
    assert set(versions[:switch]) == {0} and set(versions[switch:]) == {7}
    assert result.finished == Finished("length", len(prompt), 24, 0, 7)

    done = result.tokens[:switch]
    continued = await collect(engine, prompt + done, Sampling(temperature=0, max_tokens=24 - switch))
    assert continued.tokens == result.tokens[switch:]  # the cache was rebuilt from the new weights


async def test_an_in_flight_update_swaps_the_weights_under_a_running_generation(
    tiny_model: Path, reference: Reference, prompt: list[int]
) -> None:
    engine = await TorchEngine.load(str(tiny_model))
    try:
        assert engine.in_flight_updates
        stream = Stream(engine, prompt, Sampling(temperature=0, max_tokens=32))
        await stream.next_chunk()
        await stream.next_chunk()
        # Staged and committed while the generation streams: no pause at any point.
        staged = dict(engine.stage_update(engine.manifest()))
        perturbed(engine, staged)
        await stream.next_chunk()  # the generation ran on while the update was staged
        await engine.commit_update(1)
        assert not engine.paused
        result = await stream.rest()
    finally:
        await engine.close()
    versions = [chunk.weight_version for chunk in result.chunks]
    assert versions[:3] == [0, 0, 0] and versions[-1] == 1
    switch = versions.index(1)
    assert set(versions[switch:]) == {1}  # every token after the swap, from the new weights
    assert result.finished == Finished("length", len(prompt), 32, 0, 1)

    done = result.tokens[:switch]
    reference.assert_same_greedy(prompt, done, reference.greedy(prompt, switch))
    updated = Reference(tiny_model)
    updated.model.load_state_dict(staged, strict=False)
    # The rest is what the new weights give from the prefix sampled before the swap: the generation was
    # prefilled again (prompt and completion so far) with them, not continued from the old cache.
    updated.assert_same_greedy(
        prompt + done, result.tokens[switch:], updated.greedy(prompt + done, 32 - switch)
    )


async def test_a_partial_update_touches_only_its_tensors_and_discard_touches_nothing(
    engine: TorchEngine,
) -> None:
    before = dict(await engine.checksums([]))
    norm = next(meta for meta in engine.manifest() if meta.name == "model.norm.weight")
    staged = engine.stage_update([norm])
    staged[norm.name].fill_(2.0)
    engine.discard_update()
    assert dict(await engine.checksums([])) == before
    with pytest.raises(EngineError, match="staged"):
        await engine.commit_update(1)
    assert engine.weight_version == 0

    staged = engine.stage_update([norm])
    staged[norm.name].fill_(2.0)
    await engine.commit_update(2)
    after = dict(await engine.checksums([]))
    assert after[norm.name] == tensor_checksum(torch.full(norm.shape, 2.0))
    assert {k: v for k, v in after.items() if k != norm.name} == {
        k: v for k, v in before.items() if k != norm.name
    }
    assert await engine.checksums([norm.name]) == [(norm.name, after[norm.name])]


def test_a_manifest_that_disagrees_with_the_model_is_refused_whole(engine: TorchEngine) -> None:
    served = {meta.name: meta for meta in engine.manifest()}
    embed = served["model.embed_tokens.weight"]
    norm = served["model.norm.weight"]
    bad = [
        TensorMeta(embed.name, embed.dtype, (embed.shape[0] + 1, embed.shape[1])),
        TensorMeta(norm.name, "bfloat16", norm.shape),
        TensorMeta("lm_head.weight", embed.dtype, embed.shape),
        TensorMeta("model.layers.99.mlp.up_proj.weight", "float32", (1, 1)),
    ]
    with pytest.raises(ManifestMismatch) as raised:
        engine.stage_update(bad)
    problems = raised.value.problems
    assert len(problems) == 4
    assert "model.embed_tokens.weight has shape" in problems[0]
    assert problems[1] == "model.norm.weight is float32 in the model, bfloat16 in the manifest"
    assert problems[2] == "lm_head.weight is not a tensor of the model"
    assert "model.layers.99" in problems[3]
    with pytest.raises(ManifestMismatch, match="listed twice"):
        engine.stage_update([norm, norm])


# ---- loading, text and closing ------------------------------------------------------------------


async def test_load_errors_name_what_is_wrong(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no model directory"):
        await TorchEngine.load(str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        await TorchEngine.load(str(tmp_path / "empty"))
    no_weights = Path(shutil.copytree(tiny_model, tmp_path / "no-weights"))
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        await TorchEngine.load(str(no_weights))

    bigger = tmp_path / "bigger-tokenizer"
    build_tokenizer(1024).save_pretrained(str(bigger))
    with pytest.raises(ModelLoadError, match="1024 tokens but the model embeds only 512"):
        await TorchEngine.load(str(tiny_model), tokenizer_path=str(bigger))

    no_eos = tmp_path / "no-eos"
    tokenizer = build_tokenizer(512)
    tokenizer.eos_token = None
    tokenizer.save_pretrained(str(no_eos))
    with pytest.raises(ModelLoadError, match="no EOS token"):
        await TorchEngine.load(str(tiny_model), tokenizer_path=str(no_eos))


async def test_info_render_encode_and_decode(
    engine: TorchEngine, tiny_model: Path, reference: Reference
) -> None:
    info = engine.info
    assert (info.model, info.model_path, info.tokenizer) == ("tiny", str(tiny_model), str(tiny_model))
    assert (info.kind, info.engine_version, info.device, info.dtype) == (
        "torch",
        torch.__version__,
        "cpu",
        "float32",
    )
    assert (info.max_context_tokens, info.tensor_parallel_size) == (512, 1)
    messages = [{"role": "user", "content": "hi"}]
    ids = engine.render(messages, {})
    text = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == reference.tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == reference.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert engine.decode(engine.encode("plain text, 42")) == "plain text, 42"
    assert engine.decode(ids) == "user\nhi\nassistant\n"  # special tokens are skipped


async def test_close_fails_pending_generations(tiny_model: Path, prompt: list[int]) -> None:
    engine = await TorchEngine.load(str(tiny_model))
    running = Stream(engine, prompt, Sampling(temperature=0, max_tokens=400))
    await running.next_chunk()
    await engine.pause(PauseMode.KEEP)
    queued = asyncio.create_task(collect(engine, prompt, GREEDY))
    await until(lambda: engine.queued == 1)
    await engine.close()
    with pytest.raises(EngineError, match="closed"):
        await running.rest()
    with pytest.raises(EngineError, match="closed"):
        await queued
    with pytest.raises(EngineError, match="closed"):
        engine.generate(prompt, GREEDY)

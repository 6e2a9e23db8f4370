"""The inference worker's OpenAI-compatible endpoint through the official `openai` client, against a real
worker process on a tiny model: models listed and retrieved, errors OpenAI-shaped with their HTTP status,
fields it cannot honour refused naming them, streamed logprobs in OpenAI's `choices[].logprobs` (the
`tandem` object kept), and `n` samples, each its own trace under a correlation id."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from tandem.inference.v1 import inference_service_pb2 as pb

from tests.support.workers import Worker, start_worker, stop_worker, worker_stub
from trainer.models import build_tiny_model

pytestmark = pytest.mark.slow
API_KEY = "worker-key-" + secrets.token_hex(8)
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def mesh_key() -> str:
    return secrets.token_hex(32)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, mesh_key: str) -> Iterator[Worker]:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    started = start_worker(
        model_dir, tmp_path_factory.mktemp("worker"), mesh_key, {"TANDEM_WORKER_OPENAI_API_KEY": API_KEY}
    )
    try:
        yield started
    finally:
        stop_worker(started)


@pytest.fixture
async def client(worker: Worker) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=worker.openai_base_url, api_key=API_KEY, max_retries=0) as opened:
        yield opened


async def served(client: openai.AsyncOpenAI) -> str:
    (model,) = [m.id async for m in client.models.list()]
    return model


def error_of(caught: pytest.ExceptionInfo[openai.APIStatusError]) -> dict[str, Any]:
    body = caught.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}, body
    return body


async def test_the_model_is_listed_and_retrieved_and_errors_are_openai_shaped(
    worker: Worker, client: openai.AsyncOpenAI
) -> None:
    model = await served(client)
    retrieved = await client.models.retrieve(model)
    assert (retrieved.id, retrieved.object, retrieved.owned_by) == (model, "model", "tandem")
    with pytest.raises(openai.NotFoundError) as caught:
        await client.models.retrieve("someone/else")
    assert error_of(caught)["code"] == "MODEL_NOT_FOUND"
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model="someone/else", messages=HELLO)  # type: ignore[arg-type]
    assert error_of(caught)["code"] == "MODEL_NOT_FOUND"
    with pytest.raises(openai.NotFoundError) as caught:
        await client.embeddings.create(model=model, input="hello")
    assert error_of(caught)["code"] == "NOT_FOUND" and error_of(caught)["type"] == "not_found_error"
    async with openai.AsyncOpenAI(base_url=worker.openai_base_url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as unauthenticated:
            await wrong.completions.create(model=model, prompt="hi")
        assert error_of(unauthenticated)["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.retrieve(model)
    async with httpx.AsyncClient(base_url=worker.openai_base_url) as raw:
        wrong_method = await raw.get("/completions")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "NOT_IMPLEMENTED"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without `logprobs: true`
    ],
)
async def test_chat_fields_not_honoured_are_refused_naming_the_field(
    client: openai.AsyncOpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=await served(client), messages=HELLO, **fields)  # type: ignore[arg-type, call-overload]
    error = error_of(caught)
    assert (error["param"], error["code"]) == (param, "INVALID_ARGUMENT") and f"`{param}`" in error["message"]


async def test_a_message_part_that_is_not_text_or_a_tool_call_is_refused(client: openai.AsyncOpenAI) -> None:
    model = await served(client)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    parts = [{"type": "text", "text": "what is this?"}, image]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}])  # type: ignore[list-item, misc]
    assert error_of(caught)["param"] == "messages[0].content[1]"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    earlier = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=model, messages=earlier)  # type: ignore[arg-type]
    assert error_of(caught)["param"] == "messages[1].tool_calls"
    text_only = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    answer = await client.chat.completions.create(model=model, messages=text_only, max_tokens=2)  # type: ignore[arg-type]
    assert answer.choices[0].message.role == "assistant"


async def test_completion_echo_is_refused_and_neutral_values_are_accepted(client: openai.AsyncOpenAI) -> None:
    model = await served(client)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=model, prompt="hi", echo=True, max_tokens=2)
    assert error_of(caught)["param"] == "echo"
    answer = await client.completions.create(
        model=model, prompt="hi", echo=False, max_tokens=2, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    chat = await client.chat.completions.create(
        model=model, messages=HELLO, response_format={"type": "text"}, max_completion_tokens=2, temperature=0
    )  # type: ignore[arg-type]
    assert chat.usage is not None and 1 <= chat.usage.completion_tokens <= 2


async def test_streamed_chat_carries_openai_logprobs_and_the_tandem_object(
    client: openai.AsyncOpenAI,
) -> None:
    model = await served(client)
    request: dict[str, Any] = {
        "model": model,
        "messages": HELLO,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = await client.chat.completions.create(**request)
    entries: list[Any] = []
    extras: list[dict[str, Any]] = []
    usage = None
    async for chunk in await client.chat.completions.create(**request, stream=True):
        (choice,) = chunk.choices
        assert choice.index == 0
        extras.append((chunk.model_extra or {})["tandem"])
        if chunk.usage is not None:
            usage = chunk.usage
        if choice.finish_reason is None:
            assert choice.logprobs is not None and choice.logprobs.content
            entries.extend(choice.logprobs.content)
            assert [e.logprob for e in choice.logprobs.content] == extras[-1]["logprobs"]
    assert usage is not None and len(entries) == usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 for e in entries)
    assert "weight_version" in extras[-1]
    # Greedy, the stream samples what the whole answer did, with the same logprobs.
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.content is not None
    expected = whole.choices[0].logprobs.content
    assert [e.token for e in entries] == [e.token for e in expected]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in expected], abs=1e-4)


async def test_streamed_completions_carry_logprobs(client: openai.AsyncOpenAI) -> None:
    model = await served(client)
    tokens: list[str] = []
    async for chunk in await client.completions.create(
        model=model, prompt="hello", max_tokens=4, temperature=0, logprobs=1, stream=True
    ):
        choice = chunk.choices[0]
        if choice.finish_reason is None:
            assert choice.logprobs is not None and choice.logprobs.tokens
            assert choice.logprobs.token_logprobs is not None
            assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
            tokens.extend(choice.logprobs.tokens)
    assert tokens


async def test_n_samples_are_n_choices_each_its_own_trace(
    worker: Worker, client: openai.AsyncOpenAI, mesh_key: str
) -> None:
    model = await served(client)
    cid = "ep-n-" + secrets.token_hex(4)
    traced = client.with_options(base_url=f"{worker.openai_base_url}/traces/{cid}")
    answer = await traced.chat.completions.create(
        model=model, messages=HELLO, n=3, max_tokens=4, temperature=1.0, seed=11
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    samples = (answer.model_extra or {})["tandem"]["samples"]
    assert [s["correlation_id"] for s in samples] == [cid, f"{cid}:1", f"{cid}:2"]
    assert answer.usage is not None
    assert answer.usage.completion_tokens == sum(len(s["completion_token_ids"]) for s in samples)
    channel, stub = worker_stub(worker, mesh_key)
    try:
        for index, sample in enumerate(samples):
            trace = (await stub.GetTrace(pb.GetTraceRequest(correlation_id=sample["correlation_id"]))).trace
            assert len(trace.turns) == 1
            assert list(trace.turns[0].completion_token_ids) == sample["completion_token_ids"]
            assert trace.turns[0].seed == 11 + index  # sample i is sampled, and recorded, with seed s + i
    finally:
        await channel.close()
    # A seed samples the same n answers again.
    again = await client.chat.completions.create(
        model=model, messages=HELLO, n=3, max_tokens=4, temperature=1.0, seed=11
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in answer.choices]
    # Streamed, each sample's chunks carry its choice index, and each sample finishes once.
    finished: list[int] = []
    tokens = {0: 0, 1: 0}
    async for chunk in await client.chat.completions.create(
        model=model, messages=HELLO, n=2, max_tokens=3, temperature=1.0, stream=True
    ):
        (choice,) = chunk.choices
        if choice.finish_reason is not None:
            finished.append(choice.index)
        else:
            tokens[choice.index] += len((chunk.model_extra or {})["tandem"]["token_ids"])
    assert sorted(finished) == [0, 1] and all(1 <= count <= 3 for count in tokens.values())

"""The worker's token-in/token-out route, `POST /inference/v1/generate`, against a real worker process on a
tiny model: a multi-turn episode whose second prompt is the first prompt + its completion + new ids, its
trace holding exactly those ids (ids that a decode and re-encode would change); a batch with `n` samples,
each choice its own trace; the request shape prime-rl's renderers client (verifiers' token client) sends,
through the `openai` client at the episode's inference URL; and every refusal a 400 naming the field."""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from tandem.inference.v1 import inference_service_pb2 as pb
from tandem.inference.v1 import trace_pb2
from transformers import AutoTokenizer

from mesh.status import RpcError
from tests.support.workers import Worker, start_worker, stop_worker, worker_stub
from trainer.models import build_tiny_model

pytestmark = pytest.mark.slow
API_KEY = "worker-key-" + secrets.token_hex(8)


@dataclass
class Served:
    worker: Worker
    model_dir: Path
    mesh_key: str

    @property
    def root(self) -> str:
        """The worker's HTTP root (its OpenAI base URL without `/v1`)."""
        return self.worker.openai_base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    mesh_key = secrets.token_hex(32)
    model_dir = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    started = start_worker(
        model_dir, tmp_path_factory.mktemp("worker"), mesh_key, {"TANDEM_WORKER_OPENAI_API_KEY": API_KEY}
    )
    try:
        yield Served(started, model_dir, mesh_key)
    finally:
        stop_worker(started)


@pytest.fixture
async def http(served: Served) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=served.root, headers=headers, timeout=60) as client:
        yield client


async def trace_of(served: Served, cid: str) -> trace_pb2.Trace:
    channel, stub = worker_stub(served.worker, served.mesh_key)
    try:
        return (await stub.GetTrace(pb.GetTraceRequest(correlation_id=cid))).trace
    finally:
        await channel.close()


def vocabulary(served: Served) -> int:
    return int(json.loads((served.model_dir / "config.json").read_text())["vocab_size"])


async def test_a_multi_turn_episode_is_traced_with_exactly_its_ids(
    served: Served, http: httpx.AsyncClient
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
    # One id per character: decoded and encoded again, BPE merges them into other ids.
    first = [tokenizer.convert_tokens_to_ids(c) for c in "hello"]
    assert tokenizer.encode(tokenizer.decode(first), add_special_tokens=False) != first
    cid = "ep-tito-" + secrets.token_hex(4)
    sampling = {"max_tokens": 5, "temperature": 1.0, "seed": 7}
    one = await http.post(
        "/inference/v1/generate",
        json={"token_ids": first, "sampling_params": sampling},
        headers={"x-trace-correlation-id": cid},
    )
    assert one.status_code == 200, one.text
    (choice,) = one.json()["choices"]
    completion = choice["token_ids"]
    assert 1 <= len(completion) <= 5 and choice["finish_reason"] in ("stop", "length")
    assert len(choice["logprobs"]["content"]) == len(completion)
    assert one.json()["prompt_token_ids"] == first
    # The next turn carries the conversation on in ids: the first prompt, its completion, the new user ids.
    new = [tokenizer.convert_tokens_to_ids(c) for c in "again"]
    second = first + completion + new
    two = await http.post(
        f"/v1/traces/{cid}/inference/v1/generate", json={"token_ids": second, "sampling_params": sampling}
    )
    assert two.status_code == 200, two.text
    (later,) = two.json()["choices"]
    assert later["correlation_id"] == cid
    trace = await trace_of(served, cid)
    assert [list(t.prompt_token_ids) for t in trace.turns] == [first, second]
    assert [list(t.completion_token_ids) for t in trace.turns] == [completion, later["token_ids"]]
    for turn, answered in zip(trace.turns, (choice, later), strict=True):
        logprobs = [e["logprob"] for e in answered["logprobs"]["content"]]
        assert list(turn.sampler_logprobs) == pytest.approx(logprobs, abs=1e-5)
        assert turn.weight_version == answered["weight_version"]
        assert [e["token"] for e in answered["logprobs"]["content"]] == [
            f"token_id:{t}" for t in answered["token_ids"]
        ]


async def test_a_batch_with_n_samples_answers_each_choice_in_its_own_trace(
    served: Served, http: httpx.AsyncClient
) -> None:
    cid = "ep-batch-" + secrets.token_hex(4)
    prompts = [[11, 12, 13], [21, 22, 23, 24]]
    body = {"token_ids": prompts, "sampling_params": {"max_tokens": 3, "n": 2, "seed": 5, "logprobs": 2}}
    answer = await http.post("/inference/v1/generate", json=body, headers={"x-trace-correlation-id": cid})
    assert answer.status_code == 200, answer.text
    data = answer.json()
    choices = data["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["prompt_index"] for c in choices] == [0, 0, 1, 1]
    assert [c["correlation_id"] for c in choices] == [cid, f"{cid}:1", f"{cid}:2", f"{cid}:3"]
    assert data["prompt_token_ids"] == prompts
    assert data["usage"]["prompt_tokens"] == 2 * 3 + 2 * 4
    assert data["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    for choice in choices:
        assert all(len(e["top_logprobs"]) == 2 for e in choice["logprobs"]["content"])
        trace = await trace_of(served, choice["correlation_id"])
        (turn,) = trace.turns
        assert list(turn.prompt_token_ids) == prompts[choice["prompt_index"]]
        assert list(turn.completion_token_ids) == choice["token_ids"]
    # A seed samples the same choices again; sample i of each prompt has seed s + i, as `n` alone does.
    again = (await http.post("/inference/v1/generate", json=body)).json()["choices"]
    assert [c["token_ids"] for c in again] == [c["token_ids"] for c in choices]
    assert all("correlation_id" not in c for c in again)  # untagged: no trace
    alone = await http.post(
        "/inference/v1/generate",
        json={"token_ids": prompts[1], "sampling_params": {"max_tokens": 3, "n": 2, "seed": 5}},
    )
    assert [c["token_ids"] for c in alone.json()["choices"]] == [c["token_ids"] for c in choices[2:]]


async def test_the_renderers_client_request_works_at_the_episode_inference_url(served: Served) -> None:
    """prime-rl's renderers client (what verifiers' token client calls) posts to its base URL without a
    trailing `/v1`, plus `/inference/v1/generate`: at an episode's inference URL, the traced route."""
    cid = "ep-vf-" + secrets.token_hex(4)
    client = openai.AsyncOpenAI(
        base_url=f"{served.worker.openai_base_url}/traces/{cid}", api_key=API_KEY, max_retries=0
    )
    async with client:
        endpoint = str(client.base_url).rstrip("/").removesuffix("/v1") + "/inference/v1/generate"
        sampled_only = {
            "model": (await client.models.list()).data[0].id,
            "token_ids": [5, 6, 7, 8],
            "sampling_params": {
                "max_tokens": 4,
                "temperature": 1.0,
                "stop_token_ids": [0],
                "logprobs": 1,
                "skip_special_tokens": False,
            },
        }
        raw = await client.post(endpoint, cast_to=httpx.Response, body=sampled_only)
        (choice,) = raw.json()["choices"]
        for token, entry in zip(choice["token_ids"], choice["logprobs"]["content"], strict=True):
            assert entry["token"] == f"token_id:{token}"
            assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0
        head = {
            **sampled_only,
            "sampling_params": {
                **sampled_only["sampling_params"],  # type: ignore[dict-item]
                "logprobs": 4,
                "flat_logprobs": True,
                "extra_args": {"prl_compact_logprobs": True},
                "detokenize": False,
            },
        }
        raw = await client.post(endpoint, cast_to=httpx.Response, body=head)
        (headed,) = raw.json()["choices"]
        assert "compact_logprobs" not in headed  # JSON log-probs, the client's fallback
        assert all(len(e["top_logprobs"]) == 4 for e in headed["logprobs"]["content"])
    trace = await trace_of(served, cid)
    assert [list(t.completion_token_ids) for t in trace.turns] == [choice["token_ids"], headed["token_ids"]]


def refusals(vocab: int, context: int) -> list[tuple[dict[str, Any], str, str]]:
    """(request body, the error's `param`, its `code`) for every refused shape."""
    ok = [1, 2, 3]
    return [
        ({"token_ids": []}, "token_ids", "INVALID_ARGUMENT"),
        ({"token_ids": "hello"}, "token_ids", "INVALID_ARGUMENT"),
        ({"sampling_params": {"max_tokens": 2}}, "token_ids", "INVALID_ARGUMENT"),
        ({"token_ids": [1, -2]}, "token_ids[1]", "INVALID_ARGUMENT"),
        ({"token_ids": [1, 2.5]}, "token_ids[1]", "INVALID_ARGUMENT"),
        ({"token_ids": [1, True]}, "token_ids[1]", "INVALID_ARGUMENT"),
        ({"token_ids": [3, 4, vocab]}, "token_ids[2]", "INVALID_ARGUMENT"),
        ({"token_ids": [ok, []]}, "token_ids[1]", "INVALID_ARGUMENT"),
        ({"token_ids": [ok, [1, vocab + 5]]}, "token_ids[1][1]", "INVALID_ARGUMENT"),
        ({"token_ids": [1] * context}, "token_ids", "CONTEXT_LENGTH_EXCEEDED"),
        ({"token_ids": [ok, [1] * context]}, "token_ids[1]", "CONTEXT_LENGTH_EXCEEDED"),
        ({"token_ids": [ok] * 65}, "token_ids", "INVALID_ARGUMENT"),
        (
            {"token_ids": ok, "sampling_params": {"max_tokens": 0}},
            "sampling_params.max_tokens",
            "INVALID_ARGUMENT",
        ),
        (
            {"token_ids": ok, "sampling_params": {"temperature": 3}},
            "sampling_params.temperature",
            "INVALID_ARGUMENT",
        ),
        ({"token_ids": ok, "sampling_params": {"n": 17}}, "sampling_params.n", "INVALID_ARGUMENT"),
        ({"token_ids": [ok] * 20, "sampling_params": {"n": 16}}, "sampling_params.n", "INVALID_ARGUMENT"),
        ({"token_ids": ok, "sampling_params": {"seed": -1}}, "sampling_params.seed", "INVALID_ARGUMENT"),
        (
            {"token_ids": ok, "sampling_params": {"logprobs": 21}},
            "sampling_params.logprobs",
            "INVALID_ARGUMENT",
        ),
        (
            {"token_ids": ok, "sampling_params": {"stop_token_ids": ["x"]}},
            "sampling_params.stop_token_ids",
            "INVALID_ARGUMENT",
        ),
        (
            {"token_ids": ok, "sampling_params": {"repetition_penalty": 1.3}},
            "sampling_params.repetition_penalty",
            "INVALID_ARGUMENT",
        ),
        ({"token_ids": ok, "sampling_params": {"beam": 2}}, "sampling_params.beam", "INVALID_ARGUMENT"),
        (
            {"token_ids": ok, "sampling_params": {"extra_args": {"x": 1}}},
            "sampling_params.extra_args",
            "INVALID_ARGUMENT",
        ),
        ({"token_ids": ok, "sampling_params": [1]}, "sampling_params", "INVALID_ARGUMENT"),
        ({"token_ids": ok, "stream": True}, "stream", "INVALID_ARGUMENT"),
        ({"token_ids": ok, "cache_salt": "s"}, "cache_salt", "INVALID_ARGUMENT"),
        ({"token_ids": ok, "prompt": "hi"}, "prompt", "INVALID_ARGUMENT"),
    ]


async def test_refused_requests_are_openai_errors_naming_the_field(
    served: Served, http: httpx.AsyncClient
) -> None:
    context = (await http.get("/v1/models")).json()["data"][0]["max_model_len"]
    for body, param, code in refusals(vocabulary(served), context):
        answer = await http.post("/inference/v1/generate", json=body)
        assert answer.status_code == 400, (body, answer.text)
        error = answer.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), body
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    # The last id of the vocabulary and a prompt one token short of the context are served.
    edge = await http.post(
        "/inference/v1/generate",
        json={
            "token_ids": [1] * (context - 2) + [vocabulary(served) - 1],
            "sampling_params": {"max_tokens": 1},
        },
    )
    assert edge.status_code == 200, edge.text
    assert len(edge.json()["choices"][0]["token_ids"]) == 1


async def test_the_model_key_and_route_are_checked(served: Served, http: httpx.AsyncClient) -> None:
    wrong_model = await http.post("/inference/v1/generate", json={"model": "someone/else", "token_ids": [1]})
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["code"] == "MODEL_NOT_FOUND"
    async with httpx.AsyncClient(base_url=served.root) as keyless:
        refused = await keyless.post("/inference/v1/generate", json={"token_ids": [1]})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "INVALID_CREDENTIALS"
    wrong_method = await http.get("/inference/v1/generate")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "NOT_IMPLEMENTED"
    bad_cid = await http.post(
        "/inference/v1/generate", json={"token_ids": [1]}, headers={"x-trace-correlation-id": "no spaces"}
    )
    assert bad_cid.status_code == 400
    not_json = await http.post(
        "/inference/v1/generate", content=b"{", headers={"content-type": "application/json"}
    )
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "MALFORMED_REQUEST"


async def test_ids_outside_the_vocabulary_are_refused_on_the_other_routes_too(
    served: Served, http: httpx.AsyncClient
) -> None:
    vocab = vocabulary(served)
    completion = await http.post("/v1/completions", json={"prompt": [1, 2, vocab], "max_tokens": 2})
    assert completion.status_code == 400, completion.text
    assert completion.json()["error"]["param"] == "prompt[2]"
    channel, stub = worker_stub(served.worker, served.mesh_key)
    try:
        request = pb.GenerateRequest(prompt_token_ids=[1, vocab + 1, 2])
        request.sampling.max_tokens = 2
        with pytest.raises(RpcError) as caught:
            async for _ in stub.Generate(request):
                pass
        assert (caught.value.code, caught.value.reason) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
        )
        assert [v.field for v in caught.value.violations] == ["prompt_token_ids[1]"]
        request.prompt_token_ids[1] = vocab - 1  # the last id of the vocabulary is served
        answers = [answer async for answer in stub.Generate(request)]
        assert answers[-1].HasField("finished")
    finally:
        await channel.close()

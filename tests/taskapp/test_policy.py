"""Policy, the SDK's OpenAI-compatible client, against the fake policy server (in process)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tandem_taskapp import Message, Policy, PolicyConfig, PolicyError, Turn, TurnLimitReached
from tandem_taskapp.models import RolloutRequest
from tandem_taskapp.policy import policy_session, proxy_configured
from tandem_taskapp.testing import FakePolicyServer, serve_in_thread

CONFIG = PolicyConfig(model="tiny", inference_url="http://policy.test/v1/traces/ep-1", temperature=0.5)


@pytest.fixture
def server() -> FakePolicyServer:
    return FakePolicyServer(["first", "second", "third"])


@pytest.fixture
async def client(server: FakePolicyServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app)) as c:
        yield c


def make(client: httpx.AsyncClient, **kwargs: Any) -> Policy:
    return Policy(CONFIG, trace_correlation_id="ep-1", client=client, **kwargs)


async def test_chat_sends_the_config_and_answers_the_text(
    server: FakePolicyServer, client: httpx.AsyncClient
) -> None:
    policy = make(client)
    assert await policy.chat([{"role": "user", "content": "hi"}]) == "first"
    [req] = server.requests
    assert req.path == "/v1/traces/ep-1/chat/completions"
    assert req.body == {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5}
    assert req.headers["x-trace-correlation-id"] == "ep-1"
    assert req.headers["traceparent"].startswith("00-")
    assert policy.last_response is not None
    assert policy.last_response["object"] == "chat.completion"
    assert policy.last_response["choices"][0]["message"]["content"] == "first"


async def test_overrides_and_raw_completions(server: FakePolicyServer, client: httpx.AsyncClient) -> None:
    policy = make(client)
    raw = await policy.complete([Message("user", "hi")], temperature=0, stop=["\n"], max_completion_tokens=3)
    assert raw["choices"][0]["message"]["content"] == "first"
    assert server.requests[0].body["temperature"] == 0
    assert server.requests[0].body["stop"] == ["\n"]
    assert server.requests[0].body["max_completion_tokens"] == 3


async def test_the_jobs_truncations_go_with_every_call(
    server: FakePolicyServer, client: httpx.AsyncClient
) -> None:
    body = {
        "trace_correlation_id": "ep-1",
        "env": {"seed": 1},
        "policy": {
            "config": {
                "model": "tiny",
                "inference_url": "http://policy.test/v1/traces/ep-1",
                "top_p": 0.9,
                "top_k": 20,
                "min_p": 0.05,
            }
        },
    }
    request = RolloutRequest.from_json(body)
    assert (request.policy.top_p, request.policy.top_k, request.policy.min_p) == (0.9, 20, 0.05)
    assert request.to_json()["policy"]["config"] == body["policy"]["config"]
    policy = Policy(request.policy, trace_correlation_id="ep-1", client=client)
    await policy.chat([{"role": "user", "content": "hi"}])
    await policy.chat([{"role": "user", "content": "again"}], top_p=1.0)  # an app may still override
    first, second = (r.body for r in server.requests)
    assert (first["top_p"], first["top_k"], first["min_p"]) == (0.9, 20, 0.05)
    assert (second["top_p"], second["top_k"]) == (1.0, 20)
    await make(client).chat([{"role": "user", "content": "plain"}])
    assert not {"top_p", "top_k", "min_p"} & set(server.requests[-1].body)  # unset: nothing is sent


async def test_the_episodes_seed_goes_with_each_call_one_further_per_call(
    server: FakePolicyServer, client: httpx.AsyncClient
) -> None:
    config = {"model": "tiny", "inference_url": "http://policy.test/v1/traces/ep-1", "seed": 2**64 - 2}
    request = RolloutRequest.from_json({"trace_correlation_id": "ep-1", "policy": {"config": config}})
    assert request.policy.seed == 2**64 - 2
    assert request.to_json()["policy"]["config"] == config
    assert (
        RolloutRequest.from_json(
            {**request.to_json(), "policy": {"config": {**config, "seed": "5"}}}
        ).policy.seed
        == 5
    )
    policy = Policy(request.policy, trace_correlation_id="ep-1", client=client)
    for turn in ("one", "two", "three"):
        await policy.chat([{"role": "user", "content": turn}])
    # The same seed on every call would replay one set of draws per turn; seed + k wraps at 2^64.
    assert [r.body["seed"] for r in server.requests] == [2**64 - 2, 2**64 - 1, 0]
    await make(client).chat([{"role": "user", "content": "unseeded"}])
    assert "seed" not in server.requests[-1].body  # the worker draws one


async def test_turns_hold_what_is_new_then_the_reply(client: httpx.AsyncClient) -> None:
    policy = make(client)
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "go"},
    ]
    reply = await policy.chat(history)
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Higher."}]
    await policy.chat(history)
    await policy.chat([{"role": "user", "content": "fresh"}])  # not a continuation: recorded whole
    assert policy.turns == [
        Turn.of(Message("system", "rules"), Message("user", "go"), Message("assistant", "first")),
        Turn.of(Message("user", "Higher."), Message("assistant", "second")),
        Turn.of(Message("user", "fresh"), Message("assistant", "third")),
    ]
    assert policy.turns_used == 3


async def test_the_turn_limit(server: FakePolicyServer, client: httpx.AsyncClient) -> None:
    policy = make(client, max_turns=2)
    assert policy.turns_left == 2
    await policy.chat([{"role": "user", "content": "1"}])
    await policy.chat([{"role": "user", "content": "2"}])
    assert policy.turns_left == 0
    with pytest.raises(TurnLimitReached) as info:
        await policy.chat([{"role": "user", "content": "3"}])
    assert info.value.max_turns == 2
    assert len(server.requests) == 2


async def test_an_error_status_is_a_policy_error(server: FakePolicyServer, client: httpx.AsyncClient) -> None:
    server.status_code = 500
    with pytest.raises(PolicyError) as info:
        await make(client).chat([{"role": "user", "content": "x"}])
    assert info.value.status_code == 500
    assert "policy.test" not in str(info.value)


async def test_an_unreachable_policy_is_a_policy_error_without_the_url() -> None:
    config = PolicyConfig(model="m", inference_url="http://user:pw@127.0.0.1:9/v1")
    async with Policy(config, trace_correlation_id="ep-2", timeout=5) as policy:
        with pytest.raises(PolicyError) as info:
            await policy.chat([{"role": "user", "content": "x"}])
    assert "pw" not in str(info.value)
    assert "127.0.0.1" not in str(info.value)


async def test_a_body_that_is_not_a_completion_is_a_policy_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"nope": True})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(PolicyError, match="not a chat completion"):
            await make(c).chat([{"role": "user", "content": "x"}])


async def test_content_parts_and_tool_calls_are_recorded_as_text() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        msg = {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}
        return httpx.Response(200, json={"choices": [{"message": msg}]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        policy = make(c)
        parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        assert await policy.chat([{"role": "user", "content": parts}]) == ""
    [turn] = policy.turns
    assert turn.messages[0] == Message("user", "ab")
    assert '"tool_calls"' not in turn.messages[1].content
    assert '"function"' in turn.messages[1].content


async def test_scripted_and_callable_replies(client: httpx.AsyncClient) -> None:
    fake = FakePolicyServer(lambda messages, body: str(len(messages)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fake.app)) as c:
        assert await make(c).chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "2"
    assert fake.requests_for("ep-1")[0].messages[1]["content"] == "b"


# -- through a shared aiohttp session, as a Task App server calls the policy --------------------------------


async def test_a_shared_session_carries_the_calls_and_maps_failures() -> None:
    server = FakePolicyServer(["first", "second"], delay=0.0)
    with serve_in_thread(server.app) as url:
        async with policy_session() as session:
            config = PolicyConfig(model="tiny", inference_url=FakePolicyServer.inference_url(url, "ep-s"))
            policy = Policy(config, trace_correlation_id="ep-s", session=session, timeout=10)
            assert await policy.chat([{"role": "user", "content": "a"}]) == "first"
            assert await policy.chat([{"role": "user", "content": "b"}]) == "second"
            other = Policy(config, trace_correlation_id="ep-t", session=session, timeout=10)
            await other.chat([{"role": "user", "content": "c"}])
            await policy.aclose()  # a policy never closes a session it was given
            assert not session.closed
            sent = server.requests_for("ep-s")
            assert len(sent) == 2 and sent[0].body["model"] == "tiny"
            assert sent[0].headers["content-type"] == "application/json"
            assert server.requests[-1].correlation_id == "ep-t"

            server.status_code = 503
            with pytest.raises(PolicyError) as status:
                await policy.chat([{"role": "user", "content": "x"}])
            assert status.value.status_code == 503

            down = PolicyConfig(model="m", inference_url="http://user:pw@127.0.0.1:9/v1")
            unreachable = Policy(down, trace_correlation_id="ep-d", session=session, timeout=5)
            with pytest.raises(PolicyError) as info:
                await unreachable.chat([{"role": "user", "content": "x"}])
            assert "pw" not in str(info.value) and "127.0.0.1" not in str(info.value)


async def test_a_slow_policy_over_a_session_times_out_as_a_policy_error() -> None:
    server = FakePolicyServer("late", delay=5.0)
    with serve_in_thread(server.app) as url:
        async with policy_session() as session:
            config = PolicyConfig(model="m", inference_url=FakePolicyServer.inference_url(url, "ep-slow"))
            policy = Policy(config, trace_correlation_id="ep-slow", session=session, timeout=0.3)
            with pytest.raises(PolicyError, match="policy call failed"):
                await policy.chat([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("variables", "configured"),
    [
        ({}, False),
        # Every variable ending in _PROXY is a proxy to urllib, the mesh's own port setting too.
        ({"TANDEM_PORTS__TASKAPP_PROXY": "50053", "TANDEM_TARGETS__TASKAPP_PROXY": "proxy:50053"}, False),
        ({"NO_PROXY": "localhost"}, False),
        ({"HTTPS_PROXY": "http://proxy.test:3128"}, True),
        ({"http_proxy": "http://proxy.test:3128"}, True),
    ],
)
def test_sessions_trust_the_environment_only_when_an_http_proxy_is_set(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], configured: bool
) -> None:
    for name in list(os.environ):
        if name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert proxy_configured() is configured

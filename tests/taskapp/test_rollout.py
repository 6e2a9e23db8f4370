"""POST /rollout and GET /task_info over real HTTP: schema-valid answers, correlation ids on every policy
call, idempotency, limits, request validation and error bodies."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import pytest

from tandem_taskapp import (
    REPLAYED_HEADER,
    InvalidArgument,
    Policy,
    Result,
    RolloutCache,
    RolloutRequest,
    TaskApp,
    create_app,
)
from tandem_taskapp import schema as contract
from tandem_taskapp.testing import FakePolicyServer, serve_in_thread
from tests.taskapp.conftest import KEY, PolicyFixture, rollout_body, served

TRACEPARENT = re.compile(
    r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$"
)  # any trace flags (W3C level 2 adds "random")


class ThreeTurns(TaskApp):
    """Asks three questions in one conversation; counts its episodes."""

    name = "three-turns"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.episodes = 0
        self.requests: list[RolloutRequest] = []

    def task_info(self, seed: int) -> dict[str, Any]:
        return {"instance": {"questions": [f"q{seed}-{i}" for i in range(3)]}}

    async def rollout(
        self, seed: int, policy: Policy, config: dict[str, Any], request: RolloutRequest | None = None
    ) -> Result:
        self.episodes += 1
        if request is not None:
            self.requests.append(request)
        if config.get("sleep"):
            await asyncio.sleep(float(config["sleep"]))
        messages: list[dict[str, str]] = []
        replies = []
        for i in range(3):
            messages.append({"role": "user", "content": f"q{seed}-{i}"})
            reply = await policy.chat(messages)
            replies.append(reply)
            messages.append({"role": "assistant", "content": reply})
        return Result(outcome_reward=0.5, event_rewards=[0.0, 1.0], details={"replies": replies})


# -- task_info ---------------------------------------------------------------------------------------------


def test_task_info_is_deterministic_per_seed_and_schema_valid() -> None:
    with served(ThreeTurns()) as client:
        a = client.get("/task_info", params={"seed": 7})
        b = client.get("/task_info", params={"seed": 7})
        c = client.get("/task_info", params={"seed": 8})
        base = client.get("/task_info")
    assert a.status_code == b.status_code == c.status_code == base.status_code == 200
    assert a.content == b.content
    assert a.json() != c.json()
    assert a.json()["seed"] == 7
    assert a.json()["instance"]["questions"][0] == "q7-0"
    for r in (a, c, base):
        assert contract.errors("TaskInfo", r.json()) == []
    assert "seed" not in base.json()
    assert base.json()["task"]["id"] == "three-turns"
    assert base.json()["limits"] == {"max_turns": 100, "max_seconds": 600}


@pytest.mark.parametrize("seed", ["abc", "-1", "1.5", str(2**64), ""])
def test_task_info_rejects_a_bad_seed(seed: str) -> None:
    with served(ThreeTurns()) as client:
        r = client.get("/task_info", params={"seed": seed})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert contract.errors("Error", r.json()) == []


def test_task_info_accepts_the_largest_seed() -> None:
    with served(ThreeTurns()) as client:
        r = client.get("/task_info", params={"seed": str(2**64 - 1)})
    assert r.status_code == 200
    assert r.json()["seed"] == 2**64 - 1


def test_task_info_errors_answer_500_without_details() -> None:
    def broken(seed: int) -> dict[str, Any]:
        raise RuntimeError("secret internal detail")

    with served(TaskApp(name="broken", task_info=broken)) as client:
        r = client.get("/task_info", params={"seed": 1})
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "INTERNAL"
    assert "secret internal detail" not in r.text


# -- rollout -----------------------------------------------------------------------------------------------


def test_rollout_answers_a_schema_valid_result_echoing_the_id(policy: PolicyFixture) -> None:
    app = ThreeTurns()
    with served(app) as client:
        r = client.post("/rollout", json=rollout_body("ep-1", policy.url("ep-1"), seed=5))
    assert r.status_code == 200, r.text
    body = r.json()
    assert contract.errors("RolloutResponse", body) == []
    assert body["trace_correlation_id"] == "ep-1"
    assert body["aborted"] is False
    assert body["metrics"] == {
        "outcome_reward": 0.5,
        "event_rewards": [0.0, 1.0],
        "details": {"replies": ["ok"] * 3},
    }
    turns = body["trajectory"]["turns"]
    assert [t["messages"] for t in turns] == [
        [{"role": "user", "content": f"q5-{i}"}, {"role": "assistant", "content": "ok"}] for i in range(3)
    ]
    assert REPLAYED_HEADER not in r.headers
    assert app.requests[0].mode == "rl"
    assert app.requests[0].limits.max_turns == 0


def test_every_policy_call_carries_the_correlation_id_and_one_trace(policy: PolicyFixture) -> None:
    with served(ThreeTurns()) as client:
        r = client.post("/rollout", json=rollout_body("job-9:ep.1", policy.url("job-9:ep.1")))
    assert r.status_code == 200
    calls = policy.server.requests
    assert len(calls) == 3
    trace_ids = set()
    span_ids = set()
    for call in calls:
        assert call.path == "/v1/traces/job-9:ep.1/chat/completions"
        assert call.headers["x-trace-correlation-id"] == "job-9:ep.1"
        m = TRACEPARENT.match(call.headers["traceparent"])
        assert m, call.headers["traceparent"]
        trace_ids.add(m.group(1))
        span_ids.add(m.group(2))
        assert call.body["model"] == "tiny-policy"
        assert call.body["temperature"] == 0.7
        assert call.body["max_completion_tokens"] == 16
    assert len(trace_ids) == 1
    assert len(span_ids) == 3
    # The conversation grows turn by turn.
    assert [len(c.messages) for c in calls] == [1, 3, 5]


def test_policy_calls_continue_the_callers_trace(policy: PolicyFixture) -> None:
    incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with served(ThreeTurns()) as client:
        r = client.post(
            "/rollout", json=rollout_body("ep-t", policy.url("ep-t")), headers={"traceparent": incoming}
        )
    assert r.status_code == 200
    for call in policy.server.requests:
        m = TRACEPARENT.match(call.headers["traceparent"])
        assert m
        assert m.group(1) == "0af7651916cd43dd8448eb211c80319c"
        assert m.group(2) != "b7ad6b7169203331"


def test_a_repeat_returns_the_recorded_result_without_replaying(policy: PolicyFixture) -> None:
    app = ThreeTurns()
    policy.server.replies = ["a", "b", "c", "d", "e", "f"]
    body = rollout_body("ep-idem", policy.url("ep-idem"), seed=3)
    with served(app) as client:
        first = client.post("/rollout", json=body)
        second = client.post("/rollout", json=body)
    assert first.status_code == second.status_code == 200
    assert first.content == second.content
    assert second.headers[REPLAYED_HEADER] == "true"
    assert app.episodes == 1
    assert len(policy.server.requests) == 3


async def test_concurrent_duplicates_join_the_episode_in_flight(policy: PolicyFixture) -> None:
    app = ThreeTurns()
    policy.server.delay = 0.2
    body = rollout_body("ep-join", policy.url("ep-join"))
    with serve_in_thread(create_app(app, KEY)) as url:
        async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": KEY}, timeout=30) as client:
            answers = await asyncio.gather(*(client.post("/rollout", json=body) for _ in range(4)))
    assert {a.status_code for a in answers} == {200}
    assert len({a.content for a in answers}) == 1
    assert app.episodes == 1
    assert len(policy.server.requests) == 3
    assert sum(a.headers.get(REPLAYED_HEADER) == "true" for a in answers) == 3


def test_the_same_id_with_a_different_body_is_409(policy: PolicyFixture) -> None:
    with served(ThreeTurns()) as client:
        assert (
            client.post("/rollout", json=rollout_body("ep-x", policy.url("ep-x"), seed=1)).status_code == 200
        )
        r = client.post("/rollout", json=rollout_body("ep-x", policy.url("ep-x"), seed=2))
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "REQUEST_ID_REUSED"


def test_equivalent_bodies_count_as_the_same_request(policy: PolicyFixture) -> None:
    app = ThreeTurns()
    a = rollout_body("ep-eq", policy.url("ep-eq"), seed=4, mode="rl")
    b = rollout_body("ep-eq", policy.url("ep-eq"), seed="4", mode="ROLLOUT_MODE_RL")
    with served(app) as client:
        assert client.post("/rollout", json=a).status_code == 200
        r = client.post("/rollout", json=b)
    assert r.status_code == 200
    assert r.headers[REPLAYED_HEADER] == "true"
    assert app.episodes == 1


def test_max_seconds_aborts_the_episode(policy: PolicyFixture) -> None:
    app = ThreeTurns()
    body = rollout_body("ep-slow", policy.url("ep-slow"), config={"sleep": 30}, max_seconds=1)
    with served(app) as client:
        r = client.post("/rollout", json=body)
        again = client.post("/rollout", json=body)
    assert r.status_code == 200
    result = r.json()
    assert contract.errors("RolloutResponse", result) == []
    assert result["aborted"] is True
    assert result["trace_correlation_id"] == "ep-slow"
    assert result["metrics"]["details"]["abort_reason"] == "max_seconds"
    assert again.content == r.content
    assert app.episodes == 1


def test_the_app_default_max_seconds_applies(policy: PolicyFixture) -> None:
    app = ThreeTurns(max_seconds=1)
    with served(app) as client:
        r = client.post("/rollout", json=rollout_body("ep-def", policy.url("ep-def"), config={"sleep": 30}))
    assert r.json()["aborted"] is True


def test_max_turns_aborts_an_episode_that_does_not_stop(policy: PolicyFixture) -> None:
    async def endless(seed: int, policy: Policy, config: dict[str, Any]) -> Result:
        while True:
            await policy.chat([{"role": "user", "content": "again"}])

    with served(TaskApp(name="endless", rollout=endless)) as client:
        r = client.post("/rollout", json=rollout_body("ep-turns", policy.url("ep-turns"), max_turns=3))
    assert r.status_code == 200
    result = r.json()
    assert result["aborted"] is True
    assert result["metrics"]["details"] == {"abort_reason": "max_turns", "max_turns": 3}
    assert len(result["trajectory"]["turns"]) == 3
    assert len(policy.server.requests) == 3


def test_mode_proto_names_and_string_seeds_are_accepted(policy: PolicyFixture) -> None:
    app = ThreeTurns()
    body = rollout_body("ep-m", policy.url("ep-m"), seed="42", mode="ROLLOUT_MODE_EVAL")
    with served(app) as client:
        assert client.post("/rollout", json=body).status_code == 200
    assert app.requests[0].mode == "eval"
    assert app.requests[0].seed == 42


def test_a_missing_seed_and_mode_default(policy: PolicyFixture) -> None:
    app = ThreeTurns()
    body = rollout_body("ep-d", policy.url("ep-d"), mode=None)
    del body["env"]["seed"]
    del body["limits"]
    with served(app) as client:
        assert client.post("/rollout", json=body).status_code == 200
    assert app.requests[0].seed == 0
    assert app.requests[0].mode == "rl"


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (lambda b: b.pop("trace_correlation_id"), "$"),
        (lambda b: b.update(trace_correlation_id="bad id"), "$.trace_correlation_id"),
        (lambda b: b.update(trace_correlation_id="x" * 129), "$.trace_correlation_id"),
        (lambda b: b.update(mode="train"), "$.mode"),
        (lambda b: b.pop("policy"), "$"),
        (lambda b: b["policy"]["config"].pop("inference_url"), "$.policy.config"),
        (lambda b: b["policy"]["config"].update(inference_url="ftp://x/v1"), "$.policy.config.inference_url"),
        (lambda b: b["policy"]["config"].update(temperature=3), "$.policy.config.temperature"),
        (lambda b: b["env"].update(seed=-1), "$.env.seed"),
        (lambda b: b["env"].update(seed=str(2**64)), "$.env.seed"),
        (lambda b: b["policy"]["config"].update(seed=-1), "$.policy.config.seed"),
        (lambda b: b["policy"]["config"].update(seed=2**64), "$.policy.config.seed"),
        (lambda b: b["env"].update(config={"blob": "x" * 70_000}), "$.env.config"),
        (lambda b: b["limits"].update(max_seconds=86401), "$.limits.max_seconds"),
    ],
)
def test_schema_violations_are_422_with_details(policy: PolicyFixture, mutate: Any, path: str) -> None:
    body = rollout_body("ep-v", policy.url("ep-v"))
    mutate(body)
    with served(ThreeTurns()) as client:
        r = client.post("/rollout", json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "VALIDATION_FAILED"
    assert path in [d["path"] for d in err["details"]]
    assert contract.errors("Error", r.json()) == []
    assert policy.server.requests == []


@pytest.mark.parametrize(
    "raw", [b"{not json", b"[1, 2]", b'"text"', b'{"trace_correlation_id": NaN}', b"\xff\xfe"]
)
def test_a_body_that_is_not_a_json_object_is_400(raw: bytes) -> None:
    with served(ThreeTurns()) as client:
        r = client.post("/rollout", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "INVALID_ARGUMENT"


def test_a_huge_body_is_413() -> None:
    with served(ThreeTurns()) as client:
        r = client.post("/rollout", content=b"{" + b" " * (1 << 20) + b"}")
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"


def test_unknown_routes_answer_the_error_body() -> None:
    with served(ThreeTurns()) as client:
        missing = client.get("/nope")
        wrong_method = client.get("/rollout")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "NOT_FOUND"
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == "METHOD_NOT_ALLOWED"


# -- failures ----------------------------------------------------------------------------------------------


def test_a_failing_policy_is_502_and_a_retry_plays_again() -> None:
    server = FakePolicyServer("ok", status_code=503)
    app = ThreeTurns()
    with served(app) as client, serve_in_thread(server.app) as policy_url:
        body = rollout_body("ep-p", FakePolicyServer.inference_url(policy_url, "ep-p"))
        r = client.post("/rollout", json=body)
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "POLICY_UNAVAILABLE"
        assert policy_url not in r.text
        server.status_code = 200
        retry = client.post("/rollout", json=body)
    assert retry.status_code == 200
    assert REPLAYED_HEADER not in retry.headers
    assert app.episodes == 2


def test_an_unreachable_policy_is_502() -> None:
    with served(ThreeTurns()) as client:
        r = client.post("/rollout", json=rollout_body("ep-u", "http://127.0.0.1:9/v1/traces/ep-u"))
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "POLICY_UNAVAILABLE"


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), "1"])
def test_a_bad_reward_is_500_invalid_result(policy: PolicyFixture, reward: Any) -> None:
    async def bad(seed: int, policy: Policy, config: dict[str, Any]) -> Result:
        return Result(outcome_reward=reward)

    with served(TaskApp(name="bad", rollout=bad)) as client:
        r = client.post("/rollout", json=rollout_body("ep-b", policy.url("ep-b")))
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "INVALID_RESULT"


def test_non_json_details_are_500_invalid_result(policy: PolicyFixture) -> None:
    async def bad(seed: int, policy: Policy, config: dict[str, Any]) -> Result:
        return Result(1.0, details={"x": object()})

    with served(TaskApp(name="bad", rollout=bad)) as client:
        r = client.post("/rollout", json=rollout_body("ep-j", policy.url("ep-j")))
    assert r.json()["error"]["code"] == "INVALID_RESULT"


def test_an_app_exception_is_500_without_its_message(policy: PolicyFixture) -> None:
    async def boom(seed: int, policy: Policy, config: dict[str, Any]) -> Result:
        raise RuntimeError("internal secret detail")

    with served(TaskApp(name="boom", rollout=boom)) as client:
        r = client.post("/rollout", json=rollout_body("ep-e", policy.url("ep-e")))
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "INTERNAL"
    assert "internal secret detail" not in r.text


def test_invalid_argument_from_the_app_is_400(policy: PolicyFixture) -> None:
    async def picky(seed: int, policy: Policy, config: dict[str, Any]) -> float:
        raise InvalidArgument("unknown split 'dev'")

    with served(TaskApp(name="picky", rollout=picky)) as client:
        r = client.post("/rollout", json=rollout_body("ep-i", policy.url("ep-i")))
    assert r.status_code == 400
    assert r.json()["error"] == {"code": "INVALID_ARGUMENT", "message": "unknown split 'dev'"}


def test_a_bare_float_is_the_outcome_reward(policy: PolicyFixture) -> None:
    app = TaskApp(name="floaty")

    @app.on_rollout
    async def _rollout(seed: int, policy: Policy, config: dict[str, Any]) -> float:
        await policy.chat([{"role": "user", "content": "x"}])
        return 0.25

    with served(app) as client:
        r = client.post("/rollout", json=rollout_body("ep-f", policy.url("ep-f")))
    assert r.json()["metrics"] == {"outcome_reward": 0.25, "event_rewards": [], "details": {}}
    assert len(r.json()["trajectory"]["turns"]) == 1


def test_long_messages_are_truncated(policy: PolicyFixture) -> None:
    policy.server.replies = "y" * (2 << 20)

    async def once(seed: int, policy: Policy, config: dict[str, Any]) -> float:
        await policy.chat([{"role": "user", "content": "x"}])
        return 1.0

    with served(TaskApp(name="long", rollout=once)) as client:
        r = client.post("/rollout", json=rollout_body("ep-l", policy.url("ep-l")))
    content = r.json()["trajectory"]["turns"][0]["messages"][1]["content"]
    assert content.endswith("…[truncated]")
    assert len(content.encode()) <= 1 << 20


# -- the cache ---------------------------------------------------------------------------------------------


async def test_the_cache_is_a_bounded_lru() -> None:
    cache = RolloutCache(max_entries=2)

    async def value(n: int) -> dict[str, Any]:
        return {"n": n}

    entries = {}
    for key in ("a", "b", "c"):
        task = asyncio.ensure_future(value(ord(key)))
        entries[key] = cache.start(key, "fp", task)
        await task
        cache.finish(key, entries[key], task.result())
        if key == "b":
            assert cache.get("a") is not None  # touch a: b is now the oldest
    assert "a" in cache
    assert "b" not in cache
    assert "c" in cache
    assert len(cache) == 2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def finished(cache: RolloutCache, key: str, result: dict[str, Any] | None = None) -> None:
    async def value() -> dict[str, Any]:
        return {"key": key}

    task = asyncio.ensure_future(value())
    entry = cache.start(key, "fp", task)
    await task
    cache.finish(key, entry, task.result() if result is None else result)


async def test_the_bound_counts_finished_answers_only_and_never_drops_an_episode_in_flight() -> None:
    cache = RolloutCache(max_entries=2)
    gate = asyncio.Event()

    async def blocked() -> dict[str, Any]:
        await gate.wait()
        return {"key": "slow"}

    slow_task = asyncio.ensure_future(blocked())
    slow = cache.start("slow", "fp", slow_task)
    for key in ("a", "b", "c", "d"):
        await finished(cache, key)
    assert "slow" in cache and cache.get("slow") is slow
    assert ("a" in cache, "b" in cache, "c" in cache, "d" in cache) == (False, False, True, True)
    assert cache.running == 1 and cache.in_flight() == [slow_task]
    gate.set()
    await slow_task
    cache.finish("slow", slow, slow_task.result())
    assert "c" not in cache and "slow" in cache and len(cache) == 2 and cache.running == 0


async def test_a_failed_episode_is_forgotten_and_a_stale_finish_is_ignored() -> None:
    cache = RolloutCache(max_entries=4)

    async def value() -> dict[str, Any]:
        return {}

    task = asyncio.ensure_future(value())
    first = cache.start("k", "fp", task)
    await task
    cache.finish("k", first, None)  # failed
    assert "k" not in cache and len(cache) == 0
    again = cache.start("k", "fp", task)
    cache.finish("k", first, {"stale": True})  # not the entry in the cache: ignored
    assert cache.get("k") is again and again.result is None


async def test_answers_expire_ttl_after_their_last_use() -> None:
    clock = Clock()
    cache = RolloutCache(max_entries=10, ttl_s=60, clock=clock)
    await finished(cache, "a")
    clock.now += 30
    await finished(cache, "b")
    clock.now += 20
    assert cache.get("a") is not None  # used at 50 s: kept another 60 s from now
    clock.now += 45
    assert "b" not in cache  # finished 65 s ago, never used since
    assert cache.get("a") is not None
    clock.now += 61
    assert cache.get("a") is None and len(cache) == 0


def test_cache_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        RolloutCache(max_entries=-1)
    with pytest.raises(ValueError, match="ttl_s"):
        RolloutCache(ttl_s=0)


def test_an_expired_answer_plays_the_episode_again(policy: PolicyFixture) -> None:
    app = ThreeTurns()
    with served(app, cache_ttl_s=0.2) as client:
        body = rollout_body("ep-ttl", policy.url("ep-ttl"))
        assert client.post("/rollout", json=body).status_code == 200
        time.sleep(0.3)  # past the answer's time to live, whatever the machine's load
        again = client.post("/rollout", json=body)
    assert again.status_code == 200 and REPLAYED_HEADER not in again.headers
    assert app.episodes == 2


def test_request_round_trips_through_json() -> None:
    body = rollout_body("ep-r", "http://h/v1", seed=9, config={"split": "test"}, mode="eval", max_turns=4)
    spec = RolloutRequest.from_json(body)
    assert RolloutRequest.from_json(spec.to_json()) == spec
    assert json.loads(json.dumps(spec.to_json())) == spec.to_json()

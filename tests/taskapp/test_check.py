"""The conformance kit against tiny Task Apps written here: one compliant app passes every check, and each
broken app fails exactly the checks about its flaw. The apps are served by uvicorn on free loopback ports
inside the test's event loop; the kit serves its own stub policy the same way."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import io
import json
import math
import random
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tandem_taskapp import check
from tandem_taskapp.check import CHECK_NAMES, CheckResult, StubPolicyServer, format_table, run_checks

KEY = "tk_live_3f9a7c2e5b1d4a8f9c0e6b7a2d5f8c1e"

# ------------------------------------------------------------------------------------------- test Task Apps


@dataclass(frozen=True)
class Flaws:
    """What a test app gets wrong; the default app gets nothing wrong."""

    leak_key_in_401: bool = False  # the 401 body hints the expected key's prefix
    echo_presented_key: bool = False  # the 401 body repeats the key the caller sent
    accept_any_key: bool = False  # any non-empty key is accepted
    random_task_info: bool = False  # /task_info carries a fresh nonce each time
    wrong_echo: bool = False  # the result names another correlation id
    nan_reward: bool = False  # outcome_reward is NaN
    ignore_max_seconds: bool = False  # waits for the policy however long it takes
    forget_results: bool = False  # plays a repeated id again (deterministic, so the same answer by luck)
    two_violations: bool = False  # the answer's reward is a string and its aborted a word


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    # allow_nan: the NaN app must be able to send NaN, which Starlette's JSONResponse refuses.
    return Response(json.dumps(body, allow_nan=True), status, headers, media_type="application/json")


def make_app(flaws: Flaws = Flaws(), key: str | None = KEY) -> Starlette:
    """A Task App: 'add one' — the policy should answer seed + 1. `key` None takes no key."""
    results: dict[str, tuple[Any, Any]] = {}

    def presented(request: Request) -> str:
        auth = request.headers.get("authorization", "")
        bearer = auth[len("Bearer ") :] if auth.startswith("Bearer ") else ""
        return request.headers.get("x-api-key") or bearer

    def authorized(request: Request) -> bool:
        if key is None:
            return True
        given = presented(request)
        if flaws.accept_any_key:
            return bool(given)
        return hmac.compare_digest(given.encode(), key.encode())

    def unauthorized(request: Request) -> Response:
        message = "missing or wrong key"
        if flaws.leak_key_in_401 and key:
            message = f"expected a key starting with {key[:6]}"
        if flaws.echo_presented_key:
            message = f"the key {presented(request)!r} is not valid"
        return _json(
            {"error": {"code": "UNAUTHENTICATED", "message": message}},
            401,
            {"WWW-Authenticate": 'Bearer realm="taskapp"'},
        )

    async def health(request: Request) -> Response:
        given = presented(request)
        if given and not authorized(request):
            return unauthorized(request)
        return _json({"healthy": True, "task": "add-one"} if given else {"healthy": True})

    async def task_info(request: Request) -> Response:
        if not authorized(request):
            return unauthorized(request)
        seed = int(request.query_params.get("seed", "0"))
        body: dict[str, Any] = {
            "task": {"id": "add-one", "name": "Add one"},
            "dataset": {"splits": [{"name": "train"}, {"name": "test"}], "seed_range": {"min": 0}},
            "rubric": {"outcome": {"min": 0.0, "max": 1.0}},
            "limits": {"max_turns": 1, "max_seconds": 30},
            "seed": seed,
            "instance": {"prompt": f"What is {seed} + 1?"},
        }
        if flaws.random_task_info:
            body["instance"]["nonce"] = random.random()  # noqa: S311
        return _json(body)

    async def rollout(request: Request) -> Response:
        if not authorized(request):
            return unauthorized(request)
        spec = await request.json()
        cid = spec["trace_correlation_id"]
        if cid in results and not flaws.forget_results:
            recorded_spec, recorded = results[cid]
            if recorded_spec != spec:
                return _json({"error": {"code": "REQUEST_ID_REUSED", "message": "id reused"}}, 409)
            return _json(recorded, headers={"X-Tandem-Replayed": "true"})
        seed = int(spec["env"].get("seed", 0))
        config = spec["policy"]["config"]
        max_seconds = (spec.get("limits") or {}).get("max_seconds") or 30
        prompt = {"role": "user", "content": f"What is {seed} + 1?"}
        aborted = False
        reply = ""
        try:
            async with asyncio.timeout(None if flaws.ignore_max_seconds else max_seconds):
                async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
                    answer = await client.post(
                        config["inference_url"] + "/chat/completions",
                        json={"model": config["model"], "messages": [prompt]},
                        headers={"X-Trace-Correlation-Id": cid},
                    )
            reply = answer.json()["choices"][0]["message"]["content"]
        except TimeoutError:
            aborted = True
        reward = float("nan") if flaws.nan_reward else float(reply.strip() == str(seed + 1))
        turn = [prompt] + ([{"role": "assistant", "content": reply}] if not aborted else [])
        result = {
            "trace_correlation_id": "someone-else" if flaws.wrong_echo else cid,
            "metrics": {"outcome_reward": reward, "event_rewards": [], "details": {"reply": reply}},
            "trajectory": {"turns": [{"messages": turn}]},
            "aborted": aborted,
        }
        if flaws.two_violations:
            result = {**result, "aborted": "no", "metrics": {"outcome_reward": str(reward)}}
        results[cid] = (spec, result)
        return _json(result)

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/task_info", task_info),
            Route("/rollout", rollout, methods=["POST"]),
        ]
    )


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # leave pytest's signal handlers alone
        yield


@contextlib.asynccontextmanager
async def serve(app: Starlette) -> AsyncIterator[str]:
    """Serve `app` on a free loopback port for the duration; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY, see check.py
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=1
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), "the test app did not start"
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=5)


async def check_app(app: Starlette, key: str = KEY, **kwargs: Any) -> dict[str, CheckResult]:
    async with serve(app) as url:
        results = await run_checks(url, key, timeout_s=10, **kwargs)
    assert [r.name for r in results] == list(CHECK_NAMES)
    for result in results:  # the key never reaches a detail, whatever the app does
        assert KEY not in result.detail and KEY[:6] not in result.detail
        assert result.duration_s >= 0
    return {r.name: r for r in results}


def failed(results: dict[str, CheckResult]) -> set[str]:
    return {name for name, r in results.items() if not r.passed}


# ------------------------------------------------------------------------------------------- tests


async def test_compliant_app_passes_every_check() -> None:
    results = await check_app(make_app())
    assert failed(results) == set(), format_table(list(results.values()))
    assert results["task_info_schema"].detail == "validated against taskapp-openapi.yaml"
    assert results["timeout_behaviour"].detail.endswith("with aborted: true")
    assert results["idempotent_repeat"].detail == "replayed the recorded result"
    assert not any(r.detail.startswith("skipped") for r in results.values())


@pytest.mark.parametrize(
    ("flaws", "expected"),
    [
        pytest.param(
            Flaws(leak_key_in_401=True),
            {
                "auth_missing_key": "the 401 of POST /rollout without a key reveals key material",
                "auth_wrong_key": "the 401 of POST /rollout with a wrong key reveals key material",
            },
            id="leaks-key",
        ),
        pytest.param(
            Flaws(echo_presented_key=True),
            {"auth_wrong_key": "echoes the presented key"},
            id="echoes-wrong-key",
        ),
        pytest.param(
            Flaws(accept_any_key=True),
            {
                "auth_wrong_key": "POST /rollout with a wrong key answered HTTP 200, expected 401",
                "auth_bearer": "with a wrong bearer key answered HTTP 200, expected 401",
            },
            id="any-key",
        ),
        pytest.param(
            Flaws(random_task_info=True),
            {"task_info_deterministic": "GET /task_info?seed=0 answered different JSON twice"},
            id="random-task-info",
        ),
        pytest.param(
            Flaws(wrong_echo=True),
            {"correlation_id_echo": "trace_correlation_id is 'someone-else', expected 'tandem-check-"},
            id="wrong-echo",
        ),
        pytest.param(
            Flaws(nan_reward=True),
            {"rollout_schema": "metrics.outcome_reward is nan, not finite"},
            id="nan-reward",
        ),
        pytest.param(
            Flaws(forget_results=True),
            {"idempotent_repeat": "the repeat answered a different result: trajectory"},
            id="plays-repeats-again",
        ),
        pytest.param(
            Flaws(ignore_max_seconds=True),
            {"timeout_behaviour": "POST /rollout did not answer within 2.5s"},
            id="hangs",
        ),
    ],
)
async def test_broken_app_fails_exactly_the_relevant_checks(flaws: Flaws, expected: dict[str, str]) -> None:
    results = await check_app(make_app(flaws))
    assert failed(results) == set(expected), format_table(list(results.values()))
    for name, detail in expected.items():
        assert detail in results[name].detail
    # a hanging app costs the deadline, not its hang
    assert results["timeout_behaviour"].duration_s < 3.5


async def test_every_schema_violation_is_listed_in_its_row_and_the_table() -> None:
    results = await check_app(make_app(Flaws(two_violations=True)))
    row = results["rollout_schema"]
    assert row.detail.startswith("POST /rollout breaks the taskapp-openapi.yaml (2 violations): ")
    assert row.violations == (  # the stub's reply is never the answer: reward 0.0
        "at aborted: 'no' is not of type 'boolean'",
        "at metrics/outcome_reward: '0.0' is not of type 'number'",
    )
    table = format_table(list(results.values()))
    assert all(f"- {v}" in table for v in row.violations)
    assert results["dialect"].passed is False  # the answer followed neither dialect


async def test_given_policy_url_skips_the_checks_that_need_the_stub() -> None:
    async with StubPolicyServer(reply="1") as policy:
        results = await check_app(make_app(), policy_url=policy.base_url + "/v1")
        assert policy.calls, "the app called the given policy"
    assert failed(results) == set()
    for name in ("correlation_id_propagated", "timeout_behaviour"):
        assert results[name].detail.startswith("skipped: --policy-url was given")


async def test_keyless_app_skips_the_auth_checks() -> None:
    results = await check_app(make_app(key=None), key="")
    assert failed(results) == set(), format_table(list(results.values()))
    skipped = {name for name, r in results.items() if r.detail.startswith("skipped: no key")}
    assert skipped == {"auth_missing_key", "auth_wrong_key", "auth_bearer"}


async def test_unreachable_app_fails_every_check_without_raising() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    results = await run_checks(f"http://127.0.0.1:{port}", KEY, timeout_s=2)
    assert all(not r.passed for r in results)
    assert "ConnectError" in results[0].detail


async def test_stub_policy_answers_and_records_calls() -> None:
    async with StubPolicyServer() as policy, httpx.AsyncClient(trust_env=False) as client:
        url = policy.inference_url("cid-1") + "/chat/completions"
        answer = await client.post(url, json={"model": "m", "messages": []})
        assert answer.json()["choices"][0]["message"]["content"] == check.STUB_REPLY
        await client.post(
            policy.base_url + "/v1/chat/completions", json={}, headers={"X-Trace-Correlation-Id": "cid-2"}
        )
        streamed = await client.post(policy.base_url + "/v1/chat/completions", json={"stream": True})
        assert streamed.text.endswith("data: [DONE]\n\n")
    assert [len(policy.calls_for(c)) for c in ("cid-1", "cid-2", "cid-3")] == [1, 1, 0]


def test_the_rollout_request_the_kit_sends_follows_the_contract() -> None:
    schemas = check._Schemas(check.DEFAULT_OPENAPI_PATH)
    assert schemas.source == "taskapp-openapi.yaml"
    body = check.rollout_request("tandem-check-abc-rollout", "http://127.0.0.1:1/traces/x/v1")
    assert check._schema_errors(schemas.validator("post", "/rollout", request=True), body) == []
    bad = {**body, "trace_correlation_id": "has spaces"}
    assert check._schema_errors(schemas.validator("post", "/rollout", request=True), bad) != []


def test_builtin_schemas_apply_without_the_openapi_document(tmp_path: Any) -> None:
    schemas = check._Schemas(tmp_path / "missing.yaml")
    assert schemas.source == "built-in schema"
    result = {
        "trace_correlation_id": "x",
        "metrics": {"outcome_reward": 1},
        "trajectory": {},
        "aborted": False,
    }
    assert check._schema_errors(schemas.validator("post", "/rollout"), result) == []
    violations = check._schema_errors(schemas.validator("post", "/rollout"), {"metrics": {}})
    assert len(violations) == 4, violations  # every one, not only the first


def test_format_table_aligns_columns() -> None:
    rows = [
        CheckResult("health", True, "", 0.0123),
        CheckResult("timeout_behaviour", False, "no answer", 2.5),
    ]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["check", "result", "time", "detail"]
    assert lines[1].startswith("health             PASS    0.01s")
    assert lines[2] == "timeout_behaviour  FAIL    2.50s  no answer"
    assert len({line.index("PASS" if "PASS" in line else "FAIL") for line in lines[1:]}) == 1


async def test_main_reads_the_key_from_stdin_and_never_prints_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("ENVIRONMENT_API_KEY", raising=False)
    monkeypatch.setattr("sys.stdin", io.StringIO(KEY + "\n"))
    async with serve(make_app(Flaws(leak_key_in_401=True))) as url:
        code = await asyncio.to_thread(check.main, [url, "--key-from-stdin", "--json", "--timeout", "10"])
    out = capsys.readouterr().out
    assert code == 1
    report = json.loads(out)
    assert report["all_passed"] is False
    assert {r["name"] for r in report["check_results"] if not r["passed"]} == {
        "auth_missing_key",
        "auth_wrong_key",
    }
    assert KEY not in out and KEY[:6] not in out


async def test_main_takes_the_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ENVIRONMENT_API_KEY", KEY)
    async with serve(make_app()) as url:
        code = await asyncio.to_thread(check.main, [url])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[0].split() == ["check", "result", "time", "detail"]
    assert out.rstrip().endswith(f"{len(CHECK_NAMES)}/{len(CHECK_NAMES)} checks passed")
    assert KEY not in out


def test_main_refuses_to_run_without_a_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("ENVIRONMENT_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        check.main(["http://127.0.0.1:1"])
    assert exit_info.value.code == 2
    assert "ENVIRONMENT_API_KEY" in capsys.readouterr().err


def test_rewards_must_be_finite_numbers() -> None:
    ok = {"metrics": {"outcome_reward": 0.5, "event_rewards": [1, -2.0]}}
    assert check._finite_rewards(ok) is None
    for bad in (math.inf, "1.0", True, None):
        assert check._finite_rewards({"metrics": {"outcome_reward": bad}}) is not None
    assert check._finite_rewards({"metrics": {"outcome_reward": 1, "event_rewards": [math.nan]}}) is not None

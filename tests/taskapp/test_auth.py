"""The auth matrix over real HTTP: missing or wrong keys answer 401 without key material; X-API-Key and
Bearer both work; /health answers without a key; keys are compared in constant time."""

from __future__ import annotations

import hmac
from typing import Any

import httpx
import pytest

from tandem_taskapp import Policy, Result, TaskApp, create_app
from tandem_taskapp.testing import serve_in_thread
from tests.taskapp.conftest import KEY, PolicyFixture, rollout_body

WRONG = "wrong-key-XYZW-987654321"


async def _rollout(seed: int, policy: Policy, config: dict[str, Any]) -> Result:
    await policy.chat([{"role": "user", "content": "hi"}])
    return Result(1.0)


APP = TaskApp(name="auth-test", rollout=_rollout, task_info=lambda seed: {"instance": {"seed": seed}})


@pytest.fixture
def base_url() -> Any:
    with serve_in_thread(create_app(APP, KEY)) as url:
        yield url


def _no_key_material(text: str) -> None:
    for secret in (KEY, WRONG):
        for n in (4, 6, 8, len(secret)):
            assert secret[:n] not in text
            assert secret[-n:] not in text


def _call(base_url: str, endpoint: str, headers: dict[str, str], policy: PolicyFixture) -> httpx.Response:
    if endpoint == "rollout":
        body = rollout_body("auth-1", policy.url("auth-1"))
        return httpx.post(f"{base_url}/rollout", json=body, headers=headers, timeout=30)
    return httpx.get(f"{base_url}/task_info", params={"seed": 3}, headers=headers, timeout=30)


@pytest.mark.parametrize("endpoint", ["task_info", "rollout"])
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"X-API-Key": WRONG},
        {"X-API-Key": ""},
        {"X-API-Key": KEY[:-1]},
        {"X-API-Key": KEY + "x"},
        {"Authorization": f"Bearer {WRONG}"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
    ],
    ids=["none", "wrong", "empty", "prefix", "longer", "bearer-wrong", "basic", "bare"],
)
def test_missing_or_wrong_key_is_401_without_key_material(
    base_url: str, policy: PolicyFixture, endpoint: str, headers: dict[str, str]
) -> None:
    r = _call(base_url, endpoint, headers, policy)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "UNAUTHENTICATED"
    assert r.json()["error"]["message"]
    _no_key_material(r.text)
    _no_key_material(str(r.headers))
    assert policy.server.requests == []  # nothing was played


@pytest.mark.parametrize("endpoint", ["task_info", "rollout"])
@pytest.mark.parametrize(
    "headers",
    [{"X-API-Key": KEY}, {"Authorization": f"Bearer {KEY}"}, {"authorization": f"bearer {KEY}"}],
    ids=["x-api-key", "bearer", "bearer-lowercase"],
)
def test_right_key_works_in_either_header(
    base_url: str, policy: PolicyFixture, endpoint: str, headers: dict[str, str]
) -> None:
    r = _call(base_url, endpoint, headers, policy)
    assert r.status_code == 200, r.text
    _no_key_material(r.text)


def test_health_answers_without_a_key_and_reveals_nothing(base_url: str) -> None:
    r = httpx.get(f"{base_url}/health")
    assert r.status_code == 200
    assert r.json() == {"healthy": True}
    _no_key_material(r.text)
    authed = httpx.get(f"{base_url}/health", headers={"X-API-Key": KEY})
    assert authed.status_code == 200
    assert authed.json()["healthy"] is True
    assert authed.json()["task"] == "auth-test"
    assert "auth" not in authed.json()
    _no_key_material(authed.text)


def test_health_refuses_a_wrong_key(base_url: str) -> None:
    r = httpx.get(f"{base_url}/health", headers={"X-API-Key": WRONG})
    assert r.status_code == 401
    _no_key_material(r.text)


def test_private_health_requires_the_key() -> None:
    with serve_in_thread(create_app(APP, KEY, public_health=False)) as url:
        assert httpx.get(f"{url}/health").status_code == 401
        assert httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_several_keys_for_rotation() -> None:
    with serve_in_thread(create_app(APP, [KEY, "next-key-abcdef"])) as url:
        for k in (KEY, "next-key-abcdef"):
            assert httpx.get(f"{url}/task_info", headers={"X-API-Key": k}).status_code == 200
        assert httpx.get(f"{url}/task_info", headers={"X-API-Key": WRONG}).status_code == 401


def test_no_auth_mode_for_local_runs() -> None:
    with serve_in_thread(create_app(APP, None)) as url:
        assert httpx.get(f"{url}/task_info").status_code == 200


def test_empty_key_is_refused_at_startup() -> None:
    with pytest.raises(ValueError, match="empty"):
        create_app(APP, "")


def test_keys_are_compared_in_constant_time(base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        ok: bool = real(a, b)
        return ok

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert httpx.get(f"{base_url}/task_info", headers={"X-API-Key": WRONG}).status_code == 401
    assert calls == [(WRONG.encode(), KEY.encode())]

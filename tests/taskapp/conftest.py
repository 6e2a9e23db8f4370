"""Fixtures for the Task App SDK tests: a fake OpenAI-compatible policy and Task Apps served over real HTTP
on loopback ports (uvicorn in background threads)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem_taskapp import TaskApp, create_app
from tandem_taskapp.testing import FakePolicyServer, serve_in_thread

KEY = "env-key-0123456789abcdef-SECRET"
REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "taskapps"


class PolicyFixture:
    def __init__(self, server: FakePolicyServer, base_url: str) -> None:
        self.server = server
        self.base_url = base_url

    def url(self, cid: str) -> str:
        return FakePolicyServer.inference_url(self.base_url, cid)


@pytest.fixture
def policy() -> Iterator[PolicyFixture]:
    server = FakePolicyServer("ok")
    with serve_in_thread(server.app) as url:
        yield PolicyFixture(server, url)


@contextlib.contextmanager
def served(task_app: TaskApp, key: str | None = KEY, **kwargs: Any) -> Iterator[httpx.Client]:
    """`task_app` served on a loopback port; yields a client with the right key set."""
    headers = {"X-API-Key": key} if key else {}
    with (
        serve_in_thread(create_app(task_app, key, **kwargs)) as url,
        httpx.Client(base_url=url, headers=headers, timeout=30) as client,
    ):
        yield client


def rollout_body(
    cid: str,
    inference_url: str,
    *,
    seed: int | str = 0,
    config: dict[str, Any] | None = None,
    mode: str | None = "rl",
    max_turns: int = 0,
    max_seconds: int = 0,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "trace_correlation_id": cid,
        "env": {"seed": seed, "config": config or {}},
        "policy": {
            "config": {
                "model": "tiny-policy",
                "inference_url": inference_url,
                "temperature": 0.7,
                "max_completion_tokens": 16,
            }
        },
        "limits": {"max_turns": max_turns, "max_seconds": max_seconds},
    }
    if mode is not None:
        body["mode"] = mode
    return body

"""The hosted dialect: the translation of its shapes to Tandem's (tandem_taskapp/hosted.py), and the
standard-library app written to the hosted contract (examples/taskapps/hosted_copy_letter.py), run as its own
process, through the conformance kit in both of its answer forms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tandem_taskapp import hosted, schema
from tandem_taskapp.check import CHECK_NAMES, format_table, run_checks
from tests.support.postgres import free_port
from tests.support.processes import ROOT

KEY = "hk_9f3e2a71c4d8b605e1f7"


@contextmanager
def hosted_app(form: str = "trajectories", key: str = KEY) -> Iterator[str]:
    """The hosted example app as its own process on a free port; yields its base URL."""
    port = free_port()
    script = ROOT / "examples" / "taskapps" / "hosted_copy_letter.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), "--port", str(port), "--form", form],
        env={**os.environ, "ENVIRONMENT_API_KEY": key},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the hosted app did not start"
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


LEGACY = {
    "run_id": "cid-1",
    "trajectories": [
        {
            "env_id": "e",
            "policy_id": "p",
            "steps": [
                {
                    "obs": {"board": [1, 2]},
                    "tool_calls": [{"tool": "move", "args": {"x": 1}}],
                    "reward": 0.25,
                },
                {"obs": "your turn", "tool_calls": [], "reward": 0.5, "done": True, "truncated": True},
            ],
            "length": 2,
        }
    ],
    "metrics": {"episode_returns": [0.75], "mean_return": 0.75, "num_steps": 2, "outcome_reward": 1.0},
}


def test_a_legacy_answer_becomes_one_turn_per_step_with_its_rewards() -> None:
    out = hosted.rollout_to_tandem(LEGACY)
    assert schema.errors("RolloutResponse", out) == []
    assert out["trace_correlation_id"] == "cid-1"  # the legacy run_id stands for the echo
    assert out["metrics"]["outcome_reward"] == 1.0
    assert out["metrics"]["event_rewards"] == [0.25, 0.5]
    assert out["metrics"]["details"]["hosted"]["mean_return"] == 0.75
    first, second = out["trajectory"]["turns"]
    assert first["messages"][0] == {"role": "user", "content": '{"board": [1, 2]}'}
    assert first["messages"][1]["role"] == "assistant" and '"move"' in first["messages"][1]["content"]
    assert second["messages"] == [{"role": "user", "content": "your turn"}]
    assert out["aborted"] is True  # a truncated step, no aborted of its own


def test_a_legacy_answer_without_outcome_reward_takes_its_legacy_reward() -> None:
    body = {**LEGACY, "metrics": {"reward_mean": 0.5}}
    assert hosted.rollout_to_tandem(body)["metrics"]["outcome_reward"] == 0.5
    body = {**LEGACY, "metrics": {}}
    assert hosted.rollout_to_tandem(body)["metrics"]["outcome_reward"] == 0.75  # the steps' rewards summed
    body = {**LEGACY, "trajectories": [], "metrics": {}}
    assert "outcome_reward" not in hosted.rollout_to_tandem(body)["metrics"]  # missing stays missing


def test_a_trace_answer_becomes_one_turn_per_lm_call() -> None:
    body = {
        "trace_correlation_id": "cid-2",
        "metrics": {"outcome_reward": 0.0, "outcome_objectives": {"reward": 0.0}},
        "trace": {
            "schema_version": "3.0",
            "event_history": [
                {
                    "type": "lm_call",
                    "llm_request": {
                        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
                    },
                    "llm_response": {"choices": [{"message": {"role": "assistant", "content": "hello"}}]},
                },
                {"type": "env_step", "reward": 1},
            ],
            "markov_blanket_message_history": [],
        },
    }
    out = hosted.rollout_to_tandem(body)
    assert schema.errors("RolloutResponse", out) == []
    assert out["trajectory"]["turns"] == [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    ]
    only_history = {**body, "trace": {"markov_blanket_message_history": [{"role": "user", "content": "x"}]}}
    assert hosted.rollout_to_tandem(only_history)["trajectory"]["turns"] == [
        {"messages": [{"role": "user", "content": "x"}]}
    ]


def test_tandem_answers_and_task_infos_are_left_as_they_are() -> None:
    answer = {"trace_correlation_id": "c", "metrics": {"outcome_reward": 1}, "trajectory": {"turns": []}}
    assert hosted.rollout_to_tandem(answer) is answer
    info = {"task": {"id": "t", "name": "T"}, "dataset": {"splits": [{"name": "train"}]}, "rubric": {}}
    assert hosted.task_info_to_tandem(info) is info


def test_a_hosted_task_info_becomes_a_tandem_one() -> None:
    body = {
        "taskset": {
            "task": {"id": "t", "name": "T"},
            "dataset": {"splits": ["train", "test"]},
            "limits": {"max_turns": 3, "timeout_seconds": 90},
        },
    }
    out = hosted.task_info_to_tandem(body)
    assert schema.errors("TaskInfo", out) == []
    assert out["dataset"]["splits"] == [{"name": "train"}, {"name": "test"}]
    assert out["rubric"] == {} and out["limits"] == {"max_turns": 3, "timeout_seconds": 90, "max_seconds": 90}
    seeded = hosted.task_info_to_tandem({**body["taskset"], "task_metadata": {"target": "B"}})
    assert seeded["instance"] == {"target": "B"}
    assert hosted.error_to_tandem({"detail": "bad key"}) == {
        "error": {"code": "UNAUTHENTICATED", "message": "bad key"}
    }


@pytest.mark.parametrize(
    ("form", "shape"),
    [("trajectories", "rollouts as trajectories[].steps[]"), ("trace", "rollouts in the trace form")],
)
async def test_the_hosted_app_passes_every_check_in_the_hosted_dialect(form: str, shape: str) -> None:
    with hosted_app(form) as url:
        results = await run_checks(url, KEY, timeout_s=10)
    assert [r.name for r in results] == list(CHECK_NAMES)
    assert all(r.passed for r in results), format_table(results)
    dialect = {r.name: r for r in results}["dialect"].detail
    assert dialect.startswith("hosted: "), dialect
    for evidence in (
        'errors as {"detail": ...}',
        "a key-less /health",
        "task_info in the hosted shape",
        shape,
    ):
        assert evidence in dialect


async def test_the_hosted_app_with_a_wrong_key_fails_the_auth_checks() -> None:
    with hosted_app(key="another-key-entirely-0000") as url:
        results = {r.name: r for r in await run_checks(url, KEY, timeout_s=10)}
    assert not results["auth_bearer"].passed and not results["rollout_schema"].passed
    assert not results["dialect"].passed  # no rollout answer was read, so the dialect is unknown


def test_the_cli_prints_the_dialect_in_json() -> None:
    with hosted_app() as url:
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "taskapp", "check", url, "--json", "--key-from-stdin"],
            cwd=ROOT,
            input=KEY,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(done.stdout)
    assert document["all_passed"] is True and document["dialect"] == "hosted"
    assert all(row["violations"] == [] for row in document["check_results"])

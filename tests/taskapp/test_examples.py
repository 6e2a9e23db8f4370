"""The example Task Apps end to end over real HTTP against the fake policy."""

from __future__ import annotations

import re
import sys
from collections import Counter
from types import ModuleType
from typing import Any

import pytest

from tandem_taskapp import TaskApp
from tandem_taskapp import schema as contract
from tandem_taskapp.serve import load_task_app
from tests.taskapp.conftest import EXAMPLES, PolicyFixture, rollout_body, served


@pytest.fixture(scope="module")
def single_turn() -> TaskApp:
    return load_task_app(str(EXAMPLES / "single_turn.py"))


@pytest.fixture(scope="module")
def guessing_game() -> TaskApp:
    return load_task_app(str(EXAMPLES / "guessing_game.py"))


@pytest.fixture(scope="module")
def math_word() -> TaskApp:
    return load_task_app(str(EXAMPLES / "math_word.py"))


def _play(app: TaskApp, policy: PolicyFixture, cid: str, **kwargs: Any) -> dict[str, Any]:
    with served(app) as client:
        r = client.post("/rollout", json=rollout_body(cid, policy.url(cid), **kwargs))
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert contract.errors("RolloutResponse", body) == []
    assert body["trace_correlation_id"] == cid
    for call in policy.server.requests_for(cid):
        assert cid in call.path
    return body


def _info(app: TaskApp, seed: int | None = None) -> dict[str, Any]:
    with served(app) as client:
        r = client.get("/task_info", params={} if seed is None else {"seed": seed})
    assert r.status_code == 200
    assert contract.errors("TaskInfo", r.json()) == []
    info: dict[str, Any] = r.json()
    return info


# -- single turn -------------------------------------------------------------------------------------------


def test_single_turn_rewards_the_shown_letter(single_turn: TaskApp, policy: PolicyFixture) -> None:
    target = _info(single_turn, seed=11)["instance"]["target"]
    policy.server.replies = f" {target.lower()} is my answer"
    right = _play(single_turn, policy, "st-right", seed=11)
    assert right["metrics"]["outcome_reward"] == 1.0
    assert right["aborted"] is False
    [turn] = right["trajectory"]["turns"]
    assert turn["messages"][0] == {"role": "user", "content": f"Copy this letter: {target}"}
    wrong = "B" if target != "B" else "C"
    policy.server.replies = wrong
    assert _play(single_turn, policy, "st-wrong", seed=11)["metrics"]["outcome_reward"] == 0.0
    policy.server.replies = ""
    assert _play(single_turn, policy, "st-empty", seed=11)["metrics"]["outcome_reward"] == 0.0


def test_single_turn_documents_chance_level_and_spreads_targets(single_turn: TaskApp) -> None:
    info = _info(single_turn)
    assert info["rubric"]["outcome"]["chance_level"] == 0.25
    assert info["limits"]["max_turns"] == 1
    counts = Counter(_target(single_turn, seed) for seed in range(400))
    assert set(counts) == set("ABCD")
    assert min(counts.values()) > 60  # close to uniform: a constant answer stays near chance


def _target(app: TaskApp, seed: int) -> str:
    info = app.task_info(seed)
    assert isinstance(info, dict)
    target: str = info["instance"]["target"]
    return target


def test_single_turn_vocab_size_and_a_bad_config(single_turn: TaskApp, policy: PolicyFixture) -> None:
    body = _play(single_turn, policy, "st-v", config={"vocab_size": 26})
    assert body["metrics"]["details"]["vocab_size"] == 26
    with served(single_turn) as client:
        r = client.post(
            "/rollout", json=rollout_body("st-bad", policy.url("st-bad"), config={"vocab_size": 99})
        )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "INVALID_ARGUMENT"


# -- guessing game -----------------------------------------------------------------------------------------


def binary_search(messages: list[dict[str, Any]], body: dict[str, Any]) -> str:
    lo, hi = 1, int(re.findall(r"from 1 to (\d+)", messages[0]["content"])[0])
    guess = (lo + hi) // 2
    for m in messages[2:]:
        if m["role"] == "assistant":
            guess = int(m["content"])
        elif m["content"] == "Higher.":
            lo = guess + 1
        elif m["content"] == "Lower.":
            hi = guess - 1
    return str((lo + hi) // 2)


def test_guessing_game_multi_turn_with_hints(guessing_game: TaskApp, policy: PolicyFixture) -> None:
    policy.server.replies = binary_search
    secret = _info(guessing_game, seed=5)["instance"]["secret"]
    body = _play(guessing_game, policy, "gg-1", seed=5)
    details = body["metrics"]["details"]
    assert details["solved"] is True
    assert details["secret"] == secret
    assert details["guesses"][-1] == secret
    turns = details["turns"]
    assert 1 <= turns <= 4  # binary search over 1..16
    assert body["metrics"]["outcome_reward"] == pytest.approx((8 - turns + 1) / 8)
    assert body["metrics"]["event_rewards"] == [1.0] * turns
    assert len(body["trajectory"]["turns"]) == turns
    calls = policy.server.requests_for("gg-1")
    assert len(calls) == turns
    for i, call in enumerate(calls[1:], start=1):  # every later turn sees the previous hint
        assert call.messages[-1]["content"] in {"Higher.", "Lower."}
        assert len(call.messages) == 2 + 2 * i


def test_guessing_game_finds_many_secrets(guessing_game: TaskApp, policy: PolicyFixture) -> None:
    policy.server.replies = binary_search
    with served(guessing_game) as client:
        for seed in range(12):
            cid = f"gg-many-{seed}"
            r = client.post("/rollout", json=rollout_body(cid, policy.url(cid), seed=seed, config={"n": 100}))
            assert r.json()["metrics"]["details"]["solved"] is True
            assert r.json()["metrics"]["details"]["turns"] <= 7


def test_guessing_game_runs_out_of_turns(guessing_game: TaskApp, policy: PolicyFixture) -> None:
    secret = _info(guessing_game, seed=2)["instance"]["secret"]
    policy.server.replies = "I guess 17"  # outside 1..16: never right
    body = _play(guessing_game, policy, "gg-2", seed=2)
    assert secret != 17
    assert body["metrics"]["outcome_reward"] == 0.0
    assert body["metrics"]["details"]["turns"] == 8
    assert body["aborted"] is False
    assert body["metrics"]["event_rewards"] == [0.0] * 8
    # A request's own max_turns wins over the app default.
    short = _play(guessing_game, policy, "gg-3", seed=2, max_turns=1)
    assert short["metrics"]["details"]["turns"] == 1
    assert short["aborted"] is False


def test_guessing_game_hint_for_a_non_number(guessing_game: TaskApp, policy: PolicyFixture) -> None:
    policy.server.replies = "no idea"
    _play(guessing_game, policy, "gg-4", seed=1, max_turns=2)
    second = policy.server.requests_for("gg-4")[1]
    assert second.messages[-1]["content"] == "Reply with just a number from 1 to 16."


# -- math word problems ------------------------------------------------------------------------------------


def _math_module() -> ModuleType:
    load_task_app(str(EXAMPLES / "math_word.py"))
    return sys.modules["tandem_taskapp_user_math_word"]


def _answers() -> dict[str, int]:
    mod = _math_module()
    return {q: a for q, a in mod.PROBLEMS}


def test_math_word_exact_answer(math_word: TaskApp, policy: PolicyFixture) -> None:
    answers = _answers()
    assert len(answers) == 50
    policy.server.replies = lambda messages, body: (
        f"Let me think. 2 + 2 = 4. So it is {answers[messages[-1]['content']]}."
    )
    right = _play(math_word, policy, "mw-1", seed=3)
    assert right["metrics"]["outcome_reward"] == 1.0
    assert right["metrics"]["details"]["split"] == "train"
    policy.server.replies = lambda messages, body: f"{answers[messages[-1]['content']] + 1}"
    wrong = _play(math_word, policy, "mw-2", seed=3)
    assert wrong["metrics"]["outcome_reward"] == 0.0
    assert wrong["metrics"]["details"]["parsed"] == wrong["metrics"]["details"]["expected"] + 1


def test_math_word_splits(math_word: TaskApp, policy: PolicyFixture) -> None:
    info = _info(math_word, seed=0)
    assert {s["name"]: s["size"] for s in info["dataset"]["splits"]} == {"train": 40, "test": 10}
    answers = _answers()
    policy.server.replies = lambda messages, body: str(answers[messages[-1]["content"]])
    ev = _play(math_word, policy, "mw-3", seed=0, mode="eval")
    assert ev["metrics"]["details"]["split"] == "test"
    assert ev["metrics"]["details"]["problem_id"] % 5 == 4
    assert ev["metrics"]["outcome_reward"] == 1.0
    forced = _play(math_word, policy, "mw-4", seed=0, mode="eval", config={"split": "train"})
    assert forced["metrics"]["details"]["split"] == "train"
    assert (
        info["instance"]["test"]["question"] == policy.server.requests_for("mw-3")[0].messages[-1]["content"]
    )
    ids = {
        _play(math_word, policy, f"mw-s{s}", seed=s, mode="eval")["metrics"]["details"]["problem_id"]
        for s in range(10)
    }
    assert len(ids) == 10


def test_math_word_parses_the_last_integer() -> None:
    mod = _math_module()
    assert mod.last_integer("3 boxes of 4 make 12") == 12
    assert mod.last_integer("It is 1,200 grams.") == 1200
    assert mod.last_integer("The answer is -5.") == -5
    assert mod.last_integer("no number") is None

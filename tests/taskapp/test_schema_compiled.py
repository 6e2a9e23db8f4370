"""The compiled schema check (`schema.conforms`) never accepts what jsonschema rejects, and accepts the
answers apps send, so the proxy validates them without jsonschema."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from tandem_taskapp import schema

ANSWER: dict[str, Any] = {
    "trace_correlation_id": "ep-1.a:b_c-2",
    "metrics": {"outcome_reward": 1.0, "event_rewards": [0.5, 1], "details": {"k": [1, {"x": None}]}},
    "trajectory": {
        "turns": [
            {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
            {"messages": [], "extra": True},
        ]
    },
    "aborted": False,
    "unknown": {"kept": 1},
}
ODD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    1.0,
    -2.5,
    "",
    "x",
    "ep 1",
    "ep-1\n",
    "é" * 3,
    [],
    [1],
    {},
    {"a": 1},
]


def _paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*at, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += _paths(value, (*at, index))
    return out


def _mutations(base: Any, rng: random.Random, count: int) -> list[Any]:
    out = []
    for _ in range(count):
        doc = copy.deepcopy(base)
        for _ in range(rng.randint(1, 3)):
            path = rng.choice(_paths(doc)[1:])
            parent = doc
            for step in path[:-1]:
                parent = parent[step]
            action = rng.random()
            if action < 0.3 and isinstance(parent, dict):
                del parent[path[-1]]
            elif action < 0.4 and isinstance(parent[path[-1]], list):
                parent[path[-1]] = parent[path[-1]] * 6000  # past maxItems where there is one
            else:
                parent[path[-1]] = copy.deepcopy(rng.choice(ODD_VALUES))
        out.append(doc)
    return out


def test_the_answer_schema_compiles_and_accepts_a_valid_answer() -> None:
    assert schema.validator("RolloutResponse").is_valid(ANSWER)
    assert schema.conforms("RolloutResponse", ANSWER)
    assert schema.errors("RolloutResponse", ANSWER) == []


@pytest.mark.parametrize("name", schema.SCHEMA_NAMES)
def test_conforms_never_accepts_what_jsonschema_rejects(name: str) -> None:
    validator = schema.validator(name)
    rng = random.Random(name)  # noqa: S311 - reproducible test data, not secrets
    agreed = 0
    for doc in [ANSWER, *_mutations(ANSWER, rng, 400), *ODD_VALUES]:
        valid = validator.is_valid(doc)
        if schema.conforms(name, doc):
            assert valid, doc
        agreed += schema.conforms(name, doc) == valid
        if not valid and len(str(doc)) < 2000:
            assert schema.errors(name, doc), doc  # a rejected answer still gets jsonschema's violations
    if name == "RolloutResponse":
        assert agreed > 370  # it decides nearly every answer by itself, not only the easy ones

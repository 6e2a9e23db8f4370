"""Multi-turn number guessing: the app thinks of a number from 1 to N (picked by the seed) and the policy
guesses; after each wrong guess the app answers "Higher." or "Lower.", and the policy guesses again until it
finds the number or runs out of turns.

Reward: (B - t + 1) / B when the number is found on turn t of a budget of B turns (1.0 on the first turn),
else 0. Event rewards, one per turn: 1.0 when the guess was consistent with the hints so far, else 0.0.
Binary search needs ceil(log2 N) turns.

    python -m tandem_taskapp.serve examples/taskapps/guessing_game.py --port 8002

`env.config`: `n` (2 to 1000000, default 16)."""

from __future__ import annotations

import re
from typing import Any

from tandem_taskapp import InvalidArgument, Policy, Result, TaskApp

DEFAULT_N = 16
MAX_TURNS = 8
_INT = re.compile(r"-?\d+")


def splitmix64(seed: int) -> int:
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def range_size(config: dict[str, Any]) -> int:
    n = config.get("n", DEFAULT_N)
    if not isinstance(n, int) or isinstance(n, bool) or not 2 <= n <= 1_000_000:
        raise InvalidArgument("env.config.n must be an integer from 2 to 1000000")
    return n


def secret_for(seed: int, n: int) -> int:
    return 1 + splitmix64(seed) % n


def parse_guess(reply: str) -> int | None:
    m = _INT.search(reply)
    return int(m.group()) if m else None


def rules(n: int) -> str:
    return (
        f"I am thinking of a whole number from 1 to {n}. Guess it. Reply with just the number; "
        'after each wrong guess I answer "Higher." or "Lower."'
    )


def task_info(seed: int) -> dict[str, Any]:
    n = DEFAULT_N
    return {"instance": {"n": n, "secret": secret_for(seed, n), "rules": rules(n)}}


async def rollout(seed: int, policy: Policy, config: dict[str, Any]) -> Result:
    n = range_size(config)
    secret = secret_for(seed, n)
    budget = policy.turns_left if policy.turns_left is not None else MAX_TURNS
    messages: list[dict[str, str]] = [
        {"role": "system", "content": rules(n)},
        {"role": "user", "content": "Your guess?"},
    ]
    lo, hi = 1, n
    guesses: list[int | None] = []
    events: list[float] = []
    solved_on: int | None = None
    for turn in range(1, budget + 1):
        reply = await policy.chat(messages)
        guess = parse_guess(reply)
        guesses.append(guess)
        events.append(1.0 if guess is not None and lo <= guess <= hi else 0.0)
        if guess == secret:
            solved_on = turn
            break
        if guess is None:
            hint = f"Reply with just a number from 1 to {n}."
        elif guess < secret:
            hint, lo = "Higher.", max(lo, guess + 1)
        else:
            hint, hi = "Lower.", min(hi, guess - 1)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": hint}]
    reward = 0.0 if solved_on is None else (budget - solved_on + 1) / budget
    return Result(
        outcome_reward=reward,
        event_rewards=events,
        details={
            "n": n,
            "secret": secret,
            "guesses": guesses,
            "solved": solved_on is not None,
            "turns": len(guesses),
        },
    )


app = TaskApp(
    name="guessing-game",
    description=__doc__ or "",
    task_info=task_info,
    rollout=rollout,
    splits=[{"name": "train", "description": "every seed; the number is 1 + splitmix64(seed) % n"}],
    rubric={
        "outcome": {
            "description": "(B - t + 1) / B when found on turn t of B turns, else 0",
            "min": 0.0,
            "max": 1.0,
        },
        "events": {"description": "per turn: 1 when the guess is consistent with the hints so far"},
    },
    max_turns=MAX_TURNS,
    max_seconds=120,
)

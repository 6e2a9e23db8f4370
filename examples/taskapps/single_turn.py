"""Single-turn "copy the letter" task: the prompt shows one letter from a small vocabulary and the reply
earns 1 when its first non-space character is that letter (case-insensitive), else 0.

A tiny policy trained from random init can learn it on CPU in minutes: the target is in the prompt, so
the policy only has to learn to copy it. A policy that answers uniformly among the vocabulary's letters
scores the chance level 1/|vocab| (0.25 with the default 4 letters); one that answers outside the
vocabulary scores less.

    python -m tandem_taskapp.serve examples/taskapps/single_turn.py --port 8001

`env.config`: `vocab_size` (2 to 26, default 4): how many letters, starting at A."""

from __future__ import annotations

import string
from typing import Any

from tandem_taskapp import InvalidArgument, Policy, Result, TaskApp

DEFAULT_VOCAB_SIZE = 4


def splitmix64(seed: int) -> int:
    """A well-mixed 64-bit hash of the seed, so neighbouring seeds pick unrelated targets."""
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def vocabulary(config: dict[str, Any]) -> str:
    size = config.get("vocab_size", DEFAULT_VOCAB_SIZE)
    if not isinstance(size, int) or isinstance(size, bool) or not 2 <= size <= 26:
        raise InvalidArgument("env.config.vocab_size must be an integer from 2 to 26")
    return string.ascii_uppercase[:size]


def target_for(seed: int, vocab: str) -> str:
    return vocab[splitmix64(seed) % len(vocab)]


def prompt_for(target: str) -> str:
    return f"Copy this letter: {target}"


def reward_for(reply: str, target: str) -> float:
    stripped = reply.strip()
    return 1.0 if stripped[:1].upper() == target else 0.0


def task_info(seed: int) -> dict[str, Any]:
    vocab = vocabulary({})
    target = target_for(seed, vocab)
    return {"instance": {"target": target, "prompt": prompt_for(target), "vocab": vocab}}


async def rollout(seed: int, policy: Policy, config: dict[str, Any]) -> Result:
    vocab = vocabulary(config)
    target = target_for(seed, vocab)
    reply = await policy.chat([{"role": "user", "content": prompt_for(target)}])
    reward = reward_for(reply, target)
    return Result(
        outcome_reward=reward,
        details={"target": target, "reply_first_char": reply.strip()[:1], "vocab_size": len(vocab)},
    )


app = TaskApp(
    name="copy-letter",
    description=__doc__ or "",
    task_info=task_info,
    rollout=rollout,
    splits=[
        {"name": "train", "description": "every seed; the target letter is splitmix64(seed) % vocab_size"}
    ],
    rubric={
        "outcome": {
            "description": "1 if the reply's first non-space character is the shown letter (any case), else 0",
            "min": 0.0,
            "max": 1.0,
            "chance_level": 1.0 / DEFAULT_VOCAB_SIZE,
            "chance_level_note": "a policy answering uniformly among the vocab letters; 1/vocab_size in general",
        }
    },
    max_turns=1,
    max_seconds=60,
)

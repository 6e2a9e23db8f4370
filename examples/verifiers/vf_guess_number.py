"""A multi-turn verifiers environment, written on verifiers' public API (`verifiers.v1`): guess a number
from 1 to 16; after each wrong guess the environment answers "Higher." or "Lower." and the model guesses
again, for at most 4 guesses.

Reward: 1 when the last guess is the number, else 0; the metric `guesses` counts the model's replies. The
harness plays the game in-process against the rollout's interception endpoint, resending the whole
conversation each turn, so the trace holds one branch: prompt, guess, hint, guess, ...

    tandem taskapp serve --verifiers examples/verifiers/vf_guess_number.py --port 8002 --key-from-stdin"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import verifiers.v1 as vf

HIGHEST = 16
MAX_GUESSES = 4
_INT = re.compile(r"-?\d+")


class GuessData(vf.TaskData):
    """One game: the number to find."""

    secret: int = 1


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def found(self, task: GuessData, trace: vf.Trace) -> float:
        return 1.0 if guess_of(trace.last_reply) == task.secret else 0.0

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self) -> Iterator[GuessTask]:
        for secret in range(1, HIGHEST + 1):
            prompt = f"I am thinking of a number from 1 to {HIGHEST}. Guess it: answer with a number."
            yield GuessTask(GuessData(name=f"guess-{secret}", prompt=prompt, secret=secret))


def guess_of(reply: str) -> int | None:
    found = _INT.search(reply)
    return int(found.group()) if found else None


def hint(guess: int | None, secret: int) -> str | None:
    """The environment's answer to a guess; None when it is right."""
    if guess == secret:
        return None
    if guess is None:
        return "That is not a number. Guess again."
    return "Higher." if guess < secret else "Lower."


class GuessingHarness(vf.Harness[vf.HarnessConfig]):
    """The game loop, in-process: ask, read the guess, answer with a hint, until found or out of guesses."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        **_: Any,
    ) -> vf.ProgramResult:
        assert isinstance(data, GuessData)
        _, prompt = self.resolve_text_prompt(data)
        messages: list[dict[str, str]] = [{"role": "user", "content": prompt or ""}]
        async with httpx.AsyncClient(timeout=120) as client:
            for _turn in range(MAX_GUESSES):
                r = await client.post(
                    endpoint.rstrip("/") + "/chat/completions",
                    json={"model": ctx.model, "messages": messages},
                    headers={"Authorization": f"Bearer {secret}"},
                )
                if r.status_code != 200:
                    return vf.ProgramResult(1, "", r.text)
                reply = r.json()["choices"][0]["message"].get("content") or ""
                answer = hint(guess_of(reply), data.secret)
                if answer is None:
                    break
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": answer}]
        return vf.ProgramResult(0, "", "")


__all__ = ["GuessTaskset", "GuessingHarness"]

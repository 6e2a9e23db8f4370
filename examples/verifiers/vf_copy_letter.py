"""A single-turn verifiers environment, written on verifiers' public API (`verifiers.v1`): the prompt shows
one letter of A-D and the reply earns 1 when its first character is that letter.

The taskset holds 16 tasks (the letters repeated); its harness plays each task in-process: one chat call to
the rollout's interception endpoint, which verifiers relays to the model and records in the trace. Serve it
on Tandem as a Task App (seed N plays task N mod 16):

    tandem taskapp serve --verifiers examples/verifiers/vf_copy_letter.py --port 8001 --key-from-stdin"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import verifiers.v1 as vf

LETTERS = "ABCD"
TASKS = 16


class LetterData(vf.TaskData):
    """One task: the letter to copy."""

    target: str = "A"


class LetterTask(vf.Task[LetterData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def copied(self, task: LetterData, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply[:1].upper() == task.target else 0.0


class LetterTaskset(vf.Taskset[LetterTask, vf.TasksetConfig]):
    def load(self) -> Iterator[LetterTask]:
        for i in range(TASKS):
            letter = LETTERS[i % len(LETTERS)]
            yield LetterTask(
                LetterData(name=f"copy-{letter}-{i}", prompt=f"Copy this letter: {letter}", target=letter)
            )


class OneCallHarness(vf.Harness[vf.HarnessConfig]):
    """One model call with the task's prompt, in-process (no program to install)."""

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
        _, prompt = self.resolve_text_prompt(data)
        async with httpx.AsyncClient(timeout=120) as client:
            r = await client.post(
                endpoint.rstrip("/") + "/chat/completions",
                json={"model": ctx.model, "messages": [{"role": "user", "content": prompt}]},
                headers={"Authorization": f"Bearer {secret}"},
            )
        return vf.ProgramResult(0 if r.status_code == 200 else 1, "", "" if r.status_code == 200 else r.text)


__all__ = ["LetterTaskset", "OneCallHarness"]

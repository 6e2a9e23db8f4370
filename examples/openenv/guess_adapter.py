"""The adapter that plays the OpenEnv guess-the-number env (guess_env.py) on Tandem: its observation's
message is the next user message, and the first whole number in the policy's reply is the guess (0, which
is never right, when the reply has none). It imports no openenv: Tandem speaks the env's wire protocol.

    tandem taskapp serve --openenv http://127.0.0.1:8010 --openenv-adapter examples/openenv/guess_adapter.py"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tandem_taskapp.openenv_env import OpenEnvAdapter


def prompt(observation: Mapping[str, Any]) -> str:
    """The observation as the next user message: the env's message (the rules first, then its hints)."""
    return str(observation["message"])


def action(text: str, observation: Mapping[str, Any]) -> dict[str, Any]:
    """The policy's reply as the env's GuessAction."""
    number = re.search(r"-?\d+", text)
    return {"guess": int(number.group()) if number else 0}


adapter = OpenEnvAdapter(prompt=prompt, action=action)

"""An OpenEnv environment written on openenv-core's server API: guess a number from 1 to 16 in at most four
guesses. The seed of `reset` picks the number (`seed mod 16 + 1`); each step takes `{"guess": N}` and
answers "Higher.", "Lower." or "Correct!" with reward 1.0 on the right guess.

It runs in the venv that has openenv-core (`make setup-openenv` makes `.venv-openenv`), as any OpenEnv
server does:

    .venv-openenv/bin/python examples/openenv/guess_env.py --port 8010 [--max-sessions 64]

and Tandem plays it with the adapter in guess_adapter.py:

    tandem taskapp serve --openenv http://127.0.0.1:8010 --openenv-adapter examples/openenv/guess_adapter.py"""

from __future__ import annotations

import argparse
from typing import Any
from uuid import uuid4

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

HIGHEST = 16
MAX_GUESSES = 4


class GuessAction(Action):
    """One guess."""

    guess: int = Field(..., description="The number guessed, 1 to 16")


class GuessObservation(Observation):
    """What the player sees: the game's message and how many guesses are left."""

    message: str = Field(default="", description="The rules after reset, then Higher./Lower./Correct!")
    guesses_left: int = Field(default=MAX_GUESSES, description="Guesses left in this game")


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    """Guess the number: the seed picks it, four guesses, reward 1.0 for finding it."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._secret = 1

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._secret = (seed or 0) % HIGHEST + 1
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(
            message=f"I picked a number from 1 to {HIGHEST}. Guess it in at most {MAX_GUESSES} tries;"
            " reply with the number only.",
            guesses_left=MAX_GUESSES,
            done=False,
            reward=0.0,
        )

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        left = MAX_GUESSES - self._state.step_count
        if action.guess == self._secret:
            return GuessObservation(message="Correct!", guesses_left=left, done=True, reward=1.0)
        message = "Higher." if action.guess < self._secret else "Lower."
        return GuessObservation(message=message, guesses_left=left, done=left <= 0, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def make_app(max_sessions: int = 64) -> Any:
    """The env server: one environment instance per WebSocket session, at most `max_sessions` at once."""
    return create_app(
        GuessEnvironment,
        GuessAction,
        GuessObservation,
        env_name="guess_number",
        max_concurrent_envs=max_sessions,
    )


app = make_app()

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument(
        "--max-sessions", type=int, default=64, help="concurrent WebSocket sessions (default 64)"
    )
    args = parser.parse_args()
    uvicorn.run(make_app(args.max_sessions), host=args.host, port=args.port, log_level="warning")

"""A Task App written to the hosted online-RL product's contract, on the Python standard library alone.

It is what a researcher arriving with such an app already has: no Tandem SDK, its own HTTP server, and the
hosted contract's shapes, which Tandem accepts as a dialect of its own (docs/taskapp-openapi.yaml, "the
hosted dialect"; the proxy normalises its answers). The task is the "copy the letter" task of
single_turn.py: the prompt shows one of the letters A-D and the reply earns 1 when its first non-space
character is that letter.

    ENVIRONMENT_API_KEY=... python examples/taskapps/hosted_copy_letter.py --port 8001 [--form trace]

Routes, in the hosted shapes:

- `GET /health` takes no key: `{"healthy": true, "service": ...}`.
- `GET /task_info` (key): without a seed `{"taskset": {...}}`; with `?seed=N` one task description (string
  `dataset.splits`, `limits.timeout_seconds`, the seed's data in `task_metadata`, no rubric); with several
  `seed`s, a list of them.
- `POST /rollout` (key): reads `trace_correlation_id` (or `run_id`), `env.seed`, `policy.config.{model,
  inference_url, temperature, max_completion_tokens, seed}` and `safety.max_time_s`, calls
  `{inference_url}/chat/completions`, and answers `trajectories[].steps[]` with `metrics.outcome_reward`
  (or, with `--form trace`, the newer trace form: `trace.event_history[]` of `lm_call` events). A repeat of
  an id answers the recorded result.
- Errors are `{"detail": ...}`: 401 for a missing or wrong key (`X-API-Key`, `X-API-Keys` or
  `Authorization: Bearer`), 400 for a bad body or seed, 502 when the policy fails.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import os
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

VOCAB = "ABCD"
MAX_BODY = 1 << 20
DEFAULT_TIME_S = 60.0


def splitmix64(seed: int) -> int:
    """A well-mixed 64-bit hash of the seed, so neighbouring seeds pick unrelated letters."""
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def target_for(seed: int) -> str:
    return VOCAB[splitmix64(seed) % len(VOCAB)]


def prompt_for(seed: int) -> str:
    return f"Copy this letter: {target_for(seed)}"


TASKSET = {
    "task": {"id": "hosted-copy-letter", "name": "Copy the letter", "version": "1.0.0"},
    "environment": "copy-letter",
    "dataset": {
        "id": "letters",
        "name": "Letters A-D",
        "version": "1.0.0",
        "splits": ["train"],
        "default_split": "train",
        "description": "every seed; the letter is splitmix64(seed) % 4",
    },
    "inference": {"model": "", "inference_url": ""},
    "limits": {"max_turns": 1, "max_response_tokens": 8, "timeout_seconds": 60},
}


def task_info(seed: int) -> dict[str, Any]:
    return {
        **TASKSET,
        "task_metadata": {"seed": seed, "target": target_for(seed), "prompt": prompt_for(seed)},
    }


class HttpError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def chat(config: dict[str, Any], messages: list[dict[str, str]], cid: str, timeout_s: float) -> str:
    """One chat completion from the episode's policy; raises TimeoutError past `timeout_s`."""
    url = str(config.get("inference_url") or config.get("base_url") or "").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise HttpError(400, "policy.config.inference_url must be an http(s) URL")
    body: dict[str, Any] = {"model": config.get("model", ""), "messages": messages}
    if "temperature" in config:
        body["temperature"] = config["temperature"]
    if isinstance(config.get("seed"), int):  # one call per episode: the episode's seed as it is
        body["seed"] = config["seed"]
    tokens = config.get("max_completion_tokens", config.get("max_tokens"))
    if isinstance(tokens, int) and tokens > 0:
        body["max_tokens"] = tokens
    request = urllib.request.Request(  # noqa: S310 - the scheme is checked above
        url + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Trace-Correlation-Id": cid},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:  # noqa: S310 - an http(s) URL
            reply = json.loads(answer.read())
    except TimeoutError:
        raise TimeoutError from None
    except urllib.error.URLError as error:
        if isinstance(error.reason, TimeoutError):
            raise TimeoutError from None
        raise HttpError(502, f"the policy failed: {error.reason}") from None
    except ValueError:
        raise HttpError(502, "the policy answered something that is not JSON") from None
    content = reply["choices"][0]["message"].get("content")
    return content if isinstance(content, str) else ""


def play(spec: dict[str, Any], form: str) -> dict[str, Any]:
    cid = spec.get("trace_correlation_id") or spec.get("run_id")
    env, policy = spec.get("env") or {}, spec.get("policy") or {}
    if not isinstance(cid, str) or not isinstance(env, dict) or not isinstance(policy, dict):
        raise HttpError(400, "trace_correlation_id, env and policy are required")
    try:
        seed = int(env.get("seed", 0))
    except (TypeError, ValueError):
        raise HttpError(400, "env.seed must be an integer") from None
    config = policy.get("config") or {}
    safety = spec.get("safety") or {}
    timeout_s = float(safety.get("max_time_s") or DEFAULT_TIME_S)
    messages = [{"role": "user", "content": prompt_for(seed)}]
    aborted, reply = False, ""
    try:
        reply = chat(config, messages, cid, timeout_s)
    except TimeoutError:
        aborted = True
    reward = 1.0 if reply.strip()[:1].upper() == target_for(seed) else 0.0
    metrics = {
        "episode_returns": [reward],
        "mean_return": reward,
        "num_steps": 1,
        "num_episodes": 1,
        "outcome_reward": reward,
        "details": {"target": target_for(seed)},
    }
    if form == "trace":
        reply_message = {"role": "assistant", "content": reply}
        event = {
            "type": "lm_call",
            "llm_request": {"messages": messages},
            "llm_response": {"message": reply_message},
        }
        trace = {
            "schema_version": "3.0",
            "event_history": [] if aborted else [event],
            "markov_blanket_message_history": [*messages, *([] if aborted else [reply_message])],
            "metadata": {"seed": seed},
        }
        return {"trace_correlation_id": cid, "metrics": metrics, "trace": trace, "aborted": aborted}
    step = {
        "obs": {"prompt": messages[0]["content"]},
        "tool_calls": [] if aborted else [{"tool": "answer", "args": {"text": reply}}],
        "reward": reward,
        "done": True,
        "truncated": aborted,
        "info": {"target": target_for(seed)},
    }
    trajectory = {"env_id": "copy-letter", "policy_id": "policy", "steps": [step], "length": 1}
    return {
        "run_id": cid,
        "trace_correlation_id": cid,
        "trajectories": [trajectory],
        "metrics": metrics,
        "aborted": aborted,
        "ops_executed": 1,
    }


class Handler(BaseHTTPRequestHandler):
    server: App

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: a rollout a second is no news

    def answer(self, status: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the caller gave up waiting
            self.wfile.write(raw)

    def authorized(self) -> bool:
        key = self.server.key.encode()
        given = [self.headers.get("X-API-Key", "")]
        given += self.headers.get("X-API-Keys", "").split(",")
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            given.append(auth[len("Bearer ") :])
        return any(g.strip() and hmac.compare_digest(g.strip().encode(), key) for g in given)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/health":
            self.answer(200, {"healthy": True, "service": "hosted-copy-letter"})
        elif url.path == "/task_info":
            if not self.authorized():
                self.answer(401, {"detail": "missing or invalid API key"})
                return
            raw = parse_qs(url.query).get("seed", []) + parse_qs(url.query).get("seeds", [])
            try:
                seeds = [int(s) for s in raw]
            except ValueError:
                self.answer(400, {"detail": "seed must be an integer"})
                return
            if not seeds:
                self.answer(200, {"taskset": TASKSET})
            else:
                infos = [task_info(s) for s in seeds]
                self.answer(200, infos[0] if len(infos) == 1 else infos)
        else:
            self.answer(404, {"detail": "not found"})

    def do_POST(self) -> None:
        if urlsplit(self.path).path != "/rollout":
            self.answer(404, {"detail": "not found"})
            return
        if not self.authorized():
            self.answer(401, {"detail": "missing or invalid API key"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.answer(413, {"detail": "the body is too large"})
            return
        try:
            spec = json.loads(self.rfile.read(length))
            if not isinstance(spec, dict):
                raise ValueError
        except ValueError:
            self.answer(400, {"detail": "the body must be a JSON object"})
            return
        cid = spec.get("trace_correlation_id") or spec.get("run_id")
        with self.server.lock:
            recorded = self.server.results.get(cid) if isinstance(cid, str) else None
        if recorded is not None:
            self.answer(200, recorded)
            return
        try:
            result = play(spec, self.server.form)
        except HttpError as error:
            self.answer(error.status, {"detail": error.detail})
            return
        with self.server.lock:
            self.server.results[result["trace_correlation_id"]] = result
        self.answer(200, result)


class App(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, key: str, form: str) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.key, self.form = key, form
        self.results: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--form", choices=["trajectories", "trace"], default="trajectories")
    args = parser.parse_args()
    key = os.environ.get("ENVIRONMENT_API_KEY", "")
    if not key:
        parser.error("set ENVIRONMENT_API_KEY")
    with App(args.port, key, args.form) as app:
        app.serve_forever()


if __name__ == "__main__":
    main()

"""OpenEnv environments as Task Apps (tandem_taskapp/openenv_env.py): the example env written on openenv-core's
server API (examples/openenv/guess_env.py) runs as a real OpenEnv env server in .venv-openenv, and Tandem's
adapter plays it from .venv over its wire protocol (one /ws session per episode) with the example adapter
(examples/openenv/guess_adapter.py), against the fake policy server, through the conformance kit
(`tandem taskapp check`), `tandem taskapp serve --openenv`, and the real taskapp-proxy. Without .venv-openenv
those skip; the command line's refusals run without it."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from tandem.taskapp.v1 import rollout_pb2, task_app_pb2, taskapp_service_pb2_grpc
from tandem.taskapp.v1 import taskapp_service_pb2 as pb
from tandem.vault.v1 import vault_service_pb2, vault_service_pb2_grpc

from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from mesh.secrets import seal_for_upload
from tandem_taskapp import create_app
from tandem_taskapp.check import CHECK_NAMES, format_table, run_checks
from tandem_taskapp.openenv_env import OpenEnvAdapter, OpenEnvTaskApp, openenv_task_app, ws_url
from tandem_taskapp.serve import load_openenv_adapter, main
from tandem_taskapp.testing import FakePolicyServer, serve_in_thread
from tests.support.mesh import mesh_settings, running_mesh
from tests.support.openenv_apps import GUESS_ADAPTER, GUESS_ENV, OE_PYTHON, needs_openenv, openenv_server
from tests.support.postgres import free_port
from tests.support.processes import ROOT
from tests.taskapp.conftest import rollout_body

pytestmark = pytest.mark.timeout(300)
KEY = "oe-env-key-0123456789abcdef"


@pytest.fixture(scope="module")
def env_server() -> Iterator[str]:
    """The guess-the-number OpenEnv server, one process for the module's tests."""
    if not OE_PYTHON.exists():
        pytest.skip("needs openenv-core in .venv-openenv (make setup-openenv)")
    with openenv_server() as url:
        yield url


@pytest.fixture(scope="module")
def guess_app(env_server: str) -> Iterator[str]:
    """The Task App playing it through the example adapter, served on a loopback port."""
    app = openenv_task_app(env_server, load_openenv_adapter(str(GUESS_ADAPTER)))
    with serve_in_thread(create_app(app, KEY)) as url:
        yield url


def _get(url: str, path: str, **params: Any) -> httpx.Response:
    return httpx.get(f"{url}{path}", params=params, headers={"X-API-Key": KEY}, timeout=30)


def _rollout(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/rollout", json=body, headers={"X-API-Key": KEY}, timeout=120)


def _play(
    url: str, replies: list[str] | str, cid: str, **body: Any
) -> tuple[httpx.Response, FakePolicyServer]:
    policy = FakePolicyServer(replies)
    with serve_in_thread(policy.app) as policy_url:
        inference = FakePolicyServer.inference_url(policy_url, cid)
        return _rollout(url, rollout_body(cid, inference, **body)), policy


@needs_openenv
def test_the_app_is_named_by_the_env_server_and_task_info_answers_the_seeds_first_observation(
    guess_app: str,
) -> None:
    described = _get(guess_app, "/task_info").json()
    assert described["task"]["id"] == "GuessEnvironment"
    assert described["task_metadata"] == {"openenv_env": "GuessEnvironment"}
    info = _get(guess_app, "/task_info", seed=10).json()
    assert info["seed"] == 10
    observation = info["instance"]["observation"]
    assert observation["guesses_left"] == 4 and "from 1 to 16" in observation["message"]
    assert _get(guess_app, "/task_info", seed=10).json() == info


@needs_openenv
def test_an_episode_steps_the_env_with_each_reply_until_it_is_done_and_sums_its_rewards(
    guess_app: str,
) -> None:
    # Seed 10 is the game whose number is 11: a binary search from 8 finds it on the fourth guess.
    r, policy = _play(guess_app, ["8", "12", "10", "11"], "oe-guess-1", seed=10)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["trace_correlation_id"] == "oe-guess-1"
    assert answer["aborted"] is False
    assert answer["metrics"]["outcome_reward"] == 1.0
    assert answer["metrics"]["event_rewards"] == [0.0, 0.0, 0.0, 1.0]
    assert answer["metrics"]["details"]["openenv"] == {
        "steps": 4,
        "done": True,
        "final_observation": {"message": "Correct!", "guesses_left": 0},
    }
    turns = [[(m["role"], m["content"]) for m in t["messages"]] for t in answer["trajectory"]["turns"]]
    assert turns[0][0][0] == "user" and "from 1 to 16" in turns[0][0][1]
    assert turns[0][1:] == [("assistant", "8")]
    assert turns[1:] == [
        [("user", "Higher."), ("assistant", "12")],
        [("user", "Lower."), ("assistant", "10")],
        [("user", "Higher."), ("assistant", "11")],
    ]
    calls = policy.requests_for("oe-guess-1")
    assert len(calls) == 4
    assert {c.path for c in calls} == {"/v1/traces/oe-guess-1/chat/completions"}
    assert calls[0].body["model"] == "tiny-policy" and calls[0].body["temperature"] == 0.7
    # Every call resends the conversation so far.
    for n, call in enumerate(calls):
        assert len(call.messages) == 2 * n + 1
        assert call.messages[:-1] == calls[-1].messages[: 2 * n]


@needs_openenv
def test_an_episode_the_env_ends_without_the_number_scores_zero(guess_app: str) -> None:
    answer = _play(guess_app, "1", "oe-guess-2", seed=10)[0].json()
    assert answer["metrics"]["outcome_reward"] == 0.0 and answer["aborted"] is False
    assert len(answer["trajectory"]["turns"]) == 4  # the env's own limit: four guesses
    assert answer["metrics"]["details"]["openenv"]["final_observation"]["message"] == "Higher."


@needs_openenv
def test_the_episodes_turn_limit_aborts_it_with_the_rewards_so_far(guess_app: str) -> None:
    r, policy = _play(guess_app, "1", "oe-limit-1", seed=10, max_turns=2)
    answer = r.json()
    assert answer["aborted"] is True
    assert answer["metrics"]["details"]["abort_reason"] == "max_turns"
    assert answer["metrics"]["details"]["openenv"]["done"] is False
    assert answer["metrics"]["event_rewards"] == [0.0, 0.0]
    assert len(answer["trajectory"]["turns"]) == 2 and len(policy.requests_for("oe-limit-1")) == 2


@needs_openenv
def test_a_reply_without_a_number_is_the_adapters_guess_zero(guess_app: str) -> None:
    answer = _play(guess_app, ["no idea", "11"], "oe-words-1", seed=10)[0].json()
    assert answer["metrics"]["outcome_reward"] == 1.0
    assert [t["messages"][0]["content"] for t in answer["trajectory"]["turns"]][1:] == ["Higher."]


@needs_openenv
def test_a_failing_policy_answers_policy_unavailable(guess_app: str) -> None:
    policy = FakePolicyServer("11", status_code=503)
    with serve_in_thread(policy.app) as policy_url:
        inference = FakePolicyServer.inference_url(policy_url, "oe-down-1")
        r = _rollout(guess_app, rollout_body("oe-down-1", inference, seed=10))
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "POLICY_UNAVAILABLE"


@needs_openenv
def test_a_reset_config_that_is_not_an_object_is_refused(guess_app: str) -> None:
    r, policy = _play(guess_app, "11", "oe-config-1", seed=10, config={"reset": [1]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "INVALID_ARGUMENT" and "reset" in r.json()["error"]["message"]
    assert policy.requests_for("oe-config-1") == []


@needs_openenv
def test_an_action_the_env_refuses_fails_the_rollout(env_server: str) -> None:
    def wrong_action(text: str, observation: Mapping[str, Any]) -> dict[str, Any]:
        return {"guess": "eleven"}

    adapter = OpenEnvAdapter(prompt=lambda observation: str(observation["message"]), action=wrong_action)
    with serve_in_thread(create_app(openenv_task_app(env_server, adapter), KEY)) as url:
        r, _ = _play(url, "11", "oe-refused-1", seed=10)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "INTERNAL"


def test_an_env_server_that_is_not_up_answers_unavailable() -> None:
    adapter = load_openenv_adapter(str(GUESS_ADAPTER))
    app = OpenEnvTaskApp(f"http://127.0.0.1:{free_port()}", adapter, name="guess")
    with serve_in_thread(create_app(app, KEY)) as url:
        r, policy = _play(url, "11", "oe-nothing-1", seed=10)
        info = _get(url, "/task_info", seed=10)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "UNAVAILABLE"
    assert "cannot open a session on the OpenEnv server" in r.json()["error"]["message"]
    assert info.status_code == 503 and info.json()["error"]["code"] == "UNAVAILABLE"
    assert policy.requests == []


@needs_openenv
def test_a_repeated_correlation_id_answers_the_first_result_without_playing_again(guess_app: str) -> None:
    policy = FakePolicyServer(["11", "1"])
    with serve_in_thread(policy.app) as policy_url:
        body = rollout_body("oe-repeat-1", FakePolicyServer.inference_url(policy_url, "oe-repeat-1"), seed=10)
        first, again = _rollout(guess_app, body), _rollout(guess_app, body)
    assert again.json() == first.json() and first.json()["metrics"]["outcome_reward"] == 1.0
    assert again.headers["x-tandem-replayed"] == "true"
    assert len(policy.requests_for("oe-repeat-1")) == 1


@needs_openenv
async def test_every_conformance_check_passes(guess_app: str) -> None:
    results = await run_checks(guess_app, KEY, timeout_s=30)
    assert [r.name for r in results] == list(CHECK_NAMES)
    assert all(r.passed for r in results), format_table(results)
    assert {r.name: r for r in results}["dialect"].detail == "tandem"


@needs_openenv
def test_tandem_taskapp_serve_openenv_passes_the_cli_conformance_kit(env_server: str) -> None:
    port = free_port()
    environment = {**os.environ, "ENVIRONMENT_API_KEY": KEY}
    app = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "taskapp",
            "serve",
            "--openenv",
            env_server,
            "--openenv-adapter",
            str(GUESS_ADAPTER),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert app.poll() is None, app.stderr.read().decode() if app.stderr else ""
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the OpenEnv Task App did not start"
            time.sleep(0.1)
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "taskapp", "check", url, "--key-from-stdin"],
            cwd=ROOT,
            input=KEY,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    finally:
        app.send_signal(signal.SIGTERM)
        app.wait(timeout=20)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAIL" not in done.stdout and "timeout_behaviour" in done.stdout
    assert KEY not in done.stdout + done.stderr


@needs_openenv
@pytest.mark.slow
async def test_the_env_registers_with_the_proxy_and_plays_through_it(tmp_path: Path, guess_app: str) -> None:
    async with running_mesh(mesh_settings(tmp_path), ["events", "vault", "taskapp_proxy"]) as mesh:
        signer = TokenSigner(load_signing_key("", mesh.settings.state_dir))
        user = signer.issue("user", "alice", org="acme")
        async with open_channel(mesh.address("vault"), mesh.settings, token=user) as ch:
            vault = vault_service_pb2_grpc.VaultServiceStub(ch)
            key = await vault.GetPublicKey(vault_service_pb2.GetPublicKeyRequest(parent="orgs/acme"))
            await vault.PutSecret(
                vault_service_pb2.PutSecretRequest(
                    parent="orgs/acme",
                    secret_id="oe-key",
                    key_id=key.key_id,
                    ciphertext=seal_for_upload(key.public_key, KEY.encode()),
                )
            )
        policy = FakePolicyServer(["8", "12", "10", "11"])
        async with open_channel(mesh.address("taskapp_proxy"), mesh.settings, token=user) as channel:
            stub = taskapp_service_pb2_grpc.TaskAppServiceStub(channel)
            registered = await stub.RegisterTaskApp(
                pb.RegisterTaskAppRequest(
                    parent="orgs/acme",
                    task_app_id="oe-guess",
                    task_app=task_app_pb2.TaskApp(base_url=guess_app, secret_name="orgs/acme/secrets/oe-key"),
                )
            )
            assert all(c.passed for c in registered.check_results), registered.check_results
            with serve_in_thread(policy.app) as policy_url:
                policy.reset()
                spec = rollout_pb2.RolloutSpec(
                    trace_correlation_id="oe-proxy-1",
                    env=rollout_pb2.RolloutEnv(seed=10),
                    policy=rollout_pb2.RolloutPolicy(
                        config=rollout_pb2.RolloutPolicyConfig(
                            model="fake-policy",
                            inference_url=FakePolicyServer.inference_url(policy_url, "oe-proxy-1"),
                        )
                    ),
                )
                reply = await stub.Rollout(
                    pb.RolloutRequest(task_app="orgs/acme/taskApps/oe-guess", spec=spec)
                )
    result = reply.result
    assert not result.HasField("error"), result.error
    assert result.trace_correlation_id == "oe-proxy-1"
    assert result.metrics.outcome_reward == 1.0 and list(result.metrics.event_rewards) == [0.0, 0.0, 0.0, 1.0]
    assert len(policy.requests_for("oe-proxy-1")) == 4
    assert [m.content for t in result.trajectory.turns for m in t.messages if m.role == "user"][1:] == [
        "Higher.",
        "Lower.",
        "Higher.",
    ]


# ---- the command line's refusals (no env server needed) -----------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--openenv", "http://127.0.0.1:9"], "go together"),
        (["--openenv-adapter", str(GUESS_ADAPTER)], "one of them"),
        (["--openenv", "ftp://example", "--openenv-adapter", str(GUESS_ADAPTER)], "http(s)://host"),
        (["--openenv", "http://127.0.0.1:9", "--openenv-adapter", "examples/openenv/missing.py"], "no such"),
        (
            ["--openenv", "http://127.0.0.1:9", "--openenv-adapter", f"{GUESS_ADAPTER}:prompt"],
            "must define a module-level `prompt: OpenEnvAdapter`",
        ),
        (
            ["--openenv", f"http://127.0.0.1:{free_port()}", "--openenv-adapter", str(GUESS_ADAPTER)],
            "cannot reach the OpenEnv server",
        ),
        (["examples/taskapps/single_turn.py", "--openenv", "http://127.0.0.1:9"], "one of them"),
    ],
    ids=["no-adapter", "no-url", "bad-url", "missing-adapter", "not-an-adapter", "server-down", "path-too"],
)
def test_serve_refuses_an_openenv_app_it_cannot_make(
    arguments: list[str], said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ENVIRONMENT_API_KEY", KEY)
    assert main(arguments) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert KEY not in err


def test_the_ws_url_follows_the_servers_scheme_and_path() -> None:
    assert ws_url("http://127.0.0.1:8010") == "ws://127.0.0.1:8010/ws"
    assert ws_url("https://envs.example/guess/") == "wss://envs.example/guess/ws"
    with pytest.raises(ValueError, match="http"):
        ws_url("127.0.0.1:8010")


def _binary_search(messages: list[dict[str, Any]], body: dict[str, Any]) -> str:
    """A policy that plays the game by bisection on the hints of its own conversation."""
    low, high = 1, 16
    for said, hint in itertools.pairwise(messages):
        if said["role"] == "assistant" and hint["role"] == "user":
            guess = int(said["content"])
            if hint["content"] == "Higher.":
                low = guess + 1
            elif hint["content"] == "Lower.":
                high = guess - 1
    return str((low + high) // 2)


@needs_openenv
async def test_concurrent_episodes_each_play_their_own_env_session(guess_app: str) -> None:
    policy = FakePolicyServer(_binary_search)
    with serve_in_thread(policy.app) as policy_url:
        async with httpx.AsyncClient(headers={"X-API-Key": KEY}, timeout=120) as client:
            answers = await asyncio.gather(
                *(
                    client.post(
                        f"{guess_app}/rollout",
                        json=rollout_body(
                            f"oe-many-{seed}",
                            FakePolicyServer.inference_url(policy_url, f"oe-many-{seed}"),
                            seed=seed,
                        ),
                    )
                    for seed in range(16)
                )
            )
    for seed, r in enumerate(answers):
        assert r.status_code == 200, r.text
        secret = seed + 1
        messages = [m for t in r.json()["trajectory"]["turns"] for m in t["messages"]]
        guesses = [int(m["content"]) for m in messages if m["role"] == "assistant"]
        hints = [m["content"] for m in messages if m["role"] == "user"][1:]
        # Every hint is this episode's own game's: its secret, its guesses (the last answer ends the game and
        # is never sent to the policy).
        assert hints == ["Higher." if g < secret else "Lower." for g in guesses[:-1]]
        found = secret in guesses
        assert r.json()["metrics"]["outcome_reward"] == (1.0 if found else 0.0)
        assert len(guesses) == (guesses.index(secret) + 1 if found else 4)


@needs_openenv
async def test_an_env_server_at_its_session_limit_answers_unavailable_until_a_session_ends() -> None:
    adapter = load_openenv_adapter(str(GUESS_ADAPTER))
    with openenv_server(GUESS_ENV, "--max-sessions", "1") as env_url:
        app = openenv_task_app(env_url, adapter)
        policy = FakePolicyServer("11")
        with serve_in_thread(create_app(app, KEY)) as url, serve_in_thread(policy.app) as policy_url:
            async with (
                aiohttp.ClientSession() as http,
                httpx.AsyncClient(headers={"X-API-Key": KEY}, timeout=120) as client,
            ):
                held = await http.ws_connect(ws_url(env_url))  # another client holds the only session
                await held.send_str(json.dumps({"type": "reset", "data": {"seed": 1}}))
                assert json.loads((await held.receive()).data)["type"] == "observation"
                body = rollout_body(
                    "oe-full-1", FakePolicyServer.inference_url(policy_url, "oe-full-1"), seed=10
                )
                busy = await client.post(f"{url}/rollout", json=body)
                await held.send_str(json.dumps({"type": "close"}))
                assert (await held.receive()).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
                await held.close()
                again = await client.post(f"{url}/rollout", json=body)
    assert busy.status_code == 503, busy.text
    assert (
        busy.json()["error"]["code"] == "UNAVAILABLE"
        and "CAPACITY_REACHED" in busy.json()["error"]["message"]
    )
    assert again.status_code == 200, again.text  # the failed episode was not recorded: the retry plays
    assert again.json()["metrics"]["outcome_reward"] == 1.0

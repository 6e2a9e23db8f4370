"""verifiers environments as Task Apps (tandem_taskapp/verifiers_env.py): the example envs written on verifiers'
public API (examples/verifiers/, single- and multi-turn), each served as its own process with
`tandem taskapp serve --verifiers FILE` in .venv-verifiers, played against the fake policy server, through
the conformance kit (`tandem taskapp check`) and through the real taskapp-proxy. Without .venv-verifiers
they skip; the command line's refusals run in .venv, where verifiers is not installed."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tandem.taskapp.v1 import rollout_pb2, task_app_pb2, taskapp_service_pb2_grpc
from tandem.taskapp.v1 import taskapp_service_pb2 as pb
from tandem.vault.v1 import vault_service_pb2, vault_service_pb2_grpc

from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from mesh.secrets import seal_for_upload
from tandem_taskapp.check import CHECK_NAMES, format_table, run_checks
from tandem_taskapp.serve import main
from tandem_taskapp.testing import FakePolicyServer, serve_in_thread
from tests.support.mesh import mesh_settings, running_mesh
from tests.support.processes import ROOT
from tests.support.verifiers_apps import MULTI_TURN, SINGLE_TURN, VF_PYTHON, needs_verifiers, verifiers_app
from tests.taskapp.conftest import rollout_body

pytestmark = pytest.mark.timeout(300)
KEY = "vf-env-key-0123456789abcdef"


@pytest.fixture(scope="module")
def single_turn() -> Iterator[str]:
    """The single-turn env's app, one process for the module's tests."""
    if not VF_PYTHON.exists():
        pytest.skip("needs verifiers in .venv-verifiers (make setup-verifiers)")
    with verifiers_app(SINGLE_TURN, KEY) as url:
        yield url


@pytest.fixture(scope="module")
def multi_turn() -> Iterator[str]:
    """The multi-turn env's app, one process for the module's tests."""
    if not VF_PYTHON.exists():
        pytest.skip("needs verifiers in .venv-verifiers (make setup-verifiers)")
    with verifiers_app(MULTI_TURN, KEY) as url:
        yield url


def _get(url: str, path: str, **params: Any) -> httpx.Response:
    return httpx.get(f"{url}{path}", params=params, headers={"X-API-Key": KEY}, timeout=30)


def _rollout(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/rollout", json=body, headers={"X-API-Key": KEY}, timeout=120)


@needs_verifiers
def test_a_seed_picks_the_taskset_task_and_task_info_describes_it(single_turn: str) -> None:
    info = _get(single_turn, "/task_info", seed=5).json()
    assert info["seed"] == 5
    assert info["task"]["id"] == "vf_copy_letter"
    task = info["instance"]["task"]
    assert task["idx"] == 5 and task["target"] == "B" and task["prompt"] == "Copy this letter: B"
    assert len(info["instance"]["task_key"]) == 64
    assert _get(single_turn, "/task_info", seed=5 + 16).json()["instance"] == info["instance"]  # seed mod 16
    assert _get(single_turn, "/task_info", seed=6).json()["instance"]["task"]["target"] == "C"


@needs_verifiers
def test_a_single_turn_episode_reaches_the_policy_with_its_correlation_id_and_answers_its_reward(
    single_turn: str,
) -> None:
    policy = FakePolicyServer(["B", "D"])
    with serve_in_thread(policy.app) as policy_url:
        inference = FakePolicyServer.inference_url(policy_url, "vf-single-1")
        body = rollout_body("vf-single-1", inference, seed=5)
        body["policy"]["config"]["seed"] = 1234  # the episode's sampling seed
        good = _rollout(single_turn, body)
        inference = FakePolicyServer.inference_url(policy_url, "vf-single-2")
        wrong = _rollout(single_turn, rollout_body("vf-single-2", inference, seed=5))
    assert good.status_code == 200, good.text
    answer = good.json()
    assert answer["trace_correlation_id"] == "vf-single-1"
    assert answer["metrics"]["outcome_reward"] == 1.0
    assert answer["aborted"] is False
    (trace,) = answer["metrics"]["details"]["verifiers"]["traces"]
    assert trace["rewards"] == {"copied": 1.0} and trace["turns"] == 1
    assert answer["trajectory"]["turns"] == [
        {
            "messages": [
                {"role": "user", "content": "Copy this letter: B"},
                {"role": "assistant", "content": "B"},
            ]
        }
    ]
    assert wrong.json()["metrics"]["outcome_reward"] == 0.0
    # The env's model client is the episode's policy: its URL, its correlation id, its sampling.
    (call,) = policy.requests_for("vf-single-1")
    assert call.path == "/v1/traces/vf-single-1/chat/completions"
    assert call.body["model"] == "tiny-policy"
    assert call.body["temperature"] == 0.7 and call.body["max_tokens"] == 16
    assert call.body["seed"] == 1234
    assert call.messages == [{"role": "user", "content": "Copy this letter: B"}]
    (unseeded,) = policy.requests_for("vf-single-2")
    assert "seed" not in unseeded.body


@needs_verifiers
def test_a_multi_turn_episode_answers_one_turn_per_model_reply(multi_turn: str) -> None:
    # Seed 10 is the game whose number is 11: a binary search from 8 finds it on the fourth guess.
    assert _get(multi_turn, "/task_info", seed=10).json()["instance"]["task"]["secret"] == 11
    policy = FakePolicyServer(["8", "12", "10", "11"])
    with serve_in_thread(policy.app) as policy_url:
        inference = FakePolicyServer.inference_url(policy_url, "vf-multi-1")
        r = _rollout(multi_turn, rollout_body("vf-multi-1", inference, seed=10))
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["metrics"]["outcome_reward"] == 1.0
    (trace,) = answer["metrics"]["details"]["verifiers"]["traces"]
    assert trace["metrics"] == {"guesses": 4.0} and trace["turns"] == 4
    turns = [[(m["role"], m["content"]) for m in t["messages"]] for t in answer["trajectory"]["turns"]]
    assert turns[0][0][0] == "user" and "number from 1 to 16" in turns[0][0][1]
    assert turns[0][1:] == [("assistant", "8")]
    assert turns[1:] == [
        [("user", "Higher."), ("assistant", "12")],
        [("user", "Lower."), ("assistant", "10")],
        [("user", "Higher."), ("assistant", "11")],
    ]
    calls = policy.requests_for("vf-multi-1")
    assert len(calls) == 4
    # Every call resends the conversation so far: each later prompt extends the one before it.
    for earlier, later in itertools.pairwise(calls):
        assert later.messages[: len(earlier.messages)] == earlier.messages
        assert len(later.messages) == len(earlier.messages) + 2


@needs_verifiers
def test_a_multi_turn_episode_that_never_finds_the_number_scores_zero(multi_turn: str) -> None:
    policy = FakePolicyServer("1")
    with serve_in_thread(policy.app) as policy_url:
        inference = FakePolicyServer.inference_url(policy_url, "vf-multi-2")
        answer = _rollout(multi_turn, rollout_body("vf-multi-2", inference, seed=10)).json()
    assert answer["metrics"]["outcome_reward"] == 0.0
    assert len(answer["trajectory"]["turns"]) == 4  # the env's own limit: four guesses


@needs_verifiers
def test_the_env_config_sets_the_seats_turn_limit_and_hitting_it_aborts_the_episode() -> None:
    policy = FakePolicyServer("1")
    with (
        verifiers_app(MULTI_TURN, KEY, "--verifiers-config", '{"agent": {"max_turns": 2}}') as url,
        serve_in_thread(policy.app) as policy_url,
    ):
        inference = FakePolicyServer.inference_url(policy_url, "vf-limit-1")
        answer = _rollout(url, rollout_body("vf-limit-1", inference, seed=10)).json()
    assert answer["aborted"] is True
    assert answer["metrics"]["details"]["abort_reason"] == "max_turns"
    assert answer["metrics"]["outcome_reward"] == 0.0
    assert len(answer["trajectory"]["turns"]) == 2 and len(policy.requests_for("vf-limit-1")) == 2


@needs_verifiers
def test_a_failing_policy_answers_policy_unavailable(single_turn: str) -> None:
    policy = FakePolicyServer("B", status_code=503)
    with serve_in_thread(policy.app) as policy_url:
        inference = FakePolicyServer.inference_url(policy_url, "vf-down-1")
        r = _rollout(single_turn, rollout_body("vf-down-1", inference, seed=5))
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "POLICY_UNAVAILABLE"
    assert policy_url not in r.text


@needs_verifiers
def test_a_repeated_correlation_id_answers_the_first_result_without_playing_again(single_turn: str) -> None:
    policy = FakePolicyServer(["B", "A"])
    with serve_in_thread(policy.app) as policy_url:
        body = rollout_body("vf-repeat-1", FakePolicyServer.inference_url(policy_url, "vf-repeat-1"), seed=5)
        first, again = _rollout(single_turn, body), _rollout(single_turn, body)
    assert again.json() == first.json() and first.json()["metrics"]["outcome_reward"] == 1.0
    assert again.headers["x-tandem-replayed"] == "true"
    assert len(policy.requests_for("vf-repeat-1")) == 1


@needs_verifiers
@pytest.mark.parametrize("which", ["single", "multi"])
async def test_every_conformance_check_passes(which: str, single_turn: str, multi_turn: str) -> None:
    url = single_turn if which == "single" else multi_turn
    results = await run_checks(url, KEY, timeout_s=30)
    assert [r.name for r in results] == list(CHECK_NAMES)
    assert all(r.passed for r in results), format_table(results)
    assert {r.name: r for r in results}["dialect"].detail == "tandem"


@needs_verifiers
def test_the_cli_conformance_kit_passes_a_verifiers_app(multi_turn: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "taskapp", "check", multi_turn, "--key-from-stdin"],
        cwd=ROOT,
        input=KEY,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAIL" not in done.stdout and "timeout_behaviour" in done.stdout
    assert KEY not in done.stdout + done.stderr


@needs_verifiers
@pytest.mark.slow
async def test_both_envs_register_with_the_proxy_and_play_through_it(
    tmp_path: Path, single_turn: str, multi_turn: str
) -> None:
    async with running_mesh(mesh_settings(tmp_path), ["events", "vault", "taskapp_proxy"]) as mesh:
        signer = TokenSigner(load_signing_key("", mesh.settings.state_dir))
        user = signer.issue("user", "alice", org="acme")
        async with open_channel(mesh.address("vault"), mesh.settings, token=user) as ch:
            vault = vault_service_pb2_grpc.VaultServiceStub(ch)
            key = await vault.GetPublicKey(vault_service_pb2.GetPublicKeyRequest(parent="orgs/acme"))
            await vault.PutSecret(
                vault_service_pb2.PutSecretRequest(
                    parent="orgs/acme",
                    secret_id="vf-key",
                    key_id=key.key_id,
                    ciphertext=seal_for_upload(key.public_key, KEY.encode()),
                )
            )
        policy = FakePolicyServer("B")
        async with open_channel(mesh.address("taskapp_proxy"), mesh.settings, token=user) as channel:
            stub = taskapp_service_pb2_grpc.TaskAppServiceStub(channel)
            results = {}
            with serve_in_thread(policy.app) as policy_url:
                for app_id, url, seed in (("vf-letters", single_turn, 5), ("vf-guess", multi_turn, 10)):
                    registered = await stub.RegisterTaskApp(
                        pb.RegisterTaskAppRequest(
                            parent="orgs/acme",
                            task_app_id=app_id,
                            task_app=task_app_pb2.TaskApp(
                                base_url=url, secret_name="orgs/acme/secrets/vf-key"
                            ),
                        )
                    )
                    assert all(c.passed for c in registered.check_results), registered.check_results
                    policy.reset()
                    correlation = f"vf-proxy-{app_id}"
                    spec = rollout_pb2.RolloutSpec(
                        trace_correlation_id=correlation,
                        env=rollout_pb2.RolloutEnv(seed=seed),
                        policy=rollout_pb2.RolloutPolicy(
                            config=rollout_pb2.RolloutPolicyConfig(
                                model="fake-policy",
                                inference_url=FakePolicyServer.inference_url(policy_url, correlation),
                            )
                        ),
                    )
                    if app_id == "vf-guess":
                        policy.replies = ["8", "12", "10", "11"]
                    else:
                        policy.replies = "B"
                    reply = await stub.Rollout(
                        pb.RolloutRequest(task_app=f"orgs/acme/taskApps/{app_id}", spec=spec)
                    )
                    results[app_id] = (reply.result, len(policy.requests_for(correlation)))
    letters, letters_calls = results["vf-letters"]
    assert not letters.HasField("error"), letters.error
    assert letters.trace_correlation_id == "vf-proxy-vf-letters"
    assert letters.metrics.outcome_reward == 1.0 and letters_calls == 1
    (turn,) = letters.trajectory.turns
    assert [(m.role, m.content) for m in turn.messages] == [
        ("user", "Copy this letter: B"),
        ("assistant", "B"),
    ]
    guess, guess_calls = results["vf-guess"]
    assert not guess.HasField("error"), guess.error
    assert guess.metrics.outcome_reward == 1.0 and guess_calls == 4
    assert [m.content for t in guess.trajectory.turns for m in t.messages if m.role == "user"][1:] == [
        "Higher.",
        "Lower.",
        "Higher.",
    ]


@needs_verifiers
@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--verifiers", "no-such-taskset"], "taskset 'no-such-taskset' not found"),
        (
            ["--verifiers", str(MULTI_TURN), "--verifiers-config", '{"agent": {"max_turns": "many"}}'],
            "not valid",
        ),
        (["--verifiers", str(MULTI_TURN), "--verifiers-config", "[1]"], "must be a JSON object"),
        (["--verifiers", "examples/verifiers/missing.py"], "no such verifiers environment file"),
    ],
    ids=["unknown-id", "bad-config", "config-not-object", "missing-file"],
)
def test_serve_refuses_an_env_it_cannot_load(arguments: list[str], said: str) -> None:
    done = subprocess.run(
        [str(VF_PYTHON), "-m", "gateway.cli", "taskapp", "serve", *arguments, "--no-auth"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert said in done.stderr


# ---- the command line where verifiers is not installed (.venv) ----------------------------------------------


def test_serve_names_the_missing_verifiers_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if _has_verifiers():
        pytest.skip("verifiers is importable in this Python")
    monkeypatch.setenv("ENVIRONMENT_API_KEY", KEY)
    assert main(["--verifiers", str(SINGLE_TURN)]) == 2
    err = capsys.readouterr().err
    assert "cannot import verifiers" in err and "make setup-verifiers" in err
    assert KEY not in err


def test_serve_takes_a_path_or_verifiers_not_both(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ENVIRONMENT_API_KEY", KEY)
    assert main(["examples/taskapps/single_turn.py", "--verifiers", str(SINGLE_TURN)]) == 2
    assert "one of them" in capsys.readouterr().err
    assert main([]) == 2
    assert "one of them" in capsys.readouterr().err
    assert main(["examples/taskapps/single_turn.py", "--verifiers-config", "{}"]) == 2
    assert "--verifiers-config goes with --verifiers" in capsys.readouterr().err


def _has_verifiers() -> bool:
    import importlib.util  # noqa: PLC0415

    return importlib.util.find_spec("verifiers") is not None

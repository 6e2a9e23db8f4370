"""The three example Task Apps end to end: each runs as its own process (`tandem taskapp serve`), registers
with the real taskapp-proxy (which runs the conformance kit with the key it opens from the real vault), and
plays rollouts through the proxy against an OpenAI-compatible policy server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
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
from mesh.status import RpcError
from tandem_taskapp.testing import FakePolicyServer, serve_in_thread
from tests.support.mesh import Mesh, mesh_settings, running_mesh
from tests.support.postgres import free_port
from tests.support.processes import ROOT

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]
KEY = "example-env-key-0123456789"


@contextmanager
def example_app(script: str, key: str = KEY) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "ENVIRONMENT_API_KEY": key}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "taskapp",
            "serve",
            f"examples/taskapps/{script}",
            "--port",
            str(port),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, f"{script} did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    async with running_mesh(mesh_settings(tmp_path), ["events", "vault", "taskapp_proxy"]) as running:
        yield running


async def register(mesh: Mesh, app_id: str, url: str) -> tuple[Any, pb.RegisterTaskAppResponse]:
    signer = TokenSigner(load_signing_key("", mesh.settings.state_dir))
    user = signer.issue("user", "alice", org="acme")
    async with open_channel(mesh.address("vault"), mesh.settings, token=user) as ch:
        vault = vault_service_pb2_grpc.VaultServiceStub(ch)
        key = await vault.GetPublicKey(vault_service_pb2.GetPublicKeyRequest(parent="orgs/acme"))
        sealed = seal_for_upload(key.public_key, KEY.encode())
        await vault.PutSecret(
            vault_service_pb2.PutSecretRequest(
                parent="orgs/acme",
                secret_id=f"{app_id}-key",
                key_id=key.key_id,
                ciphertext=sealed,
            )
        )
    channel = open_channel(mesh.address("taskapp_proxy"), mesh.settings, token=user)
    stub = taskapp_service_pb2_grpc.TaskAppServiceStub(channel)
    registered = await stub.RegisterTaskApp(
        pb.RegisterTaskAppRequest(
            parent="orgs/acme",
            task_app_id=app_id,
            task_app=task_app_pb2.TaskApp(base_url=url, secret_name=f"orgs/acme/secrets/{app_id}-key"),
        )
    )
    return (channel, stub), registered


def spec(correlation: str, seed: int, inference_url: str) -> rollout_pb2.RolloutSpec:
    return rollout_pb2.RolloutSpec(
        trace_correlation_id=correlation,
        env=rollout_pb2.RolloutEnv(seed=seed),
        policy=rollout_pb2.RolloutPolicy(
            config=rollout_pb2.RolloutPolicyConfig(model="fake-policy", inference_url=inference_url)
        ),
    )


async def test_single_turn_app_through_the_proxy(mesh: Mesh) -> None:
    def reply(messages: list[dict[str, Any]], body: dict[str, Any]) -> str:
        prompt = " ".join(str(m.get("content", "")) for m in messages)
        found = re.findall(r"\b([A-Z])\b", prompt)
        return found[-1] if found else "?"

    policy = FakePolicyServer(reply)
    with example_app("single_turn.py") as url, serve_in_thread(policy.app) as policy_url:
        (channel, stub), registered = await register(mesh, "letters", url)
        assert all(c.passed for c in registered.check_results), registered.check_results
        assert {c.check for c in registered.check_results} >= {"health", "auth_wrong_key", "rollout_schema"}
        correlation = "e2e-single-1"
        inference = FakePolicyServer.inference_url(policy_url, correlation)
        reply_ = await stub.Rollout(
            pb.RolloutRequest(
                task_app="orgs/acme/taskApps/letters",
                spec=spec(correlation, 7, inference),
            )
        )
        result = reply_.result
        assert not result.HasField("error"), result.error
        assert result.metrics.outcome_reward == 1.0
        assert policy.requests_for(correlation), "the policy call carried the correlation id"
        await channel.close()


async def test_registration_refuses_an_app_that_fails_its_checks(mesh: Mesh) -> None:
    with example_app("math_word.py", key="a-different-key-entirely") as url, pytest.raises(RpcError) as info:
        await register(mesh, "wrong-key", url)
    assert info.value.reason == "TASK_APP_CHECK_FAILED"
    assert "auth" in info.value.metadata["failed_checks"] or "health" in info.value.metadata["failed_checks"]


@pytest.mark.parametrize("script", ["guessing_game.py", "math_word.py"])
async def test_multi_turn_and_math_apps_register_and_play(mesh: Mesh, script: str) -> None:
    policy = FakePolicyServer("50")
    app_id = script.removesuffix(".py").replace("_", "-")
    with example_app(script) as url, serve_in_thread(policy.app) as policy_url:
        (channel, stub), registered = await register(mesh, app_id, url)
        assert all(c.passed for c in registered.check_results)
        correlation = f"e2e-{app_id}"
        inference = FakePolicyServer.inference_url(policy_url, correlation)
        reply = await stub.Rollout(
            pb.RolloutRequest(
                task_app=f"orgs/acme/taskApps/{app_id}",
                spec=spec(correlation, 3, inference),
            )
        )
        assert not reply.result.HasField("error"), reply.result.error
        assert 0.0 <= reply.result.metrics.outcome_reward <= 1.0
        assert len(policy.requests_for(correlation)) >= 1
        await channel.close()


def test_the_cli_checks_an_app_with_the_key_from_stdin() -> None:
    with example_app("guessing_game.py") as url:
        good = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "taskapp", "check", url, "--key-from-stdin"],
            cwd=ROOT,
            input=KEY,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        bad = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "taskapp", "check", url, "--key-from-stdin"],
            cwd=ROOT,
            input="not-the-key",
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert good.returncode == 0, good.stdout + good.stderr
    assert "FAIL" not in good.stdout and "rollout_schema" in good.stdout
    assert bad.returncode == 1 and "FAIL" in bad.stdout
    assert KEY not in good.stdout + good.stderr + bad.stdout + bad.stderr


@pytest.mark.parametrize("form", ["trajectories", "trace"])
async def test_a_hosted_contract_app_registers_and_its_answers_reach_tandems_shape(
    mesh: Mesh, form: str
) -> None:
    from tests.taskapp.test_hosted import hosted_app  # noqa: PLC0415 - the app's process, one helper

    def reply(messages: list[dict[str, Any]], body: dict[str, Any]) -> str:
        found = re.findall(r"\b([A-D])\b", " ".join(str(m.get("content", "")) for m in messages))
        return found[-1] if found else "?"

    policy = FakePolicyServer(reply)
    with hosted_app(form, key=KEY) as url, serve_in_thread(policy.app) as policy_url:
        (channel, stub), registered = await register(mesh, f"hosted-{form}", url)
        checks = {c.check: c for c in registered.check_results}
        assert all(c.passed for c in checks.values()), checks
        assert checks["dialect"].detail.startswith("hosted: ")
        assert registered.task_app.task_info["dataset"]["splits"][0]["name"] == "train"
        correlation = f"e2e-hosted-{form}"
        inference = FakePolicyServer.inference_url(policy_url, correlation)
        reply_ = await stub.Rollout(
            pb.RolloutRequest(
                task_app=f"orgs/acme/taskApps/hosted-{form}", spec=spec(correlation, 5, inference)
            )
        )
        await channel.close()
    result = reply_.result
    assert not result.HasField("error"), result.error
    assert result.trace_correlation_id == correlation
    assert result.metrics.outcome_reward == 1.0  # the policy copied the letter
    (turn,) = result.trajectory.turns
    assert turn.messages[0].role == "user" and "Copy this letter" in turn.messages[0].content
    assert turn.messages[-1].role == "assistant"
    assert policy.requests_for(correlation), "the policy call carried the correlation id"

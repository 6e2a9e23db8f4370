"""The gateway's OpenAI-compatible endpoint through the official `openai` client, in a real in-process mesh
with a checkpoint announced by its job's events: models listed and retrieved, every error OpenAI-shaped
(`{"error": {"message", "type", "param", "code"}}`) with its HTTP status and the client's matching exception,
and the request fields it refuses (naming them) before it looks for an inference worker. Generation itself,
which needs a worker, is in tests/trainer/test_openai_client.py and the slow Infer test of test_gateway.py."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tandem.events.v1 import event_pb2, events_service_pb2, events_service_pb2_grpc
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.gateway.v1 import gateway_service_pb2_grpc
from tandem.scheduler.v1 import job_spec_pb2

from gateway.orgs import ADMIN_KEY_FILE
from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from mesh.launcher import print_addresses
from tests.support.mesh import Mesh, mesh_settings, running_mesh

pytestmark = pytest.mark.timeout(180)
CHECKPOINT = "orgs/acme/jobs/rl/checkpoints/step-3"


@dataclass
class Endpoint:
    base_url: str  # .../v1
    acme: openai.AsyncOpenAI
    globex: openai.AsyncOpenAI
    acme_stub: gateway_service_pb2_grpc.GatewayServiceStub
    mesh: Mesh


@pytest.fixture
async def endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Endpoint]:
    monkeypatch.setenv("TANDEM_GATEWAY_HTTP_PORT", "0")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CPUS", "4")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__MEMORY_GIB", "8")
    async with running_mesh(mesh_settings(tmp_path)) as mesh:
        admin_key = (tmp_path / ADMIN_KEY_FILE).read_text().strip()
        signer = TokenSigner(load_signing_key("", mesh.settings.state_dir))
        async with (
            open_channel(mesh.address("gateway"), mesh.settings, token=admin_key) as admin_channel,
            open_channel(
                mesh.address("events"), mesh.settings, token=signer.issue("service", "trainer", ttl_s=3600)
            ) as events_channel,
        ):
            admin = gateway_service_pb2_grpc.GatewayServiceStub(admin_channel)
            acme = await admin.CreateOrg(pb.CreateOrgRequest(org_id="acme"))
            globex = await admin.CreateOrg(pb.CreateOrgRequest(org_id="globex"))
            info = (await admin.GetServerInfo(pb.GetServerInfoRequest())).server_info
            event = event_pb2.Event(type="checkpoint.saved", message="step 3")
            event.checkpoint_saved.checkpoint = CHECKPOINT
            event.checkpoint_saved.step = 3
            event.checkpoint_saved.uri = (tmp_path / "no-such-folder").as_uri()
            await events_service_pb2_grpc.EventServiceStub(events_channel).Publish(
                events_service_pb2.PublishRequest(job="orgs/acme/jobs/rl", events=[event])
            )
        base = info.openai_base_url
        clients = [
            openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) for key in (acme.key, globex.key)
        ]
        try:
            async with open_channel(mesh.address("gateway"), mesh.settings, token=acme.key) as channel:
                yield Endpoint(base, *clients, gateway_service_pb2_grpc.GatewayServiceStub(channel), mesh)
        finally:
            for client in clients:
                await client.close()


def error_of(caught: pytest.ExceptionInfo[openai.APIStatusError]) -> dict[str, Any]:
    """The error object of an answer, checked to have OpenAI's four fields."""
    body = caught.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}, body
    assert isinstance(body["message"], str) and body["message"]
    return body


async def test_models_are_listed_and_retrieved(endpoint: Endpoint) -> None:
    # The listing holds the checkpoints of the organization's jobs: this one's announced its checkpoint.
    task = job_spec_pb2.TaskSpec(name="main", kind=job_spec_pb2.TaskSpec.KIND_COMMAND, run="true")
    spec = job_spec_pb2.JobSpec(display_name="rl", tasks=[task])
    await endpoint.acme_stub.CreateJob(pb.CreateJobRequest(parent="orgs/acme", job_id="rl", spec=spec))
    listed = [m.id async for m in endpoint.acme.models.list()]
    assert listed == [CHECKPOINT]
    model = await endpoint.acme.models.retrieve(CHECKPOINT)
    assert (model.id, model.object, model.owned_by) == (CHECKPOINT, "model", "acme")
    newest = await endpoint.acme.models.retrieve("orgs/acme/jobs/rl/checkpoints/latest")
    assert newest.id == CHECKPOINT  # `latest` answers the checkpoint it names now
    for unknown, code in [
        ("orgs/acme/jobs/rl/checkpoints/step-9", "CHECKPOINT_NOT_FOUND"),
        ("orgs/acme/jobs/nope/checkpoints/latest", "JOB_NOT_FOUND"),
        ("not-a-checkpoint", "CHECKPOINT_NOT_FOUND"),
    ]:
        with pytest.raises(openai.NotFoundError) as caught:
            await endpoint.acme.models.retrieve(unknown)
        assert caught.value.status_code == 404
        assert error_of(caught)["code"] == code and error_of(caught)["type"] == "not_found_error"
    # Another organization's checkpoint reads as absent.
    with pytest.raises(openai.NotFoundError) as caught:
        await endpoint.globex.models.retrieve(CHECKPOINT)
    assert error_of(caught)["code"] == "JOB_NOT_FOUND"
    assert [m.id async for m in endpoint.globex.models.list()] == []


async def test_credentials_errors_are_openai_shaped(endpoint: Endpoint) -> None:
    for key in ("tdm_nope_nope", "not-a-tandem-key"):
        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError) as caught:
                await wrong.models.list()
            assert caught.value.status_code == 401
            assert error_of(caught) == {
                "message": error_of(caught)["message"],
                "type": "authentication_error",
                "param": None,
                "code": "INVALID_CREDENTIALS",
            }
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(
                    model=CHECKPOINT, messages=[{"role": "user", "content": "hi"}]
                )
    async with httpx.AsyncClient(base_url=endpoint.base_url) as raw:
        missing = await raw.get("/models")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "MISSING_CREDENTIALS"


async def test_unknown_routes_and_methods_are_openai_errors(endpoint: Endpoint) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await endpoint.acme.embeddings.create(model=CHECKPOINT, input="hello")
    assert error_of(caught)["code"] == "NOT_FOUND" and "/v1/embeddings" in error_of(caught)["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        await endpoint.acme.files.list()
    assert error_of(caught)["code"] == "NOT_FOUND"
    async with httpx.AsyncClient(base_url=endpoint.base_url) as raw:
        wrong_method = await raw.get("/chat/completions")
        assert wrong_method.status_code == 405
        assert wrong_method.headers["content-type"] == "application/json"
        assert wrong_method.json()["error"]["code"] == "NOT_IMPLEMENTED"
        # The dashboard's pages, outside /v1/, keep their own answers.
        page = await raw.get(endpoint.base_url.removesuffix("/v1") + "/no-such-page")
        assert page.status_code == 404 and "error" not in page.text


async def test_an_unknown_model_is_not_found(endpoint: Endpoint) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await endpoint.acme.chat.completions.create(
            model="orgs/acme/jobs/rl/checkpoints/step-9", messages=[{"role": "user", "content": "hi"}]
        )
    assert error_of(caught)["code"] == "CHECKPOINT_NOT_FOUND"
    with pytest.raises(openai.NotFoundError) as caught:
        await endpoint.acme.completions.create(model="gpt-4o", prompt="hi")
    assert error_of(caught)["code"] == "CHECKPOINT_NOT_FOUND"
    with pytest.raises(openai.NotFoundError):
        await endpoint.globex.completions.create(model=CHECKPOINT, prompt="hi")


CHAT = {"model": CHECKPOINT, "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"tools": [TOOL]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"42": 5}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"modalities": ["audio"]}, "modalities"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
    ],
)
async def test_chat_fields_not_honoured_are_refused_naming_the_field(
    endpoint: Endpoint, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await endpoint.acme.chat.completions.create(**CHAT, **fields)  # type: ignore[call-overload]
    assert caught.value.status_code == 400
    error = error_of(caught)
    assert (error["param"], error["code"], error["type"]) == (
        param,
        "INVALID_ARGUMENT",
        "invalid_request_error",
    )
    assert f"`{param}`" in error["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "end"}, "suffix"),
    ],
)
async def test_completion_fields_not_honoured_are_refused_naming_the_field(
    endpoint: Endpoint, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await endpoint.acme.completions.create(model=CHECKPOINT, prompt="hi", **fields)
    assert error_of(caught)["param"] == param


async def test_a_stream_with_a_refused_field_is_refused_before_it_starts(endpoint: Endpoint) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await endpoint.acme.chat.completions.create(**CHAT, stream=True, tools=[TOOL])  # type: ignore[call-overload]
    assert error_of(caught)["param"] == "tools"


async def test_tandem_up_prints_the_endpoint_a_client_uses(endpoint: Endpoint) -> None:
    out = io.StringIO()
    print_addresses(out)(list(endpoint.mesh.services.values()))
    assert f"OpenAI-compatible endpoint (base_url, with an API key): {endpoint.base_url}\n" in out.getvalue()
    assert f"Dashboard: {endpoint.base_url.removesuffix('/v1')}/\n" in out.getvalue()
    assert out.getvalue().endswith("Press Ctrl-C to stop.\n")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, -1]}, "token_ids[1]"),
        ({"token_ids": [[1], "x"]}, "token_ids[1]"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
        ({"token_ids": [1], "sampling_params": {"n": 17}}, "sampling_params.n"),
        (
            {"token_ids": [1], "sampling_params": {"repetition_penalty": 1.2}},
            "sampling_params.repetition_penalty",
        ),
        ({"token_ids": [1], "stream": True}, "stream"),
        ({"token_ids": [1], "messages": []}, "messages"),
    ],
)
async def test_generate_is_relayed_and_its_refusals_come_before_a_worker_is_looked_for(
    endpoint: Endpoint, fields: dict[str, Any], param: str
) -> None:
    root = endpoint.base_url.removesuffix("/v1")
    headers = {"authorization": f"Bearer {endpoint.acme.api_key}"}
    async with httpx.AsyncClient(base_url=root, headers=headers) as http:
        answer = await http.post("/inference/v1/generate", json={"model": CHECKPOINT, **fields})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param and answer.json()["error"]["code"] == "INVALID_ARGUMENT"


async def test_generate_needs_a_key_and_a_checkpoint_and_unknown_inference_routes_are_openai_errors(
    endpoint: Endpoint,
) -> None:
    root = endpoint.base_url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=root) as http:
        keyless = await http.post("/inference/v1/generate", json={"model": CHECKPOINT, "token_ids": [1]})
        assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "MISSING_CREDENTIALS"
        http.headers["authorization"] = f"Bearer {endpoint.acme.api_key}"
        for model in ("orgs/acme/jobs/rl/checkpoints/step-9", "gpt-4o", None):
            missing = await http.post("/inference/v1/generate", json={"model": model, "token_ids": [1]})
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "CHECKPOINT_NOT_FOUND"
        other = await http.post(
            "/inference/v1/generate",
            json={"model": CHECKPOINT, "token_ids": [1]},
            headers={"authorization": f"Bearer {endpoint.globex.api_key}"},
        )
        assert other.status_code == 404 and other.json()["error"]["code"] == "JOB_NOT_FOUND"
        unknown = await http.post("/inference/v1/embed", json={})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "NOT_FOUND"
        wrong_method = await http.get("/inference/v1/generate")
        assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "NOT_IMPLEMENTED"

"""Bad input at the gateway's HTTP endpoints and the events service answers a canonical code with a reason,
never INTERNAL or HTTP 500: deep JSON, oversized bodies (refused while they stream in), numbers that only
look like digits, cursors past their type, a header that is not text; and the reads of a job's events take
any 64-bit cursor."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from starlette.requests import Request
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.scheduler.v1 import job_spec_pb2

from gateway.httpinput import read_body, whole_number
from mesh.errors import InvalidArgument
from mesh.status import RpcError
from tests.gateway.test_dashboard import JOB, ROOT, Board, step_event

DEEP = b"[" * 200_000 + b"]" * 200_000


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def code_of(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


async def test_http_bad_input_has_a_reason(board: Board) -> None:
    await board.publish(step_event(1, 0.5))
    async with httpx.AsyncClient(base_url=board.base, timeout=60, headers=bearer(board.acme_key)) as http:
        for route, deep in (
            ("/v1/chat/completions", DEEP),
            ("/v1/completions", DEEP),
            ("/api/v1/stream-tokens", b"[" * 2000 + b"]" * 2000),  # within its 4 KiB, past json's recursion
        ):
            assert code_of(await http.post(route, content=deep)) == (400, "MALFORMED_REQUEST"), route
        big = b"x" * (5 * 1024 * 1024)
        assert code_of(await http.post("/v1/completions", content=big)) == (400, "PAYLOAD_TOO_LARGE")
        small_limit = json.dumps({"job": JOB, "pad": "x" * 5000}).encode()
        assert code_of(await http.post("/api/v1/stream-tokens", content=small_limit)) == (
            400,
            "PAYLOAD_TOO_LARGE",
        )
        events = f"/api/v1/{JOB}/events"
        for params, headers in (
            ({"after": "²"}, {}),  # str.isdigit() says yes, int() says no
            ({"after": "1" * 21}, {}),
            ({"after": str(2**64)}, {}),
            ({"heartbeat_s": "²"}, {}),
            ({"heartbeat_s": "-5"}, {}),
            ({}, {"Last-Event-ID": b"\xb2"}),  # not ASCII: a latin-1 superscript two
        ):
            got = await http.get(events, params=params, headers=headers)
            assert code_of(got) == (400, "INVALID_ARGUMENT"), (params, headers, got.text)
        raw = httpx.Headers([(b"Last-Event-ID", b"\xff\xfe")])
        got = await http.get(events, headers=raw)
        assert code_of(got) == (400, "INVALID_ARGUMENT"), got.text
    # gRPC: every 64-bit cursor is a cursor (past the newest event it lists nothing).
    for after, before in ((2**63, 0), (2**64 - 1, 0), (0, 2**63), (0, 2**64 - 1)):
        reply = await board.acme.ListEvents(pb.ListEventsRequest(job=JOB, after_seq=after, before_seq=before))
        assert [e.seq for e in reply.events] == ([1] if before else [])
        descending = pb.ListEventsRequest(job=JOB, after_seq=after, before_seq=before, descending=True)
        assert len((await board.acme.ListEvents(descending)).events) <= 1


def streaming_request(pieces: int, piece: bytes, declared: str = "") -> tuple[Request, list[int]]:
    """A real Starlette request whose body arrives in `pieces` pieces; `read` counts what was consumed."""
    read = [0]

    async def receive() -> dict[str, object]:
        read[0] += 1
        return {"type": "http.request", "body": piece, "more_body": read[0] < pieces}

    headers = [(b"content-length", declared.encode())] if declared else []
    return Request({"type": "http", "method": "POST", "headers": headers}, receive), read


async def test_a_body_is_refused_while_it_streams_in() -> None:
    request, read = streaming_request(pieces=1_000_000, piece=b"x" * 65536)  # 64 GB if read whole
    with pytest.raises(InvalidArgument) as caught:
        await read_body(request, 4 * 1024 * 1024)
    assert caught.value.reason_name == "PAYLOAD_TOO_LARGE" and read[0] == 65  # the limit and one piece more
    declared, read = streaming_request(pieces=10, piece=b"x", declared=str(10**12))
    with pytest.raises(InvalidArgument):
        await read_body(declared, 4096)
    assert read[0] == 0  # refused on its Content-Length, before reading
    fine, _ = streaming_request(pieces=3, piece=b"ab")
    assert await read_body(fine, 4096) == b"ababab"


def test_whole_numbers_are_ascii_digits_within_range() -> None:
    assert whole_number("0", "n") == 0 and whole_number(str(2**64 - 1), "n") == 2**64 - 1
    for text in ("", "²", "١٢", " 1", "+1", "-1", "1e3", str(2**64)):
        with pytest.raises(InvalidArgument):
            whole_number(text, "n")


async def test_a_deeply_nested_config_is_an_invalid_config(board: Board) -> None:
    deep = "x = " + "[" * 50_000 + "]" * 50_000 + "\n"
    for call in (
        board.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", rl_config_toml=deep)),
        board.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", spec=online_rl_spec(deep))),
    ):
        with pytest.raises(RpcError) as caught:
            await call
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert caught.value.reason in ("INVALID_CONFIG", "INVALID_JOB_SPEC")
        assert "nested too deeply" in caught.value.message


def online_rl_spec(toml: str) -> job_spec_pb2.JobSpec:
    task = job_spec_pb2.TaskSpec(name="train", kind=job_spec_pb2.TaskSpec.KIND_ONLINE_RL)
    task.online_rl.config_toml = toml
    return job_spec_pb2.JobSpec(tasks=[task])


async def test_another_orgs_task_app_answers_as_an_absent_one(board: Board) -> None:
    demo = (ROOT / "examples" / "jobs" / "demo.toml").read_text()
    answers = []
    for app in ("orgs/globex/taskApps/single-turn", "orgs/acme/taskApps/single-turn"):
        toml = demo.replace('name = "orgs/demo/taskApps/single-turn"', f'name = "{app}"')
        with pytest.raises(RpcError) as caught:
            await board.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", rl_config_toml=toml))
        answers.append((caught.value.code, caught.value.reason, caught.value.message.replace(app, "APP")))
    assert answers[0] == answers[1] and answers[0][:2] == (grpc.StatusCode.NOT_FOUND, "TASK_APP_NOT_FOUND")

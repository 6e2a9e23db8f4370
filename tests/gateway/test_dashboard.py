"""The gateway's dashboard in a real in-process mesh: its server-sent event stream (ids are event seqs,
`Last-Event-ID` resumes without repeats or gaps, heartbeats while idle, a missing or wrong credential is
401 and another organization's job 404), its JSON API, and the pages in a real headless browser (Debian's
chromium through selenium): the reward curve grows while `train.step` events are published, as a trainer
publishes them, and a `checkpoint.saved` event puts the checkpoint in the table.

The browser test skips where chromium, chromedriver or selenium are missing, and fails instead when `CI` is
set. `TANDEM_UPDATE_SCREENSHOT=1` writes its screenshot of the job page to docs/dashboard.png.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from tandem.events.v1 import event_pb2, events_service_pb2, events_service_pb2_grpc
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.gateway.v1 import gateway_service_pb2_grpc
from tandem.scheduler.v1 import job_pb2, job_spec_pb2

from gateway.orgs import ADMIN_KEY_FILE
from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from tests.support.mesh import mesh_settings, running_mesh

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
JOB = "orgs/acme/jobs/rl"


@dataclass
class Board:
    base: str  # http://host:port
    acme_key: str
    globex_key: str
    events: events_service_pb2_grpc.EventServiceStub
    acme: gateway_service_pb2_grpc.GatewayServiceStub

    async def publish(self, *events: event_pb2.Event, job: str = JOB) -> list[int]:
        reply = await self.events.Publish(events_service_pb2.PublishRequest(job=job, events=list(events)))
        return list(reply.seqs)


def step_event(step: int, reward: float) -> event_pb2.Event:
    event = event_pb2.Event(type="train.step", message=f"step {step}: reward {reward:.3f}")
    event.train_step.step = step
    event.train_step.weight_version = step
    event.train_step.metrics["reward/mean"] = reward
    event.train_step.metrics["loss"] = 1.0 / step
    event.train_step.metrics["kl"] = 0.01 * step
    return event


def saved_event(step: int) -> event_pb2.Event:
    event = event_pb2.Event(type="checkpoint.saved", message=f"checkpoint at step {step}")
    event.checkpoint_saved.checkpoint = f"{JOB}/checkpoints/step-{step}"
    event.checkpoint_saved.step = step
    event.checkpoint_saved.uri = f"file:///checkpoints/step-{step}"
    return event


@pytest.fixture
async def board(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Board]:
    monkeypatch.setenv("TANDEM_GATEWAY_HTTP_PORT", "0")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CPUS", "4")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__MEMORY_GIB", "8")
    monkeypatch.setenv("TANDEM_SCHEDULER_CANCEL_GRACE_S", "2")
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
            async with open_channel(mesh.address("gateway"), mesh.settings, token=acme.key) as acme_channel:
                yield Board(
                    info.openai_base_url.removesuffix("/v1"),
                    acme.key,
                    globex.key,
                    events_service_pb2_grpc.EventServiceStub(events_channel),
                    gateway_service_pb2_grpc.GatewayServiceStub(acme_channel),
                )


# ---- server-sent events over HTTP ---------------------------------------------------------------


class Sse:
    """Reads one text/event-stream response as (event, id, data) messages."""

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.aiter_lines()

    async def next(self) -> dict[str, str]:
        message: dict[str, str] = {}
        async for line in self._lines:
            if not line:
                if "data" in message:
                    return message
                message = {}
                continue
            name, _, value = line.partition(":")
            message[name] = value.removeprefix(" ")
        raise EOFError("the stream ended")

    async def events(self, count: int) -> list[dict[str, Any]]:
        """The next `count` event messages (heartbeats skipped), each data with its SSE id."""
        found: list[dict[str, Any]] = []
        while len(found) < count:
            message = await asyncio.wait_for(self.next(), 60)
            if message.get("event", "message") == "message":
                found.append({"sse_id": message["id"], **json.loads(message["data"])})
        return found


@contextlib.asynccontextmanager
async def stream(
    http: httpx.AsyncClient, path: str, **kwargs: Any
) -> AsyncIterator[tuple[httpx.Response, Sse]]:
    async with http.stream("GET", path, **kwargs) as response:
        yield response, Sse(response)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_the_event_stream_has_seq_ids_and_resumes_from_last_event_id(board: Board) -> None:
    first = await board.publish(step_event(1, 0.1), step_event(2, 0.2), saved_event(2))
    path = f"/api/v1/{JOB}/events"
    async with httpx.AsyncClient(base_url=board.base, timeout=60) as http:
        async with stream(http, path, headers=bearer(board.acme_key)) as (response, sse):
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            got = await sse.events(3)
            assert [int(e["sse_id"]) for e in got] == first
            assert [int(e["seq"]) for e in got] == first
            assert got[0]["train_step"]["metrics"]["reward/mean"] == 0.1
            assert got[2]["checkpoint_saved"]["checkpoint"] == f"{JOB}/checkpoints/step-2"
            live = await board.publish(step_event(3, 0.3))  # published while the stream is open
            assert [int(e["sse_id"]) for e in await sse.events(1)] == live
        # The connection dropped after the second event was seen; more were published meanwhile.
        later = await board.publish(step_event(4, 0.4), step_event(5, 0.5))
        resume = {**bearer(board.acme_key), "Last-Event-ID": str(first[1])}
        async with stream(http, path, headers=resume) as (response, sse):
            got = await sse.events(4)
            assert [int(e["sse_id"]) for e in got] == [first[2], *live, *later]  # no repeat, no gap
        # A cursor past the log's end is the events service's answer, as a `failure` message.
        ahead = {**bearer(board.acme_key), "Last-Event-ID": str(later[-1] + 100)}
        async with stream(http, path, headers=ahead) as (_, sse):
            failed = await asyncio.wait_for(sse.next(), 60)
            assert failed["event"] == "failure" and json.loads(failed["data"])["code"] == "CURSOR_AHEAD"
        # A new EventSource carries `?after=`; Last-Event-ID, when both are sent, wins.
        async with stream(http, path, headers=bearer(board.acme_key), params={"after": later[0]}) as (_, sse):
            assert [int(e["sse_id"]) for e in await sse.events(1)] == [later[1]]


async def test_an_idle_stream_sends_heartbeats_without_ids(board: Board) -> None:
    seqs = await board.publish(step_event(1, 0.5))
    async with (
        httpx.AsyncClient(base_url=board.base, timeout=60) as http,
        stream(http, f"/api/v1/{JOB}/events", headers=bearer(board.acme_key), params={"heartbeat_s": 1}) as (
            _,
            sse,
        ),
    ):
        assert [int(e["sse_id"]) for e in await sse.events(1)] == seqs
        beat = await asyncio.wait_for(sse.next(), 60)
        assert beat["event"] == "heartbeat" and "id" not in beat
        assert json.loads(beat["data"])["last_seq"] == seqs[0]


async def test_the_stream_refuses_missing_and_wrong_credentials_and_other_orgs(board: Board) -> None:
    await board.publish(step_event(1, 0.5))
    globex_seqs = await board.publish(step_event(1, 0.9), job="orgs/globex/jobs/rl")
    path = f"/api/v1/{JOB}/events"
    async with httpx.AsyncClient(base_url=board.base, timeout=60) as http:
        assert (await http.get(path)).status_code == 401
        wrong = await http.get(path, headers=bearer("tdm_000000000000_" + "x" * 43))
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "INVALID_CREDENTIALS"
        assert (await http.get(path, params={"token": "1.orgs/acme/apiKeys/x.00"})).status_code == 401
        other = await http.get(path, headers=bearer(board.globex_key))
        assert other.status_code == 404 and other.json()["error"]["code"] == "JOB_NOT_FOUND"
        absent = await http.get("/api/v1/orgs/acme/jobs/none/events", headers=bearer(board.acme_key))
        assert absent.status_code == 404
        for url in (f"/api/v1/{JOB}", f"/api/v1/{JOB}/checkpoints"):
            assert (await http.get(url)).status_code == 401
            assert (await http.get(url, headers=bearer(board.globex_key))).status_code == 404
        # Stream tokens: one job, one organization, checked against the job they were issued for.
        made = await http.post("/api/v1/stream-tokens", json={"job": JOB}, headers=bearer(board.acme_key))
        assert made.status_code == 200
        token = made.json()["token"]
        assert board.acme_key not in token
        async with stream(http, path, params={"token": token}) as (response, sse):
            assert response.status_code == 200 and len(await sse.events(1)) == 1
        refused = await http.post(
            "/api/v1/stream-tokens", json={"job": JOB}, headers=bearer(board.globex_key)
        )
        assert refused.status_code == 404
        assert (await http.post("/api/v1/stream-tokens", json={"job": JOB})).status_code == 401
        elsewhere = await http.get("/api/v1/orgs/globex/jobs/rl/events", params={"token": token})
        assert elsewhere.status_code == 401
        tampered = token[:-1] + ("0" if token[-1] != "0" else "1")
        assert (await http.get(path, params={"token": tampered})).status_code == 401
        # A revoked key opens no more streams, even with a token issued before.
        spare = await board.acme.CreateApiKey(pb.CreateApiKeyRequest(parent="orgs/acme", display_name="tab"))
        issued = await http.post("/api/v1/stream-tokens", json={"job": JOB}, headers=bearer(spare.key))
        spare_token = issued.json()["token"]
        async with stream(http, path, params={"token": spare_token}) as (response, _):
            assert response.status_code == 200
        await board.acme.RevokeApiKey(pb.RevokeApiKeyRequest(name=spare.api_key.name))
        assert (await http.get(path, params={"token": spare_token})).status_code == 401
        async with stream(http, "/api/v1/orgs/globex/jobs/rl/events", headers=bearer(board.globex_key)) as (
            response,
            sse,
        ):
            assert [int(e["sse_id"]) for e in await sse.events(1)] == globex_seqs


async def test_pages_and_the_json_api(board: Board) -> None:
    await board.publish(step_event(1, 0.5), saved_event(1))
    async with httpx.AsyncClient(base_url=board.base, timeout=60) as http:
        for path in ("/", "/jobs/rl"):
            page = await http.get(path)
            assert page.status_code == 200 and "/static/dashboard.js" in page.text
            assert "default-src 'none'" in page.headers["content-security-policy"]
            assert "http://" not in page.text and "https://" not in page.text  # nothing external
        script = await http.get("/static/dashboard.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        assert (await http.get("/static/..%2Fdashboard.py")).status_code == 404
        session = await http.get("/api/v1/session", headers=bearer(board.acme_key))
        assert session.json()["org"] == "acme"
        jobs = await http.get("/api/v1/jobs", headers=bearer(board.acme_key))
        assert jobs.status_code == 200 and jobs.json() == {"jobs": []}
        listed = await http.get(f"/api/v1/{JOB}/checkpoints", headers=bearer(board.acme_key))
        rows = listed.json()["checkpoints"]
        assert [(r["name"], r["step"], r["metrics"]["reward/mean"]) for r in rows] == [
            (f"{JOB}/checkpoints/step-1", 1, 0.5)
        ]


async def run_echo_job(board: Board) -> str:
    """A real job through the scheduler (a command task), run to its end; its name."""
    task = job_spec_pb2.TaskSpec(name="main", kind=job_spec_pb2.TaskSpec.KIND_COMMAND, run="echo hi")
    spec = job_spec_pb2.JobSpec(display_name="echo", tasks=[task])
    job = (await board.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", job_id="echo", spec=spec))).job
    async with httpx.AsyncClient(base_url=board.base, timeout=60) as http:
        while True:  # bounded by the test's timeout
            got = await http.get(f"/api/v1/{job.name}", headers=bearer(board.acme_key))
            assert got.status_code == 200, got.text
            if got.json()["job"]["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                return job.name
            await asyncio.sleep(0.2)


async def test_the_jobs_list_and_a_finished_jobs_stream(board: Board) -> None:
    name = await run_echo_job(board)
    async with httpx.AsyncClient(base_url=board.base, timeout=60) as http:
        jobs = (await http.get("/api/v1/jobs", headers=bearer(board.acme_key))).json()["jobs"]
        assert [(j["name"], j["id"], j["state"]) for j in jobs] == [(name, "echo", "SUCCEEDED")]
        assert jobs[0]["create_time"].endswith("Z") and jobs[0]["progress"] == {"tasks_done": 1, "tasks": 1}
        assert (await http.get("/api/v1/jobs", headers=bearer(board.globex_key))).json() == {"jobs": []}
        assert (await http.get(f"/api/v1/{name}", headers=bearer(board.globex_key))).status_code == 404
        # A finished job's stream replays its log, then says so and ends.
        async with stream(http, f"/api/v1/{name}/events", headers=bearer(board.acme_key)) as (_, sse):
            seen: list[int] = []
            while True:
                message = await asyncio.wait_for(sse.next(), 60)
                if message.get("event") == "end":
                    break
                if "id" in message:
                    seen.append(int(message["id"]))
            assert seen == sorted(set(seen)) and json.loads(message["data"])["state"] == "SUCCEEDED"
            assert json.loads(message["data"])["terminal_seq"] == seen[-1]


# ---- a real browser -------------------------------------------------------------------------------


def _browser_tools() -> tuple[str, str] | None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401, PLC0415
    except ImportError:
        return None
    return (chromium, driver) if chromium and driver else None


@pytest.fixture
def browser_tools() -> tuple[str, str]:
    tools = _browser_tools()
    if tools is None:
        message = (
            "the browser test needs chromium and chromedriver (apt-get install chromium chromium-driver)"
        )
        message += " and selenium (the dev extra)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return tools


@contextlib.contextmanager
def chrome(tools: tuple[str, str]) -> Iterator[Any]:
    from selenium import webdriver  # noqa: PLC0415
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415

    options = webdriver.ChromeOptions()
    options.binary_location = tools[0]
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1100,900",
        "--no-first-run",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=tools[1]))
    try:
        yield driver
    finally:
        driver.quit()


async def test_the_job_page_draws_curves_and_lists_checkpoints_in_a_browser(
    board: Board, browser_tools: tuple[str, str], tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By  # noqa: PLC0415
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    # A running job the scheduler owns (its state events are in its log), whose trainer we play.
    sleeper = job_spec_pb2.TaskSpec(name="trainer", kind=job_spec_pb2.TaskSpec.KIND_COMMAND, run="sleep 120")
    spec = job_spec_pb2.JobSpec(display_name="rl", tasks=[sleeper])
    await board.acme.CreateJob(pb.CreateJobRequest(parent="orgs/acme", job_id="rl", spec=spec))
    while True:  # bounded by the test's timeout
        if (await board.acme.GetJob(pb.GetJobRequest(name=JOB))).job.state == job_pb2.Job.STATE_RUNNING:
            break
        await asyncio.sleep(0.2)
    await board.publish(*(step_event(s, 0.1 * s) for s in (1, 2, 3)))

    def points(driver: Any) -> int:
        value = driver.find_element(By.ID, "chart-reward").get_attribute("data-points")
        return int(value or 0)

    def checkpoint_rows(driver: Any) -> list[str]:
        return [row.text for row in driver.find_elements(By.CSS_SELECTOR, "#checkpoints tbody tr")]

    def log_lines(driver: Any) -> list[str]:
        return [li.text for li in driver.find_elements(By.CSS_SELECTOR, "#events li")]

    def text(driver: Any, element: str) -> str:
        return str(driver.find_element(By.ID, element).text)

    try:
        with chrome(browser_tools) as driver:
            wait = WebDriverWait(driver, 60)

            def sign_in() -> None:
                driver.get(board.base + "/jobs/rl")
                key = wait.until(
                    lambda d: (
                        d.find_element(By.ID, "key") if d.find_element(By.ID, "key").is_displayed() else None
                    )
                )
                key.send_keys(board.acme_key)
                driver.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
                wait.until(lambda d: points(d) == 3)

            await asyncio.to_thread(sign_in)
            assert await asyncio.to_thread(text, driver, "job-state") == "RUNNING"
            # The trainer goes on: the curve grows while the page is open.
            for step in (4, 5, 6, 7):
                await board.publish(step_event(step, 0.1 * step + (0.05 if step % 2 else 0.0)))
            await asyncio.to_thread(wait.until, lambda d: points(d) == 7)
            assert await asyncio.to_thread(checkpoint_rows, driver) == []
            await board.publish(saved_event(7))
            rows = await asyncio.to_thread(wait.until, lambda d: checkpoint_rows(d) or None)
            assert rows[0].startswith("step-7 7 ")
            lines = await asyncio.to_thread(log_lines, driver)
            assert sum("train.step" in line for line in lines) == 7 and "checkpoint.saved" in lines[-1]
            assert any(line.endswith("job.state_changed job RUNNING") for line in lines)  # the scheduler's
            await asyncio.to_thread(wait.until, lambda d: text(d, "stream-state").startswith("live"))
            shot = tmp_path / "dashboard.png"
            await asyncio.to_thread(driver.save_screenshot, str(shot))
            # Reloading the tab keeps the session (sessionStorage) and replays the log once, not twice.
            await asyncio.to_thread(driver.refresh)
            await asyncio.to_thread(wait.until, lambda d: points(d) == 7)
            assert await asyncio.to_thread(log_lines, driver) == lines

            # The jobs list shows the job with its state.
            def jobs_list() -> list[str]:
                driver.get(board.base + "/")
                return wait.until(
                    lambda d: [r.text for r in d.find_elements(By.CSS_SELECTOR, "#jobs tbody tr")] or None
                )

            listed = await asyncio.to_thread(jobs_list)
            assert listed[0].startswith("rl RUNNING ") and listed[0].endswith("0/1 tasks done")
    finally:
        await board.acme.CancelJob(pb.CancelJobRequest(name=JOB))
    assert shot.stat().st_size > 0
    if os.environ.get("TANDEM_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "dashboard.png")

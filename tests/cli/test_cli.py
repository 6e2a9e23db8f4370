"""The `tandem` command line as a user runs it: real processes against a real in-process mesh behind the
gateway. `--help` teaches every subcommand, every read prints JSON that parses with `--json`, failures print
the reason and what to do (never a traceback), and `events watch` follows a job across a gateway restart and
Ctrl-C without repeating or missing an event."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tandem.common.v1 import types_pb2
from tandem.events.v1 import event_pb2, events_service_pb2_grpc
from tandem.events.v1 import events_service_pb2 as events_pb
from tandem.scheduler.v1 import job_pb2, job_spec_pb2

from gateway.cli import FAILURE_WIDTH, _cell, _table, build_parser, main
from mesh.clients import open_channel
from mesh.identity import TokenSigner, load_signing_key
from mesh.settings import Settings
from tandem_client import AsyncClient
from tests.support.mesh import Mesh, mesh_settings, running_mesh
from tests.support.taskapps import example_app_in_thread

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
JOB = "orgs/acme/jobs/watched"

COMMANDS = [
    [],
    ["up"],
    ["status"],
    ["demo"],
    ["orgs"],
    ["orgs", "create"],
    ["orgs", "show"],
    ["secrets"],
    ["secrets", "put"],
    ["secrets", "list"],
    ["taskapp"],
    ["taskapp", "serve"],
    ["taskapp", "check"],
    ["taskapp", "register"],
    ["taskapp", "list"],
    ["rl"],
    ["rl", "start"],
    ["rl", "status"],
    ["rl", "list"],
    ["rl", "cancel"],
    ["rl", "logs"],
    ["rl", "replay"],
    ["launch"],
    ["queue"],
    ["logs"],
    ["cancel"],
    ["events"],
    ["events", "watch"],
    ["checkpoints"],
    ["checkpoints", "list"],
    ["infer"],
    ["infer", "list"],
    ["infer", "stop"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "tandem")
def test_every_subcommand_has_help_with_examples(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: tandem")
    assert "tandem " in text.split("usage:", 1)[1].split("\n", 2)[-1]  # an example beyond the usage line
    tools = (["taskapp", "serve"], ["taskapp", "check"])
    if len(command) == 2 and command not in tools:
        assert "--gateway" in text and "--json" in text


def test_a_table_keeps_one_row_per_item(capsys: pytest.CaptureFixture[str]) -> None:
    failure = "task main exited with 1\nTraceback (most recent call last):\n  File ...\nValueError: x"
    _table(
        [
            ["orgs/acme/jobs/a", "FAILED", _cell(failure, FAILURE_WIDTH)],
            ["orgs/acme/jobs/b", "FAILED", _cell("x" * 300, FAILURE_WIDTH)],
            ["orgs/acme/jobs/c", "RUNNING", "a\nmultiline\ncell"],
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].endswith("task main exited with 1 …")
    assert lines[1].endswith("x" * FAILURE_WIDTH + " …")
    assert lines[2].endswith("RUNNING  a …")


def test_the_parser_knows_every_command() -> None:
    parser = build_parser()
    assert parser.parse_args(["events", "watch", "demo", "--after-seq", "7"]).after_seq == 7
    assert parser.parse_args(["taskapp", "serve", "app.py", "--port", "8001"]).rest == [
        "app.py",
        "--port",
        "8001",
    ]


@dataclass
class Cli:
    gateway: str
    state_dir: Path
    key: str = ""

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        # this checkout's code and its generated contracts, whatever the environment installed
        path = os.pathsep.join([str(ROOT), str(ROOT / "gen" / "python")])
        env.update({"TANDEM_GATEWAY": self.gateway, "PYTHONPATH": path, **extra})
        if self.key:
            env["TANDEM_API_KEY"] = self.key
        return env

    async def start(self, *args: str, stdin: bytes | None = None, **env: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway.cli",
            *args,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env(**env),
            cwd=ROOT,
        )

    async def run(self, *args: str, stdin: bytes | None = None, **env: str) -> tuple[int, str, str]:
        process = await self.start(*args, stdin=stdin, **env)
        out, err = await asyncio.wait_for(process.communicate(stdin), 60)
        assert process.returncode is not None
        return process.returncode, out.decode(), err.decode()


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    async with running_mesh(mesh_settings(tmp_path)) as running:
        yield running


@pytest.fixture
async def cli(mesh: Mesh) -> Cli:
    tool = Cli(mesh.address("gateway"), mesh.settings.state_dir)
    code, out, err = await tool.run("orgs", "create", "acme", "--state-dir", str(tool.state_dir), "--json")
    assert code == 0, err
    tool.key = json.loads(out)["key"]
    return tool


def assert_clean_error(code: int, err: str, *fragments: str) -> None:
    assert code == 1
    assert "Traceback" not in err
    assert err.startswith("error: ")
    for fragment in fragments:
        assert fragment in err, err


async def test_reads_print_json(cli: Cli) -> None:
    code, out, err = await cli.run("secrets", "put", "env-key", "--json", stdin=b"a-secret-value\n")
    assert code == 0, err
    assert json.loads(out)["secret"] == "orgs/acme/secrets/env-key"
    assert "a-secret-value" not in out + err
    for command in (
        ["orgs", "show"],
        ["secrets", "list"],
        ["taskapp", "list"],
        ["rl", "list"],
        ["checkpoints", "list", "no-such-job"],
    ):
        code, out, err = await cli.run(*command, "--json")
        assert "Traceback" not in err
        if code == 0:
            json.loads(out)
    code, out, _ = await cli.run("secrets", "list", "--json")
    assert [row["secret"] for row in json.loads(out)] == ["orgs/acme/secrets/env-key"]
    code, out, _ = await cli.run("orgs", "show", "--json")
    assert json.loads(out)["name"] == "orgs/acme"


async def test_errors_print_the_reason_and_what_to_do(cli: Cli, tmp_path: Path) -> None:
    code, _, err = await cli.run("rl", "status", "no-such-job")
    assert_clean_error(code, err, "JOB_NOT_FOUND", "tandem rl list")
    anonymous = Cli(cli.gateway, cli.state_dir)
    code, _, err = await anonymous.run("secrets", "list")
    assert_clean_error(code, err, "MISSING_CREDENTIALS", "TANDEM_API_KEY")
    nowhere = Cli("127.0.0.1:1", cli.state_dir, key="tdm_x")
    code, _, err = await nowhere.run("rl", "list")
    assert_clean_error(code, err, "tandem up", "127.0.0.1:1")
    code, _, err = await cli.run("rl", "start", str(tmp_path / "missing.toml"))
    assert_clean_error(code, err, "cannot read")
    code, _, err = await cli.run("secrets", "put", "env-key", stdin=b"")
    assert_clean_error(code, err, "empty")
    code, _, err = await cli.run("orgs", "create", "other", "--state-dir", str(tmp_path / "elsewhere"))
    assert_clean_error(code, err, "admin credential")


# ---- events watch ------------------------------------------------------------------------------------------


async def publisher(settings: Settings, address: str) -> tuple[Any, Any]:
    token = TokenSigner(load_signing_key("", settings.state_dir)).issue("service", "scheduler")
    channel = open_channel(address, settings, token=token)
    return channel, events_service_pb2_grpc.EventServiceStub(channel)


def step(n: int, reward: float) -> event_pb2.Event:
    event = event_pb2.Event(type="train.step", message=f"step {n}")
    event.train_step.step = n
    event.train_step.metrics["reward/mean"] = reward
    event.train_step.metrics["loss"] = -0.01 * n
    return event


def state(new: Any, old: Any = 0) -> event_pb2.Event:
    return event_pb2.Event(
        type="job.state_changed", job_state_changed=event_pb2.JobStateChanged(state=new, previous_state=old)
    )


async def read_json_lines(stream: asyncio.StreamReader, count: int, into: list[dict[str, object]]) -> None:
    while len(into) < count:
        line = await asyncio.wait_for(stream.readline(), 30)
        assert line, "the watch ended early"
        into.append(json.loads(line))


async def test_events_watch_shows_progress_and_the_end(cli: Cli, mesh: Mesh) -> None:
    channel, events = await publisher(mesh.settings, mesh.address("events"))
    await events.Publish(
        events_pb.PublishRequest(
            job=JOB,
            events=[
                state(job_pb2.Job.STATE_RUNNING, job_pb2.Job.STATE_STARTING),
                step(1, 0.25),
                step(2, 0.5),
                event_pb2.Event(type="log", message="rollouts are slow", level=types_pb2.LEVEL_WARNING),
            ],
        )
    )
    await events.CloseJobStream(
        events_pb.CloseJobStreamRequest(
            job=JOB,
            state_changed=event_pb2.JobStateChanged(
                state=job_pb2.Job.STATE_SUCCEEDED, previous_state=job_pb2.Job.STATE_RUNNING
            ),
        )
    )
    code, out, err = await cli.run("events", "watch", "watched")
    assert code == 0, err
    assert "job RUNNING (was STARTING)" in out
    assert "step 2" in out and "reward 0.500" in out and "loss -0.0200" in out
    assert "warning: rollouts are slow" in out
    assert "ended SUCCEEDED" in out
    code, out, err = await cli.run("events", "watch", "watched", "--json", "--after-seq", "2")
    assert code == 0, err
    assert [json.loads(line)["seq"] for line in out.splitlines()] == ["3", "4", "5"]
    await channel.close()


async def test_events_watch_resumes_across_a_gateway_restart_and_ctrl_c(tmp_path: Path) -> None:
    settings = mesh_settings(tmp_path)
    seen: list[dict[str, object]] = []
    async with running_mesh(settings) as first:
        tool = Cli(first.address("gateway"), settings.state_dir)
        code, out, err = await tool.run(
            "orgs", "create", "acme", "--state-dir", str(settings.state_dir), "--json"
        )
        assert code == 0, err
        tool.key = json.loads(out)["key"]
        channel, events = await publisher(settings, first.address("events"))
        await events.Publish(events_pb.PublishRequest(job=JOB, events=[step(n, 0.1) for n in range(1, 4)]))
        watch = await tool.start("events", "watch", "watched", "--json")
        assert watch.stdout is not None and watch.stderr is not None
        await read_json_lines(watch.stdout, 3, seen)
        await channel.close()
    # The whole mesh, gateway included, is down; it comes back on the same ports with its state.
    async with running_mesh(settings) as second:
        assert second.address("gateway") == tool.gateway
        channel, events = await publisher(settings, second.address("events"))
        await events.Publish(events_pb.PublishRequest(job=JOB, events=[step(n, 0.2) for n in range(4, 7)]))
        await read_json_lines(watch.stdout, 6, seen)
        watch.send_signal(signal.SIGINT)
        _, err_bytes = await asyncio.wait_for(watch.communicate(), 30)
        err = err_bytes.decode()
        assert watch.returncode == 130
        assert "Traceback" not in err
        assert "connection lost" in err
        assert f"tandem events watch {JOB} --after-seq 6" in err
        assert [int(str(e["seq"])) for e in seen] == [1, 2, 3, 4, 5, 6]

        # Resuming from the printed cursor continues with the next event and nothing before it.
        await events.Publish(events_pb.PublishRequest(job=JOB, events=[step(7, 0.3)]))
        await events.CloseJobStream(
            events_pb.CloseJobStreamRequest(
                job=JOB, state_changed=event_pb2.JobStateChanged(state=job_pb2.Job.STATE_SUCCEEDED)
            )
        )
        code, out, err = await tool.run("events", "watch", "watched", "--json", "--after-seq", "6")
        assert code == 0, err
        assert [json.loads(line)["seq"] for line in out.splitlines()] == ["7", "8"]
        await channel.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_the_demo_runs_end_to_end(tmp_path: Path) -> None:
    """On the default settings: as root with bubblewrap the demo's tasks run as its organization's own user,
    so the model folder lies where other users may read it (pytest's own folder is private)."""
    state = tmp_path / "demo"
    shared = Path(tempfile.mkdtemp(prefix="tandem-demo-model-"))
    os.chmod(shared, 0o755)  # noqa: S103 - the model is for every user to read
    process = await Cli("unused:1", state).start(
        "demo", "--steps", "2", "--state-dir", str(state), "--model-dir", str(shared / "model")
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 580)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    text = out.decode()
    assert process.returncode == 0, text + err.decode()
    assert "Traceback" not in text + err.decode()
    for fragment in (
        "orgs/demo, first API key tdm_",
        "orgs/demo/secrets/single-turn-key version 1",
        "2/2  reward",  # the trainer's train.step events, in the job's own stream
        "checkpoint step-2 saved at step 2",
        "orgs/demo/jobs/demo ended SUCCEEDED",
        "   step-2  step 2  reward",  # ListCheckpoints
        "(from orgs/demo/jobs/demo/checkpoints/step-2)",  # Infer on it
        "reward.png",
    ):
        assert fragment in text, text
    assert "serving the example Task App from this machine instead" not in text  # the managed app ran


async def test_task_apps_and_jobs_from_the_cli(cli: Cli, tmp_path: Path) -> None:
    key = "env-key-value-0123456789"
    code, _, err = await cli.run("secrets", "put", "app-key", stdin=key.encode())
    assert code == 0, err
    with example_app_in_thread(key) as url:
        code, out, err = await cli.run("taskapp", "register", "single-turn", url, "--secret", "app-key")
        assert code == 0, err
        assert f"registered orgs/acme/taskApps/single-turn at {url}" in out
        assert "pass" in out and "FAIL" not in out
        code, out, err = await cli.run("taskapp", "list", "--json")
        assert code == 0, err
        assert [app["name"] for app in json.loads(out)] == ["orgs/acme/taskApps/single-turn"]

        config = (ROOT / "examples" / "jobs" / "demo.toml").read_text().replace("orgs/demo/", "orgs/acme/")
        (tmp_path / "job.toml").write_text(config)
        code, out, err = await cli.run("rl", "start", str(tmp_path / "job.toml"), "--validate-only", "--json")
        assert code == 0, err
        assert json.loads(out)["spec"]["tasks"][0]["kind"] == "KIND_ONLINE_RL"
        code, out, err = await cli.run("rl", "list", "--json")
        assert code == 0, err
        assert json.loads(out) == []  # validate-only stored nothing
    (tmp_path / "bad.toml").write_text("[algorithm]\nsteps = -1\n")
    code, _, err = await cli.run("rl", "start", str(tmp_path / "bad.toml"))
    assert_clean_error(code, err, "INVALID")
    code, _, err = await cli.run("infer", "no-such-job", "hello")
    assert_clean_error(code, err, "JOB_NOT_FOUND")
    code, out, err = await cli.run("infer", "list")
    assert (code, out.strip()) == (0, "no inference workers running"), err
    code, out, err = await cli.run("infer", "list", "--json")
    assert (code, json.loads(out)) == (0, []), err
    code, _, err = await cli.run("infer", "stop", "no-such-job")
    assert_clean_error(code, err, "JOB_NOT_FOUND")

    async with AsyncClient(cli.gateway, api_key=cli.key) as client:
        task = job_spec_pb2.TaskSpec(
            name="main", kind=job_spec_pb2.TaskSpec.KIND_COMMAND, run="echo hello-logs"
        )
        await client.create_job(spec=job_spec_pb2.JobSpec(tasks=[task]), job_id="echo")
    code, out, err = await cli.run("events", "watch", "echo")
    assert code == 0, err
    code, out, err = await cli.run("rl", "logs", "echo", "--task", "main")
    assert code == 0, err
    assert "hello-logs" in out
    code, out, err = await cli.run("rl", "logs", "echo", "--json")
    assert code == 0, err
    assert "hello-logs" in "".join(json.loads(line)["data"] for line in out.splitlines())

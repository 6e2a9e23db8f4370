"""`tandem demo`: the whole flow of a Tandem user on this machine, through the public API only.

It starts the mesh in this process (every service on free loopback ports, state in a fresh folder), then
does what a user does with the SDK against its gateway: creates an organization with the deployment's
admin key, seals and uploads the Task App's environment key, submits the online-RL job of
`examples/jobs/demo.toml` (the single-turn "copy the letter" task), follows its progress live until it
ends, lists its checkpoints, asks the newest one a held-out prompt and prints where the reward plot is. A
step the deployment cannot do yet is reported as such, with the gateway's reason, and the demo goes on
where it can.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import secrets
import signal
import socket
import sys
import time
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from tandem.scheduler.v1 import job_pb2, job_spec_pb2
from tandem.trainer.v1 import checkpoint_pb2

from mesh.launcher import MESH_SERVICES
from mesh.observability import configure_logging
from mesh.server import RunningService, serve
from mesh.settings import Ports, Settings
from mesh.status import RpcError
from tandem_client import AsyncClient, Cursor

ORG = "demo"
JOB_ID = "demo"
APP_ID = "single-turn"
KEY_SECRET = "single-turn-key"  # noqa: S105 - the secret's id, not a value
HELD_OUT_SEED = 10_000_001  # the config trains on seeds 0..9999
JOB_TIMEOUT_S = 3600.0
INFER_WAIT_S = 300.0
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SUCCEEDED = job_pb2.Job.STATE_SUCCEEDED
FINISHED = (job_pb2.Job.STATE_SUCCEEDED, job_pb2.Job.STATE_FAILED, job_pb2.Job.STATE_CANCELLED)
STOP_WAIT_S = 30.0  # for the demo's remaining jobs to end once cancelled


def say(text: str) -> None:
    print(text, flush=True)


def unsupported(what: str, error: RpcError) -> None:
    say(
        f"   not available on this deployment yet: {what} ({error.reason or error.code.name}: {error.message})"
    )


@contextlib.asynccontextmanager
async def local_mesh(settings: Settings) -> AsyncIterator[dict[str, str]]:
    """Every service in this event loop; yields their addresses. The caller owns SIGINT and SIGTERM: Ctrl-C
    cancels the demo, which cancels its job, and the mesh stops only once the demo has left this block (were
    the mesh to take the signal itself, it would drain under a demo still waiting on it)."""
    ready: asyncio.Future[list[RunningService]] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(
        serve(MESH_SERVICES, settings, on_ready=ready.set_result, stop_event=stop, handle_signals=False)
    )
    waiting: list[asyncio.Future[Any]] = [task, ready]
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # startup failed: raise its error
    try:
        yield {service.name: service.address for service in ready.result()}
    finally:
        stop.set()
        await task


def demo_config(path: Path, *, steps: int, model_dir: Path) -> str:
    """The config with the demo organization's Task App and an absolute model folder (the trainer runs in
    its own working folder under the scheduler)."""
    text = path.read_text()
    replacements = {
        r"^name = \"orgs/[a-z0-9-]+/taskApps/": f'name = "orgs/{ORG}/taskApps/',
        r"^dir = .*$": f'dir = "{model_dir}"',
    }
    if steps:
        replacements[r"^steps = .*$"] = f"steps = {steps}"
    for pattern, value in replacements.items():
        text = re.sub(pattern, value, text, count=1, flags=re.MULTILINE)
    return text


def build_model(config_toml: str) -> Path:
    """The policy's folder, built here (by whoever runs the demo) before the job starts: the trainer, which
    may run as the organization's own user, only reads it. Mounted read-only into the trainer's task."""
    from tandem_jobs.config import parse_job  # noqa: PLC0415
    from trainer.models import ensure_model  # noqa: PLC0415

    return ensure_model(parse_job(tomllib.loads(config_toml)).model)


def demo_spec(config_toml: str) -> job_spec_pb2.JobSpec:
    """The job group: the example Task App as an auxiliary service task the scheduler registers, and the
    online-RL trainer."""
    script = EXAMPLES / "taskapps" / "single_turn.py"
    serve_app = f'exec "{sys.executable}" -m tandem_taskapp.serve "{script}" --port "$TANDEM_SERVICE_PORT"'
    app = job_spec_pb2.TaskSpec(
        name="task-app",
        kind=job_spec_pb2.TaskSpec.KIND_SERVICE,
        role=job_spec_pb2.TaskSpec.ROLE_AUXILIARY,
        run=serve_app,
        secrets=[job_spec_pb2.SecretBinding(secret=KEY_SECRET, env="ENVIRONMENT_API_KEY")],
        service=job_spec_pb2.ServiceOptions(
            port=_free_port(),
            health_path="/health",
            register_task_app=job_spec_pb2.TaskAppRegistration(app_id=APP_ID, api_key_secret=KEY_SECRET),
        ),
    )
    model_dir = str(Path(tomllib.loads(config_toml)["model"]["dir"]).absolute())
    trainer = job_spec_pb2.TaskSpec(
        name="trainer",
        kind=job_spec_pb2.TaskSpec.KIND_ONLINE_RL,
        online_rl=job_spec_pb2.OnlineRlOptions(config_toml=config_toml),
        file_mounts=[job_spec_pb2.FileMount(path=model_dir, local_path=model_dir, read_only=True)],
    )
    return job_spec_pb2.JobSpec(display_name="tandem demo", tasks=[app, trainer])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def held_out_prompt() -> str:
    """The prompt the example Task App would show for a seed outside the training range."""
    from importlib import util  # noqa: PLC0415

    script = EXAMPLES / "taskapps" / "single_turn.py"
    spec = util.spec_from_file_location("single_turn_example", script)
    if spec is None or spec.loader is None:
        return "Copy this letter: C"
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prompt: str = module.task_info(HELD_OUT_SEED)["instance"]["prompt"]
    return prompt


async def run_demo(args: argparse.Namespace) -> int:
    root = Path(args.state_dir) if args.state_dir else Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    state_dir = root.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    settings = Settings(
        state_dir=state_dir, ports=Ports(gateway=0, vault=0, scheduler=0, taskapp_proxy=0, events=0)
    )
    configure_logging(settings.log_level, settings.log_format, stream=(state_dir / "tandem.log").open("a"))
    main = asyncio.current_task()
    if main is not None:  # SIGTERM ends the demo as Ctrl-C does: its job cancelled, then the mesh stopped
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)

    say(f"1. Starting the Tandem mesh in this process (state and logs in {state_dir}) ...")
    async with local_mesh(settings) as addresses:
        gateway = addresses["gateway"]
        say(
            f"   gateway at {gateway}; the other services behind it: "
            + ", ".join(f"{k} {v}" for k, v in addresses.items() if k != "gateway")
        )
        say(f"2. Creating the organization `{ORG}` with the deployment's admin key ...")
        admin = (state_dir / "admin.key").read_text().strip()
        async with AsyncClient(gateway, api_key="") as anonymous:
            created = await anonymous.create_org(ORG, admin_credential=admin, display_name="Tandem demo")
        key_file = state_dir / "demo-api-key"
        key_file.touch(mode=0o600)
        key_file.write_text(created.key + "\n")
        say(
            f"   {created.org.name}, first API key {created.api_key.key_prefix}... (in {key_file}, mode 0600)"
        )
        async with (
            AsyncClient(gateway, api_key=created.key, org=ORG) as client,
            contextlib.AsyncExitStack() as stack,  # what the demo starts beside the mesh
        ):
            watch_env = f"TANDEM_GATEWAY={gateway} TANDEM_API_KEY=$(cat {key_file})"
            try:
                job_name = await _start(client, args, watch_env, stack)
                cursor = await _follow(client, job_name)
                checkpoints = await _checkpoints(client, job_name)
                await _infer(client, job_name)
                _plot(state_dir, checkpoints)
            finally:
                await _stop_jobs(client)
    return 0 if cursor.terminal_state == SUCCEEDED else 1


async def _stop_jobs(client: AsyncClient) -> None:
    """Cancel whatever the demo's organization still runs (the inference worker the gateway started for the
    checkpoint) and wait for it to end, so the demo leaves no process behind when its mesh stops."""
    active = [j for j in await client.list_jobs() if j.state not in FINISHED]
    for job in active:
        with contextlib.suppress(RpcError):
            await client.cancel_job(job.name, reason="tandem demo is done")
    deadline = time.monotonic() + STOP_WAIT_S
    while active and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        active = [j for j in await client.list_jobs() if j.state not in FINISHED]


async def _start(
    client: AsyncClient, args: argparse.Namespace, environment: str, stack: contextlib.AsyncExitStack
) -> str:
    from gateway.progress import job_state  # noqa: PLC0415

    say(f"3. Sealing the Task App's environment key on this machine and uploading it as `{KEY_SECRET}` ...")
    env_key = secrets.token_urlsafe(24)
    stored = await client.put_secret(KEY_SECRET, env_key)
    say(f"   {stored.secret.name} version {stored.version.version}, fingerprint {stored.version.fingerprint}")

    config_path = Path(args.config) if args.config else EXAMPLES / "jobs" / "demo.toml"
    model_dir = Path.cwd() / args.model_dir  # absolute: the trainer runs in a folder of its own
    config = demo_config(config_path, steps=args.steps, model_dir=model_dir)
    await asyncio.to_thread(build_model, config)
    say(
        f"4. Starting the online RL job from {config_path}, with the example single-turn Task App beside it as"
        f" a managed Task App (the scheduler serves it with `{KEY_SECRET}` and registers it as"
        f" orgs/{ORG}/taskApps/{APP_ID} once it is healthy) ..."
    )
    try:
        job = await client.create_job(spec=demo_spec(config), job_id=JOB_ID)
    except RpcError as error:
        if error.reason != "TASK_APP_NOT_FOUND":
            raise
        unsupported("a job group whose own service task registers its Task App", error)
        say(
            "   serving the example Task App from this machine instead, and registering it through the gateway:"
        )
        url = await stack.enter_async_context(example_app(env_key))
        checked = await client.register_task_app(APP_ID, url, secret=KEY_SECRET)
        passed = sum(r.passed for r in checked.check_results)
        say(f"   {checked.task_app.name} at {url}: {passed}/{len(checked.check_results)} checks passed")
        job = await client.create_job(rl_config_toml=config, job_id=JOB_ID)
    del env_key
    say(f"   {job.name} is {job_state(job.state)}; the same view from another terminal:")
    say(f"   {environment} tandem events watch {JOB_ID}")
    return job.name


@contextlib.asynccontextmanager
async def example_app(env_key: str) -> AsyncIterator[str]:
    """The example single-turn Task App in a child process (`tandem taskapp serve`), the key on its stdin."""
    port = _free_port()
    script = EXAMPLES / "taskapps" / "single_turn.py"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tandem_taskapp.serve",
        str(script),
        "--port",
        str(port),
        "--key-from-stdin",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert process.stdin is not None
    process.stdin.write(env_key.encode() + b"\n")
    await process.stdin.drain()
    process.stdin.close()
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=2.0) as http:
            for _ in range(150):
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get("/health")).status_code == httpx.codes.OK:
                        break
                if process.returncode is not None:
                    raise RuntimeError(f"the example Task App exited with {process.returncode}")
                await asyncio.sleep(0.2)
            else:
                raise RuntimeError(f"the example Task App at {url} did not become healthy within 30 s")
        yield url
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()


async def _follow(client: AsyncClient, job_name: str) -> Cursor:
    from gateway.progress import ProgressView, job_state, total_steps  # noqa: PLC0415

    say("5. Live progress (the job's events, and the trainer's step lines from its log):")
    cursor = Cursor()
    view = ProgressView(sys.stdout, tty=sys.stdout.isatty())
    view.total = total_steps(await client.get_job(job_name))
    steps: list[int] = []
    log = asyncio.create_task(_trainer_log(client, job_name, view, steps))
    try:
        async with asyncio.timeout(JOB_TIMEOUT_S):
            async for event in client.watch_events(job_name, cursor=cursor):
                if event.WhichOneof("core") == "train_step":
                    steps.append(event.train_step.step)
                view.show(event)
    except (KeyboardInterrupt, asyncio.CancelledError):
        view.finish()
        say(f"   interrupted; cancelling {job_name} ...")
        with contextlib.suppress(RpcError):
            await client.cancel_job(job_name, reason="tandem demo interrupted")
        raise
    finally:
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, RpcError):
            await asyncio.wait_for(log, 10)  # the rest of the log, up to its end
    view.finish()
    say(f"   {job_name} ended {job_state(cursor.terminal_state)}")
    if not steps:
        say(
            "   (no train.step event reached the job's event stream: under the scheduler the trainer still"
            " publishes its events to the services it starts for itself, so the steps above come from its log)"
        )
    final = await client.get_job(job_name)
    if final.failure.message:
        say(f"   failure: {final.failure.message}")
    return cursor


async def _trainer_log(client: AsyncClient, job_name: str, view: Any, steps: list[int]) -> None:
    """Follow the trainer task's log through the gateway and show its step and summary lines while no
    train.step event arrives; retried from the last offset until the log is complete."""
    offset, pending = 0, b""
    while True:
        try:
            async for piece in client.stream_job_logs(job_name, task="trainer", offset=offset, follow=True):
                offset = piece.next_offset
                lines = (pending + piece.data).split(b"\n")
                pending = lines.pop()
                for raw in lines:
                    line = raw.decode(errors="replace").strip()
                    if not steps and line.startswith(("step ", "done:")):
                        view.note(f"   trainer | {line}")
                if piece.end_of_log:
                    return
        except RpcError:
            pass  # the task has no log yet, or the stream dropped: ask again from the offset reached
        await asyncio.sleep(0.5)


async def _checkpoints(client: AsyncClient, job_name: str) -> list[checkpoint_pb2.Checkpoint]:
    say("6. Checkpoints:")
    checkpoints: list[checkpoint_pb2.Checkpoint] = []
    try:
        checkpoints = await client.list_checkpoints(job_name)
    except RpcError as error:
        unsupported("listing checkpoints", error)
    for checkpoint in checkpoints:
        reward = checkpoint.metrics.get("reward/mean")
        say(
            f"   {checkpoint.name.rsplit('/', 1)[-1]}  step {checkpoint.step}"
            + (f"  reward {reward:.3f}" if reward is not None else "")
            + f"  {checkpoint.uri}"
        )
    if not checkpoints:
        say(
            "   none listed by the gateway: the job announced no checkpoint.saved event (a job that failed"
            " before its first checkpoint)"
        )
    return checkpoints


async def _infer(client: AsyncClient, job_name: str) -> None:
    prompt = held_out_prompt()
    say(f"7. Asking the newest checkpoint a held-out prompt: {prompt!r}")
    try:
        answer = await client.infer(
            job_name,
            messages=[("user", prompt)],
            max_tokens=1,
            temperature=0.0,
            wait_s=INFER_WAIT_S,
            on_wait=lambda _: say("   waiting for an inference worker to load the checkpoint ..."),
        )
        say(f"   answer: {answer.text!r} (from {answer.model})")
    except RpcError as error:
        unsupported("inference on a checkpoint", error)


def _plot(state_dir: Path, checkpoints: list[checkpoint_pb2.Checkpoint]) -> None:
    say("8. The reward plot:")
    plots = [
        Path(c.uri.removeprefix("file://")).parent / "reward.png"
        for c in checkpoints[:1]
        if c.uri.startswith("file://")
    ]
    plots += sorted(state_dir.glob("scheduler/jobs/*/trainer/output/checkpoints/reward.png"))
    found = [p for p in plots if p.exists()]
    say(f"   {found[0]}" if found else "   not written (the job wrote no checkpoint folder)")

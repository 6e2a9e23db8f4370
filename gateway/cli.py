"""`tandem`: the command line. Every subcommand talks to the gateway through the SDK (`tandem_client`), except
`up` (starts the mesh), `status` (asks each service's health) and `taskapp serve|check` (the Task App SDK's
own tools). `tandem --help` and `tandem COMMAND --help` list everything with examples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from tandem.scheduler.v1 import job_pb2

from mesh.launcher import MESH_SERVICES, up
from mesh.settings import Settings, settings_problem
from mesh.status import RpcError
from tandem_client import AsyncClient, Cursor
from tandem_client.aio import API_KEY_ENV, DEFAULT_GATEWAY, GATEWAY_ENV

ADMIN_KEY_ENV = "TANDEM_ADMIN_KEY"
DEBUG_ENV = "TANDEM_DEBUG"
EXIT_INTERRUPTED = 130

EXAMPLES = """\
Start here:
  tandem demo                                   the whole flow on this machine, end to end
  tandem up                                     run every service here (prints the admin credential's file)
  tandem orgs create acme                       create an organization; prints its first API key
  export TANDEM_API_KEY=tdm_...                 every command below authenticates with it

Secrets and Task Apps:
  echo -n "$ENV_KEY" | tandem secrets put env-key        sealed on this machine, never sent in plaintext
  tandem taskapp serve examples/taskapps/single_turn.py --port 8001 --key-from-stdin
  tandem taskapp register single-turn http://127.0.0.1:8001 --secret env-key
  tandem taskapp list

Online RL:
  tandem rl start examples/jobs/demo.toml --job-id demo --watch
  tandem events watch demo                      live progress; Ctrl-C prints how to resume
  tandem rl status demo
  tandem checkpoints list demo
  tandem rl replay demo --step 21               recompute a step from its rollout dump: debug a bad step
  tandem infer demo "Copy this letter: B"
  tandem rl cancel demo

Every read takes --json. The gateway is TANDEM_GATEWAY (default 127.0.0.1:50050); the API key is
TANDEM_API_KEY or --api-key-file, never a command-line value (command lines end up in shell history
and process listings). Other settings come from TANDEM_* variables and the TOML file in TANDEM_CONFIG.
"""


class CliError(Exception):
    """A failure to report as `error: <message>` plus what to do; never a traceback."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


# What to do about each reason, for a person at a terminal. `{gateway}` is the address dialled.
HINTS = {
    "MISSING_CREDENTIALS": f"set {API_KEY_ENV} to an organization API key (`tandem orgs create ORG` prints one)",
    "INVALID_CREDENTIALS": f"the key in {API_KEY_ENV} is unknown or revoked; create another with"
    " `tandem orgs create` or CreateApiKey",
    "CREDENTIALS_EXPIRED": f"the key in {API_KEY_ENV} has expired; create another",
    "PERMISSION_DENIED": "this needs other credentials (creating an organization needs the admin key)",
    "RATE_LIMITED": "too many calls for this organization; wait a moment and retry",
    "NOT_IMPLEMENTED": "this gateway does not implement that call yet; upgrade the deployment",
    "JOB_NOT_FOUND": "check the job id with `tandem rl list`",
    "SECRET_NOT_FOUND": "upload it first: `echo -n $VALUE | tandem secrets put NAME`",
    "TASK_APP_NOT_FOUND": "register it first: `tandem taskapp register ID URL --secret NAME`; `tandem taskapp"
    " list` shows what is registered",
    "TASK_APP_CHECK_FAILED": "run `tandem taskapp check URL --key-from-stdin` against the app to see each check",
    "CHECKPOINT_NOT_FOUND": "list the job's checkpoints with `tandem checkpoints list JOB`",
    "CURSOR_AHEAD": "--after-seq is past the job's newest event; leave it out to watch from the start",
    "JOB_STATE_CONFLICT": "the job is already finished; `tandem rl status JOB` shows how it ended",
    "ALREADY_EXISTS": "pick another id, or use the existing one",
    "STALE_KEY_ID": "the organization key rotated while uploading; run the command again",
    "DEPENDENCY_UNAVAILABLE": "a service behind the gateway is not answering; `tandem status` shows which",
    "SHUTTING_DOWN": "the gateway is restarting; retry in a moment",
}


def _error_text(error: RpcError, gateway: str) -> tuple[str, str]:
    reason = error.reason or error.code.name
    message = f"{reason}: {error.message}" if error.message else reason
    if error.violations:
        message += "".join(f"\n  {v.field}: {v.description}" for v in error.violations)
    if error.reason == "CURSOR_COMPACTED" and "first_retained_seq" in error.metadata:
        first = int(error.metadata["first_retained_seq"])
        return message, f"the oldest event kept is seq {first}; resume with --after-seq {first - 1}"
    hint = HINTS.get(error.reason, "")
    if not hint and error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        hint = f"is the gateway running at {gateway}? start one with `tandem up`, or set {GATEWAY_ENV}"
    return message, hint


# ---- output ---------------------------------------------------------------------------------------------


def _dict(message: Message) -> dict[str, Any]:
    result: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return result


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


FAILURE_WIDTH = 100  # characters of a failure's first line in a table


def _cell(text: str, limit: int = 0) -> str:
    """One line of a table: a multi-line text (a failure message) gives its first line, cut at `limit`
    characters when one is given, and ends with ` …` when anything was left out; `--json` prints all."""
    lines = text.strip().splitlines()
    line = lines[0].strip() if lines else ""
    if limit and len(line) > limit:
        return line[:limit].rstrip() + " …"
    return line + " …" if len(lines) > 1 else line


def _table(rows: list[list[str]]) -> None:
    if not rows:
        return
    rows = [[_cell(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


# ---- the local mesh ---------------------------------------------------------------------------------------


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    if getattr(args, "state_dir", None):
        overrides["state_dir"] = Path(args.state_dir)
    return Settings(**overrides)


def _cmd_up(args: argparse.Namespace) -> int:
    up(_settings(args))
    return 0


async def _status(settings: Settings) -> dict[str, str]:
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    from mesh.clients import open_channel  # noqa: PLC0415

    result: dict[str, str] = {}
    for service in MESH_SERVICES:
        target = settings.target(service)
        async with open_channel(target, settings) as channel:
            stub: Any = health_pb2_grpc.HealthStub(channel)  # the stubs' typing omits methods
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                result[service] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except RpcError as error:
                result[service] = f"UNREACHABLE ({error.code.name})"
    return result


def _cmd_status(args: argparse.Namespace) -> int:
    settings = _settings(args)
    result = asyncio.run(_status(settings))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for service, state in result.items():
            print(f"{service:<14} {settings.target(service):<22} {state}")
    return 0 if all(v == "SERVING" for v in result.values()) else 1


def _cmd_rotate_mesh_key(args: argparse.Namespace) -> int:
    from mesh.identity import rotate_signing_key  # noqa: PLC0415

    settings = _settings(args)
    if settings.mesh_key:
        raise CliError(
            "the mesh key is given in TANDEM_MESH_KEY", "replace it there; this rotates state_dir/mesh.key"
        )
    retired = rotate_signing_key(settings.state_dir, args.overlap_s)
    until = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(retired.until))
    print(f"new signing key in {settings.state_dir / 'mesh.key'}; the old one verifies until {until}")
    print("restart the services one at a time (or `tandem up` once) to sign with the new key before then")
    return 0


def _cmd_rewrap_vault(args: argparse.Namespace) -> int:
    from services.vault.config import VaultSettings  # noqa: PLC0415
    from services.vault.rekey import rewrap  # noqa: PLC0415

    try:
        done = asyncio.run(rewrap(_settings(args), VaultSettings()))
    except ValueError as error:
        raise CliError(str(error), "") from None
    print(
        f"re-wrapped {done.org_keys} organization keys and {done.versions} secret versions under a new"
        f" master key in {done.key_file}; start the vault again"
    )
    return 0


def _cmd_taskapp_tool(args: argparse.Namespace) -> int:
    """`tandem taskapp serve|check ...` hands its arguments to the Task App SDK's own commands."""
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    if args.action == "serve":
        from tandem_taskapp.serve import main as serve_main  # noqa: PLC0415

        return serve_main(rest)
    from tandem_taskapp.check import main as check_main  # noqa: PLC0415

    return check_main(rest)


# ---- the gateway ------------------------------------------------------------------------------------------


def _api_key(args: argparse.Namespace) -> str:
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as error:
            raise CliError(f"cannot read the API key file {path}: {error.strerror}") from None
    return os.environ.get(API_KEY_ENV, "")


def _client(args: argparse.Namespace, api_key: str | None = None) -> AsyncClient:
    return AsyncClient(
        args.gateway, api_key if api_key is not None else _api_key(args), org=getattr(args, "org", None)
    )


def _read_secret_value(name: str) -> bytes:
    """The value from standard input when it is piped, else from a prompt that does not echo. Never argv:
    command lines end up in shell history and in every process listing."""
    if sys.stdin.isatty():
        import getpass  # noqa: PLC0415

        value = getpass.getpass(f"Value for {name} (input hidden): ").encode()
    else:
        value = sys.stdin.buffer.read().rstrip(b"\r\n")
    if not value:
        raise CliError("the value is empty", "pipe it on standard input or type it at the prompt")
    return value


def _admin_key(args: argparse.Namespace) -> str:
    if key := os.environ.get(ADMIN_KEY_ENV, ""):
        return key
    path = Path(args.admin_key_file) if args.admin_key_file else _settings(args).state_dir / "admin.key"
    try:
        return path.read_text().strip()
    except OSError:
        raise CliError(
            f"no admin credential: {path} cannot be read and {ADMIN_KEY_ENV} is not set",
            "run this where `tandem up` keeps its state (--state-dir), or set " + ADMIN_KEY_ENV,
        ) from None


async def _orgs(args: argparse.Namespace) -> int:
    async with _client(args, api_key="" if args.action == "create" else None) as client:
        if args.action == "create":
            created = await client.create_org(
                args.org_id, admin_credential=_admin_key(args), display_name=args.display_name
            )
            if args.json:
                _print_json(
                    {"org": _dict(created.org), "api_key": _dict(created.api_key), "key": created.key}
                )
            else:
                print(f"created {created.org.name}; its first API key (shown only now):")
                print(f"  export {API_KEY_ENV}={created.key}")
            return 0
        org = await client.get_org()
        if args.json:
            _print_json(_dict(org))
        else:
            print(f"{org.name}  {org.display_name}".rstrip())
        return 0


async def _secrets(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        if args.action == "put":
            value = _read_secret_value(args.name)
            reply = await client.put_secret(args.name, value)
            del value
            verb = "created" if reply.created else "updated"
            if args.json:
                _print_json(
                    {
                        "secret": reply.secret.name,
                        "version": reply.version.version,
                        "result": verb,
                        "fingerprint": reply.version.fingerprint,
                    }
                )
            else:
                print(
                    f"{verb} {reply.secret.name} version {reply.version.version}"
                    f" (fingerprint {reply.version.fingerprint})"
                )
            return 0
        secrets = await client.list_secrets()
        rows = [
            {
                "secret": s.name,
                "versions": s.version_count,
                "latest": s.latest_version.version,
                "fingerprint": s.latest_version.fingerprint,
            }
            for s in secrets
        ]
        if args.json:
            _print_json(rows)
        else:
            _table([[str(r["secret"]), f"v{r['latest']}", str(r["fingerprint"])] for r in rows])
        return 0


def _check_rows(results: Any) -> list[list[str]]:
    return [[("pass" if r.passed else "FAIL"), r.check, r.detail] for r in results]


async def _taskapps(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        if args.action == "register":
            reply = await client.register_task_app(
                args.task_app_id,
                args.url,
                secret=args.secret,
                display_name=args.display_name,
                validate_only=args.validate_only,
            )
            if args.json:
                _print_json(_dict(reply))
            else:
                _table(_check_rows(reply.check_results))
                done = "checked (nothing stored)" if args.validate_only else "registered"
                print(
                    f"{done} {reply.task_app.name or args.task_app_id} at {reply.task_app.base_url or args.url}"
                )
            return 0
        apps = await client.list_task_apps()
        if args.json:
            _print_json([_dict(app) for app in apps])
        else:
            _table(
                [
                    [
                        app.name,
                        app.base_url,
                        app.State.Name(app.state).removeprefix("STATE_"),
                        app.managing_job,
                    ]
                    for app in apps
                ]
            )
        return 0


async def _rl_start(args: argparse.Namespace) -> int:
    from gateway.progress import job_state  # noqa: PLC0415

    try:
        text = await asyncio.to_thread(Path(args.config).read_text)
    except OSError as error:
        raise CliError(f"cannot read {args.config}: {error.strerror}") from None
    async with _client(args) as client:
        job = await client.create_job(
            rl_config_toml=text, job_id=args.job_id, validate_only=args.validate_only
        )
        if args.json and not args.watch:
            _print_json(_dict(job))
            return 0
        if not args.json:
            verb = "would create" if args.validate_only else "created"
            print(f"{verb} {job.name} ({job_state(job.state)})")
        if args.validate_only:
            return 0
        if not args.watch:
            print(f"follow it with: tandem events watch {job.name}")
            return 0
        return await _watch(client, args, job.name)


async def _rl_status(args: argparse.Namespace) -> int:
    from gateway.progress import job_state, task_state  # noqa: PLC0415

    async with _client(args) as client:
        job = await client.get_job(args.job)
    if args.json:
        _print_json(_dict(job))
        return 0
    print(f"{job.name}: {job_state(job.state)}")
    if job.failure.message:
        print(f"  failure: {job.failure.message}")
    for task in job.tasks:
        print(f"  task {task.task}: {task_state(task.state)}")
    return 0


async def _rl_list(args: argparse.Namespace) -> int:
    from gateway.progress import job_state  # noqa: PLC0415

    async with _client(args) as client:
        jobs = await client.list_jobs(limit=args.limit)
    if args.json:
        _print_json([_dict(job) for job in jobs])
    else:
        _table([[job.name, job_state(job.state), _cell(job.failure.message, FAILURE_WIDTH)] for job in jobs])
    return 0


async def _rl_cancel(args: argparse.Namespace) -> int:
    from gateway.progress import job_state  # noqa: PLC0415

    async with _client(args) as client:
        job = await client.cancel_job(args.job, reason=args.reason)
    if args.json:
        _print_json(_dict(job))
    else:
        print(f"{job.name}: {job_state(job.state)}")
    return 0


async def _rl_replay(args: argparse.Namespace) -> int:
    """Find the job's output folder from its checkpoints' URIs (as `tandem checkpoints list` shows them) and
    run the trainer's replay on it, in a process of its own: the replay needs torch, the CLI does not."""
    async with _client(args) as client:
        found = await client.list_checkpoints(args.job)
    if not found:
        raise CliError(
            f"{args.job} has saved no checkpoint yet, so the folder its rollout dump is in is not known",
            "on the job's machine: python -m trainer.replay --dump OUTPUT/checkpoints/rollouts --step N",
        )
    local = [c for c in found if c.uri.startswith("file://")]
    if not local:
        raise CliError(
            f"{args.job}'s checkpoints are at {found[0].uri}, not in a file system this machine reads",
            "run `tandem rl replay` where the job's output folder is, or copy it here and use"
            " python -m trainer.replay --dump DIR --step N",
        )
    # Every checkpoint folder is `<output>/checkpoints/step-NNNNNN`; the dump is in `<output>/checkpoints/rollouts`.
    checkpoints = Path(url2pathname(urlparse(local[0].uri).path)).parent
    command = [
        sys.executable,
        "-m",
        "trainer.replay",
        "--checkpoint",
        str(checkpoints),
        "--step",
        str(args.step),
    ]
    if args.json:
        command.append("--json")
    process = await asyncio.create_subprocess_exec(*command)
    return await process.wait()


async def _rl_logs(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        stream = client.stream_job_logs(
            args.job, task=args.task, rank=args.rank, tail_bytes=args.tail_bytes, follow=args.follow
        )
        async for piece in stream:
            if args.json:
                text = piece.data.decode(errors="replace")
                print(json.dumps({"offset": piece.offset, "next_offset": piece.next_offset, "data": text}))
            else:
                sys.stdout.buffer.write(piece.data)
            sys.stdout.flush()
    return 0


_INFRA = ("k8s", "kubernetes", "slurm", "local")


class UsageError(CliError):
    """Bad input on the command line or in the file: exit code 2."""


def launch_envs(pairs: list[str], environ: Mapping[str, str]) -> dict[str, str]:
    """`--env NAME=VALUE` values, and `--env NAME` taken from the caller's environment (as `sky launch`)."""
    envs: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            if name not in environ:
                raise UsageError(f"--env {name}: no value given and {name} is not set in this shell")
            value = environ[name]
        envs[name] = value
    return envs


def launch_spec(args: argparse.Namespace, uploads: list[Any] | None = None) -> Any:
    """The job file as a checked JobSpec, with the command line's overrides applied to every task; `uploads`
    takes the buckets the file fills from local folders (`spec.BucketUpload`), refused without it."""
    from tandem.scheduler.v1 import job_spec_pb2  # noqa: PLC0415

    from mesh.errors import InvalidArgument  # noqa: PLC0415
    from services.scheduler import spec as job_spec  # noqa: PLC0415

    try:
        spec = job_spec.load_yaml(Path(args.file), envs=launch_envs(args.env, os.environ), uploads=uploads)
    except InvalidArgument as error:
        raise UsageError(str(error)) from None
    for task in spec.tasks:
        if args.gpus:
            task.resources.gpus = args.gpus
            del task.resources.gpu_alternatives[:]
        if args.num_nodes:
            task.num_nodes = args.num_nodes
        for name in args.secret:
            if "=" in name:
                raise UsageError(
                    f"--secret {name.split('=')[0]}: secrets come from the vault; give only a name"
                )
            # the vault secret in NAME, over the file's own NAME (an env, SkyPilot's empty secret, a binding)
            task.envs.pop(name, None)
            kept = [b for b in task.secrets if job_spec.secret_env_name(b) != name]
            del task.secrets[:]
            task.secrets.extend(kept)
            task.secrets.append(job_spec_pb2.SecretBinding(secret=name.lower().replace("_", "-"), env=name))
    if args.infra:  # as the file's `infra:` (services/scheduler/SPEC.md), over what the file says
        first = args.infra.strip().partition("/")[0]
        if first.lower() not in _INFRA:
            raise UsageError(f"--infra {args.infra}: Tandem runs on {', '.join(sorted(_INFRA))}")
        try:
            backend, options = job_spec.parse_infra(args.infra)
        except ValueError as error:
            raise UsageError(f"--infra {args.infra}: {error}") from None
        spec.backend = backend
        job_spec.set_backend_options(spec, backend, options)
    try:
        job_spec.check_spec(spec)
    except InvalidArgument as error:
        raise UsageError(str(error)) from None
    return spec


async def _launch(args: argparse.Namespace) -> int:
    from gateway.progress import job_state  # noqa: PLC0415

    uploads: list[Any] = []
    spec = launch_spec(args, uploads)
    if args.dryrun:
        _print_json(_dict(spec))
        for plan in uploads:
            print(f"would upload {', '.join(plan.sources)} to {plan.url}", file=sys.stderr)
        return 0
    for plan in uploads:  # before the job exists, so its tasks find the bucket filled (as `sky launch`)
        await asyncio.to_thread(_upload, plan, args.json)
    async with _client(args) as client:
        job = await client.create_job(spec=spec, job_id=args.job_id)
    if args.json:
        _print_json(_dict(job))
    else:
        print(f"created {job.name} ({job_state(job.state)})")
        print(f"follow it with: tandem logs {job.name} --follow")
    return 0


def _upload(plan: Any, quiet: bool) -> None:
    from services.scheduler import bucket_uploads  # noqa: PLC0415

    try:
        done = bucket_uploads.upload(bucket_uploads.open_client_store(plan), plan)
    except Exception as error:  # the store's own errors (botocore, s3fs) are many; each is the user's to see
        raise CliError(f"cannot upload {', '.join(plan.sources)} to {plan.url}: {error}") from None
    if not quiet:
        print(
            f"uploaded {done.uploaded} files to {plan.url} ({done.unchanged} already there)", file=sys.stderr
        )


async def _watch(client: AsyncClient, args: argparse.Namespace, job: str) -> int:
    """Follow a job until it is terminal (or Ctrl-C), resuming across dropped connections."""
    from gateway.progress import ProgressView, job_state, total_steps  # noqa: PLC0415

    name = await client.job_name(job)
    cursor = Cursor(seq=getattr(args, "after_seq", 0) or 0)
    view = ProgressView(sys.stdout, tty=sys.stdout.isatty(), verbose=getattr(args, "verbose", False))
    try:
        view.total = total_steps(await client.get_job(name))
    except RpcError as error:
        if error.code not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND):
            raise

    def reconnecting(error: RpcError | None, seq: int) -> None:
        if error is not None and error.code == grpc.StatusCode.NOT_FOUND:
            return  # the job is stored but has published no event yet
        why = f" ({error.reason or error.code.name})" if error is not None else ""
        print(f"connection lost{why}; resuming after seq {seq}", file=sys.stderr, flush=True)

    try:
        async for event in client.watch_events(
            name, after_seq=cursor.seq, cursor=cursor, on_reconnect=reconnecting
        ):
            if args.json:
                print(json.dumps(_dict(event), sort_keys=True), flush=True)
            else:
                view.show(event)
    except (asyncio.CancelledError, KeyboardInterrupt):
        view.finish()
        print(
            f"stopped after seq {cursor.seq}; resume with: tandem events watch {name} --after-seq {cursor.seq}",
            file=sys.stderr,
        )
        raise KeyboardInterrupt from None
    view.finish()
    if not args.json:
        print(f"{name} ended {job_state(cursor.terminal_state)} (events up to seq {cursor.seq})")
    return 0 if cursor.terminal_state == job_pb2.Job.STATE_SUCCEEDED else 1


async def _events(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        return await _watch(client, args, args.job)


async def _checkpoints(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        checkpoints = await client.list_checkpoints(args.job)
    if args.json:
        _print_json([_dict(c) for c in checkpoints])
        return 0
    if not checkpoints:
        print("no checkpoints yet")
    rows = [
        [
            c.name.rsplit("/", 1)[-1],
            f"step {c.step}",
            f"reward {c.metrics['reward/mean']:.3f}" if "reward/mean" in c.metrics else "",
            c.Trigger.Name(c.trigger).removeprefix("TRIGGER_").lower(),
            c.uri,
        ]
        for c in checkpoints
    ]
    _table(rows)
    return 0


async def _infer(args: argparse.Namespace) -> int:
    def waiting(error: RpcError) -> None:
        print(f"waiting for an inference worker to load the checkpoint ({error.message})", file=sys.stderr)

    async with _client(args) as client:
        model = f"{await client.job_name(args.job)}/checkpoints/{args.checkpoint}"
        try:
            reply = await client.infer(
                model,
                args.prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                wait_s=args.wait,
                on_wait=waiting,
            )
        except RpcError as error:
            if error.reason != "DEPENDENCY_UNAVAILABLE":
                raise
            raise CliError(
                f"no inference worker served {model} within {args.wait:g} s: {error.message}",
                "retry later, or wait longer with --wait SECONDS",
            ) from None
    if args.json:
        _print_json(_dict(reply))
    else:
        print(reply.text)
    return 0


def _seconds(duration: Any, present: bool) -> str:
    return f"{duration.ToTimedelta().total_seconds():.0f} s" if present else "-"


def _worker_rows(workers: list[Any]) -> list[list[str]]:
    from gateway.progress import job_state  # noqa: PLC0415

    rows = [["CHECKPOINT", "STEP", "STATE", "IDLE", "IDLE LEFT", "JOB"]]
    for w in workers:
        rows.append(
            [
                w.checkpoint,
                str(w.step),
                job_state(w.state),
                _seconds(w.idle, w.HasField("idle")),
                _seconds(w.idle_left, w.HasField("idle_left")),
                w.job.rsplit("/", 1)[-1],
            ]
        )
    return rows


async def _infer_list(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        workers = await client.list_inference_workers()
    if args.json:
        _print_json([_dict(w) for w in workers])
    elif not workers:
        print("no inference workers running")
    else:
        _table(_worker_rows(workers))
    return 0


async def _infer_stop(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        model = f"{await client.job_name(args.job)}/checkpoints/{args.checkpoint}"
        workers = await client.stop_inference_worker(model)
    if args.json:
        _print_json([_dict(w) for w in workers])
    else:
        for w in workers:
            print(f"stopped the inference worker of {w.checkpoint} ({w.job})")
    return 0


def _async(command: Callable[[argparse.Namespace], Awaitable[int]]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        return asyncio.run(command(args))  # type: ignore[arg-type]

    return run


def _cmd_demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo  # noqa: PLC0415

    try:
        return asyncio.run(run_demo(args))
    except asyncio.CancelledError:  # SIGTERM, which the demo takes as it takes Ctrl-C
        return EXIT_INTERRUPTED


# ---- the parser -------------------------------------------------------------------------------------------


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34)


def _gateway_options(json_output: bool = True) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--gateway",
        default=os.environ.get(GATEWAY_ENV) or DEFAULT_GATEWAY,
        metavar="HOST:PORT",
        help=f"the gateway to call (default ${GATEWAY_ENV}, else {DEFAULT_GATEWAY})",
    )
    common.add_argument(
        "--api-key-file",
        metavar="FILE",
        help=f"read the organization API key from FILE (default ${API_KEY_ENV})",
    )
    common.add_argument("--org", help="organization id (default: the API key's own)")
    if json_output:
        common.add_argument("--json", action="store_true", help="print JSON for scripts")
    return common


def _sub(
    group: Any, name: str, summary: str, examples: str, parents: list[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = group.add_parser(
        name,
        help=summary,
        description=f"{summary[0].upper()}{summary[1:]}.\n\nexamples:\n{examples}",
        formatter_class=_Formatter,
        parents=parents,
    )
    return parser


def _add_keys(sub: Any) -> None:
    p = _sub(
        sub,
        "keys",
        "rotate the mesh's signing key or re-wrap the vault's master key (on the mesh's own machine)",
        "  tandem keys rotate-mesh-key\n  tandem keys rewrap-vault",
        [],
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = _sub(
        actions,
        "rotate-mesh-key",
        "make a new mesh signing key; tokens of the old one verify until the overlap ends",
        "  tandem keys rotate-mesh-key --overlap-s 7200",
        [],
    )
    q.add_argument("--state-dir", help="state folder of the mesh (default .tandem)")
    q.add_argument(
        "--overlap-s",
        type=float,
        default=5400.0,
        help="how long the old key still verifies (default 5400 s, past a job token's hour)",
    )
    q.set_defaults(func=_cmd_rotate_mesh_key)
    q = _sub(
        actions,
        "rewrap-vault",
        "re-wrap every organization key under a new vault master key, with the vault stopped",
        "  tandem keys rewrap-vault --state-dir .tandem",
        [],
    )
    q.add_argument("--state-dir", help="state folder of the mesh (default .tandem)")
    q.set_defaults(func=_cmd_rewrap_vault)


def _add_orgs(sub: Any, gw: argparse.ArgumentParser) -> None:
    p = _sub(
        sub,
        "orgs",
        "create an organization (with the admin key) or show the API key's own",
        "  tandem orgs create acme --display-name 'Acme Labs'\n  tandem orgs show --json",
        [],
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = _sub(
        actions,
        "create",
        "create an organization and print its first API key (shown only once)",
        "  tandem orgs create acme\n  TANDEM_ADMIN_KEY=tdm_admin_... tandem orgs create acme --gateway gw:50050",
        [gw],
    )
    q.add_argument("org_id", help="lowercase letters, digits and hyphens, starting with a letter")
    q.add_argument("--display-name", default="", help="a human-readable name")
    q.add_argument(
        "--state-dir", help="state folder of a local mesh, where admin.key lives (default .tandem)"
    )
    q.add_argument(
        "--admin-key-file",
        help=f"the admin credential's file (default: STATE_DIR/admin.key; or ${ADMIN_KEY_ENV})",
    )
    q.set_defaults(func=_async(_orgs))
    q = _sub(actions, "show", "show the organization the API key belongs to", "  tandem orgs show", [gw])
    q.set_defaults(func=_async(_orgs))


def _add_secrets(sub: Any, gw: argparse.ArgumentParser) -> None:
    p = _sub(
        sub,
        "secrets",
        "upload or list organization secrets (values are sealed on this machine before they leave it)",
        '  echo -n "$ENV_KEY" | tandem secrets put env-key\n  tandem secrets list --json',
        [],
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = _sub(
        actions,
        "put",
        "seal a value to the organization's public key and upload it; the value comes from standard input or"
        " a hidden prompt, never the command line",
        '  echo -n "$ENV_KEY" | tandem secrets put env-key\n  tandem secrets put env-key     (prompts, input hidden)',
        [gw],
    )
    q.add_argument("name", help="secret id: lowercase letters, digits and hyphens")
    q.set_defaults(func=_async(_secrets))
    q = _sub(
        actions,
        "list",
        "list secrets: versions and fingerprints, never values",
        "  tandem secrets list",
        [gw],
    )
    q.set_defaults(func=_async(_secrets))


def _add_taskapp(sub: Any, gw: argparse.ArgumentParser) -> None:
    p = _sub(
        sub,
        "taskapp",
        "serve or check a Task App here, or register it with Tandem",
        "  tandem taskapp serve my_app.py --port 8001 --key-from-stdin\n"
        "  tandem taskapp check http://127.0.0.1:8001 --key-from-stdin\n"
        "  tandem taskapp register my-app http://10.0.0.5:8001 --secret env-key\n"
        "  tandem taskapp list",
        [],
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, summary, example in (
        (
            "serve",
            "run a Task App written with the SDK, a verifiers environment (--verifiers ENV), or an OpenEnv"
            " env server through an adapter (--openenv URL --openenv-adapter ADAPTER)",
            "  tandem taskapp serve my_app.py --port 8001 --key-from-stdin",
        ),
        (
            "check",
            "check any Task App against the contract and print a pass/fail table",
            '  echo -n "$ENV_KEY" | tandem taskapp check http://127.0.0.1:8001 --key-from-stdin',
        ),
    ):
        q = _sub(
            actions,
            action,
            summary,
            example + f"\n  tandem taskapp {action} -- --help     (the tool's own options)",
            [],
        )
        q.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the tool (see its --help)")
        q.set_defaults(func=_cmd_taskapp_tool)
    q = _sub(
        actions,
        "register",
        "register a running Task App after the proxy's checks pass",
        "  tandem taskapp register single-turn http://127.0.0.1:8001 --secret env-key\n"
        "  tandem taskapp register single-turn http://127.0.0.1:8001 --secret env-key --validate-only",
        [gw],
    )
    q.add_argument("task_app_id", help="the app id: lowercase letters, digits and hyphens")
    q.add_argument("url", help="the app's base URL, as the taskapp-proxy reaches it")
    q.add_argument("--secret", default="", help="the secret holding the app's environment key")
    q.add_argument("--display-name", default="", help="a human-readable name")
    q.add_argument("--validate-only", action="store_true", help="run the checks, store nothing")
    q.set_defaults(func=_async(_taskapps))
    q = _sub(actions, "list", "list the organization's Task Apps", "  tandem taskapp list --json", [gw])
    q.set_defaults(func=_async(_taskapps))


def _add_rl(sub: Any, gw: argparse.ArgumentParser) -> None:
    p = _sub(
        sub,
        "rl",
        "start, inspect and cancel online-RL jobs",
        "  tandem rl start examples/jobs/demo.toml --job-id demo --watch\n"
        "  tandem rl status demo\n  tandem rl list\n"
        "  tandem rl logs demo --task trainer --follow\n  tandem rl replay demo --step 21\n"
        "  tandem rl cancel demo",
        [],
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = _sub(
        actions,
        "start",
        "submit an online-RL job from a trainer TOML config",
        "  tandem rl start examples/jobs/demo.toml\n"
        "  tandem rl start job.toml --job-id run-7 --watch\n"
        "  tandem rl start job.toml --validate-only     (check the config, start nothing)",
        [gw],
    )
    q.add_argument("config", help="the TOML config (the TrainerConfig schema)")
    q.add_argument("--job-id", default="", help="the job id (default: the server picks one)")
    q.add_argument("--watch", action="store_true", help="follow the job's progress until it ends")
    q.add_argument("--validate-only", action="store_true", help="run every check, start nothing")
    q.set_defaults(func=_async(_rl_start))
    q = _sub(actions, "status", "show a job's state and tasks", "  tandem rl status demo --json", [gw])
    q.add_argument("job", help="job id or name (orgs/ORG/jobs/JOB)")
    q.set_defaults(func=_async(_rl_status))
    q = _sub(actions, "list", "list the organization's jobs, newest first", "  tandem rl list --json", [gw])
    q.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    q.set_defaults(func=_async(_rl_list))
    q = _sub(
        actions,
        "cancel",
        "stop a job (the trainer writes a final checkpoint first)",
        "  tandem rl cancel demo --reason 'wrong learning rate'",
        [gw],
    )
    q.add_argument("job", help="job id or name")
    q.add_argument("--reason", default="", help="recorded in the job's terminal event")
    q.set_defaults(func=_async(_rl_cancel))
    q = _sub(
        actions,
        "logs",
        "print a job task's log, or follow it until the task ends",
        "  tandem rl logs demo --task trainer --follow\n  tandem rl logs demo --task trainer --tail-bytes 4096",
        [gw],
    )
    q.add_argument("job", help="job id or name")
    q.add_argument("--task", default="", help="the task's name in the spec (optional for a one-task job)")
    _log_options(q)
    q = _sub(
        actions,
        "replay",
        "recompute one step of a job from its rollout dump ([rollout_dump] in the job's config) and the"
        " checkpoint before it, and compare the loss, statistics and grad norm with what the job recorded"
        " (bit-identical on a CPU); on the machine that holds the job's output folder, with the trainer's"
        " packages installed",
        "  tandem rl replay demo --step 21        (demo keeps a checkpoint every 20 steps)\n"
        "  tandem rl replay demo --step 1 --json  (step 1 trains the job's initial model)",
        [gw],
    )
    q.add_argument("job", help="job id or name")
    q.add_argument("--step", type=int, required=True, help="the step to replay; the one after a checkpoint")
    q.set_defaults(func=_async(_rl_replay))


def _log_options(q: argparse.ArgumentParser) -> None:
    q.add_argument("--rank", type=int, default=0, help="the node rank within the task (default 0)")
    q.add_argument("--tail-bytes", type=int, default=0, help="start this many bytes before the end")
    q.add_argument("--follow", action="store_true", help="keep printing until the task ends")
    q.set_defaults(func=_async(_rl_logs))


def _add_launch(sub: Any, gw: argparse.ArgumentParser) -> None:
    q = _sub(
        sub,
        "launch",
        "submit a SkyPilot task or job-group file (YAML) as a job",
        "  tandem launch examples/jobs/torchrun-multinode.yaml --dryrun\n"
        "  tandem launch examples/jobs/torchrun-multinode.yaml --env NCCL_DEBUG=INFO --gpus A100:8 --num-nodes 4"
        " --dryrun\n"
        "  tandem launch examples/jobs/rl-with-eval-watcher.yaml --infra local --job-id run-7 --dryrun",
        [gw],
    )
    q.add_argument(
        "file", help="the task or job-group file, in SkyPilot's vocabulary (services/scheduler/SPEC.md)"
    )
    q.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]", help="set in every task")
    q.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME",
        help="a vault secret in every task, in the variable NAME (over the file's own NAME)",
    )
    q.add_argument("--gpus", default="", metavar="TYPE:COUNT", help="every task's accelerators (A100:8)")
    q.add_argument("--num-nodes", type=int, default=0, help="every task's node count")
    q.add_argument(
        "--infra",
        default="",
        help="the backend: k8s, slurm or local; SkyPilot's k8s/CONTEXT, slurm/CLUSTER and "
        "slurm/CLUSTER/PARTITION name the context, cluster and partition too",
    )
    q.add_argument("--job-id", default="", help="the job id (default: the server picks one)")
    q.add_argument("--dryrun", action="store_true", help="check the file and print the spec, start nothing")
    q.set_defaults(func=_async(_launch))
    q = _sub(sub, "queue", "list the organization's jobs, newest first", "  tandem queue --json", [gw])
    q.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    q.set_defaults(func=_async(_rl_list))
    q = _sub(
        sub,
        "logs",
        "print a job task's log, or follow it until the task ends",
        "  tandem logs demo trainer --follow",
        [gw],
    )
    q.add_argument("job", help="job id or name")
    q.add_argument("task", nargs="?", default="", help="the task's name (optional for a one-task job)")
    _log_options(q)
    q = _sub(sub, "cancel", "stop a job", "  tandem cancel demo --reason 'wrong learning rate'", [gw])
    q.add_argument("job", help="job id or name")
    q.add_argument("--reason", default="", help="recorded in the job's terminal event")
    q.set_defaults(func=_async(_rl_cancel))


def _add_events(sub: Any, gw: argparse.ArgumentParser) -> None:
    p = _sub(sub, "events", "follow a job's events", "  tandem events watch demo", [])
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = _sub(
        actions,
        "watch",
        "show a job's live progress (steps, reward, loss, state changes, warnings) until it ends; resumes by"
        " itself after a dropped connection, and Ctrl-C prints how to resume later",
        "  tandem events watch demo\n  tandem events watch demo --after-seq 120\n"
        "  tandem events watch demo --json | jq .type      (one JSON object per event)",
        [gw],
    )
    q.add_argument("job", help="job id or name")
    q.add_argument("--after-seq", type=int, default=0, help="start after this event seq (to resume)")
    q.add_argument("--verbose", action="store_true", help="also show log lines and other events")
    q.set_defaults(func=_async(_events))


def _add_checkpoints(sub: Any, gw: argparse.ArgumentParser) -> None:
    p = _sub(sub, "checkpoints", "list a job's checkpoints", "  tandem checkpoints list demo", [])
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = _sub(
        actions,
        "list",
        "list a job's checkpoints, newest first",
        "  tandem checkpoints list demo --json",
        [gw],
    )
    q.add_argument("job", help="job id or name")
    q.set_defaults(func=_async(_checkpoints))


def _add_infer(sub: Any, gw: argparse.ArgumentParser) -> None:
    q = _sub(
        sub,
        "infer",
        "generate a completion from a job's checkpoint (`tandem infer list` and `tandem infer stop` for the"
        " running workers)",
        "  tandem infer demo 'Copy this letter: B'\n  tandem infer demo --checkpoint step-40 'Copy this letter: B'"
        "\n  tandem infer list                  the running inference workers and their idle time left"
        "\n  tandem infer stop demo             stop the worker of demo's newest checkpoint"
        "\n(a job named `list` or `stop` is asked by its full name, orgs/ORG/jobs/list)",
        [gw],
    )
    q.add_argument("job", help="job id or name")
    q.add_argument("prompt", help="the prompt, used as given")
    q.add_argument("--checkpoint", default="latest", help="checkpoint id (default latest)")
    q.add_argument("--max-tokens", type=int, default=0, help="most tokens to generate (default: the model's)")
    q.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1)")
    q.add_argument("--wait", type=float, default=120.0, help="how long to wait for a worker to load (s)")
    q.set_defaults(func=_async(_infer))
    # `tandem infer list` and `tandem infer stop` (main() routes them here; unlisted in `tandem --help`).
    actions = {
        "list": (
            "list the organization's running inference workers, with each one's idle time left",
            "  tandem infer list\n  tandem infer list --json",
            _infer_list,
        ),
        "stop": (
            "stop the inference worker serving a job's checkpoint now (the next call starts one)",
            "  tandem infer stop demo\n  tandem infer stop demo --checkpoint step-40",
            _infer_stop,
        ),
    }
    for action, (summary, examples, command) in actions.items():
        q = sub.add_parser(
            f"infer-{action}",
            prog=f"tandem infer {action}",
            description=f"{summary[0].upper()}{summary[1:]}.\n\nexamples:\n{examples}",
            formatter_class=_Formatter,
            parents=[gw],
        )
        if action == "stop":
            q.add_argument("job", help="job id or name")
            q.add_argument("--checkpoint", default="latest", help="checkpoint id (default latest)")
        q.set_defaults(func=_async(command))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: online reinforcement learning for language models, self-hosted.",
        formatter_class=_Formatter,
        epilog=EXAMPLES,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gw = _gateway_options()

    p = _sub(
        sub,
        "up",
        "run every Tandem service in this process until Ctrl-C",
        "  tandem up\n  tandem up --state-dir /srv/tandem",
        [],
    )
    p.add_argument("--state-dir", help="folder for databases, keys, logs and traces (default .tandem)")
    p.set_defaults(func=_cmd_up)

    p = _sub(
        sub, "status", "check which services of a running mesh are serving", "  tandem status --json", []
    )
    p.add_argument("--state-dir", help="state folder of the mesh (default .tandem)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=_cmd_status)

    p = _sub(
        sub,
        "demo",
        "run the whole flow on this machine: mesh, organization, sealed key, Task App, online RL job, live"
        " progress, checkpoints, inference",
        "  tandem demo\n  tandem demo --steps 20          a shorter run",
        [],
    )
    p.add_argument(
        "--state-dir", help="where the demo's mesh keeps its state (default: a new runs/demo-* folder)"
    )
    p.add_argument(
        "--config",
        default="",
        help="the online-RL config to run (default: examples/jobs/demo.toml of the installed checkout)",
    )
    p.add_argument("--steps", type=int, default=0, help="override [algorithm] steps (default: the config's)")
    p.add_argument(
        "--model-dir",
        default="runs/demo-model",
        help="the policy's folder, built from random initialisation when empty (default runs/demo-model)",
    )
    p.set_defaults(func=_cmd_demo)

    _add_keys(sub)
    _add_orgs(sub, gw)
    _add_secrets(sub, gw)
    _add_taskapp(sub, gw)
    _add_rl(sub, gw)
    _add_launch(sub, gw)
    _add_events(sub, gw)
    _add_checkpoints(sub, gw)
    _add_infer(sub, gw)
    return parser


INFER_ACTIONS = ("list", "stop")


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if len(words) >= 2 and words[0] == "infer" and words[1] in INFER_ACTIONS:
        words = [f"infer-{words[1]}", *words[2:]]
    if (
        words[:1] == ["taskapp"]
        and words[1:2] in (["serve"], ["check"])
        and words[2:3] not in ([], ["-h"], ["--help"], ["--"])
    ):
        # Everything after `serve` / `check` is the tool's own, options first included (`--verifiers ENV`).
        words = [*words[:2], "--", *words[2:]]
    args = build_parser().parse_args(words)
    try:
        code: int = args.func(args)
    except RpcError as error:
        message, hint = _error_text(error, getattr(args, "gateway", DEFAULT_GATEWAY))
        _report(message, hint)
        return 1
    except UsageError as error:
        _report(str(error), error.hint)
        return 2
    except CliError as error:
        _report(str(error), error.hint)
        return 1
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except OSError as error:  # a file, a port, a process: the environment, not Tandem
        _report(f"{error.strerror or error}{f': {error.filename}' if error.filename else ''}", "")
        return 1
    except Exception as error:
        problem = settings_problem(error)
        if problem is not None:  # the configuration's fault, not a bug: say which setting
            _report(problem, "fix the setting (TANDEM_* variables, the TOML file in TANDEM_CONFIG) and retry")
            return 2
        if os.environ.get(DEBUG_ENV):
            raise
        _report(
            f"unexpected {type(error).__name__}: {error}",
            f"this is a bug in the tandem command; {DEBUG_ENV}=1 shows the traceback to report",
        )
        return 1
    return code


def _report(message: str, hint: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    if hint:
        print(f"  {hint}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

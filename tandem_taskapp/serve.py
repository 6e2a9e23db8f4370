"""Serve a Task App: `python -m tandem_taskapp.serve path/to/app.py --port 8001` (also
`tandem taskapp serve path/to/app.py`), or a verifiers environment:
`tandem taskapp serve --verifiers my-taskset` (see `tandem_taskapp.verifiers_env`), or an OpenEnv env server
through an adapter: `tandem taskapp serve --openenv http://127.0.0.1:8010 --openenv-adapter my_adapter.py`
(see `tandem_taskapp.openenv_env`).

The file (or a dotted module name, optionally `module:attribute`) must define a module-level
`app: TaskApp`. The environment key comes from `ENVIRONMENT_API_KEY`, or from the first line of standard
input with `--key-from-stdin`; it is never logged or printed. Spans go to `TANDEM_OTLP_ENDPOINT` or the file
in `TANDEM_TRACE_FILE` when either is set (see `configure_tracing`)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

import uvicorn
from pydantic import ValidationError

from tandem_taskapp.app import TaskApp, create_app
from tandem_taskapp.errors import TaskAppError

KEY_ENV = "ENVIRONMENT_API_KEY"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8001


def load_task_app(path_or_module: str) -> TaskApp:
    """The `TaskApp` named by a file path (`path/to/app.py[:attr]`) or module (`pkg.mod[:attr]`);
    `attr` defaults to `app`."""
    target, attr = _split_target(path_or_module, "app")
    module = _import_target(target, "Task App")
    app = getattr(module, attr, None)
    if not isinstance(app, TaskApp):
        raise TypeError(f"{target} must define a module-level `{attr}: TaskApp` (found {type(app).__name__})")
    return app


def _split_target(path_or_module: str, default_attr: str) -> tuple[str, str]:
    target, attr = path_or_module, default_attr
    head, sep, tail = path_or_module.rpartition(":")
    if sep and tail.isidentifier() and not (len(head) == 1 and head.isalpha()):
        target, attr = head, tail
    return target, attr


def _import_target(target: str, what: str) -> ModuleType:
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = Path(target).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no such {what} file: {target}")
        mod_name = "tandem_taskapp_user_" + re.sub(r"\W", "_", path.stem)
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {target}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(target)


def serve(
    path_or_module: str | TaskApp,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    *,
    require_key: bool = True,
    public_health: bool = True,
    log_level: str = "info",
) -> None:
    """Load the Task App and serve it with uvicorn until interrupted. `api_key` None reads
    `ENVIRONMENT_API_KEY`; with `require_key=False` a missing key serves without authentication."""
    task_app = path_or_module if isinstance(path_or_module, TaskApp) else load_task_app(path_or_module)
    key = api_key if api_key is not None else os.environ.get(KEY_ENV) or None
    if key is None and require_key:
        raise ValueError(f"no environment key: set {KEY_ENV} or pass --key-from-stdin")
    configure_tracing(task_app.name)
    asgi = create_app(task_app, key, public_health=public_health)
    uvicorn.run(asgi, host=host, port=port, log_level=log_level, access_log=False, server_header=False)


def configure_tracing(service_name: str) -> None:
    """Export this process's spans (the episodes' server spans and their policy calls) to the OTLP collector
    in `TANDEM_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_ENDPOINT`), else to the JSON-lines file in
    `TANDEM_TRACE_FILE`; with neither the app records no spans, and still passes each rollout's trace context
    on to its policy calls."""
    endpoint = os.environ.get("TANDEM_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    trace_file = os.environ.get("TANDEM_TRACE_FILE", "")
    if endpoint or trace_file:
        from mesh.observability import configure_tracing as configure  # noqa: PLC0415

        configure(f"taskapp-{service_name}", endpoint, Path(trace_file or "traces.jsonl"))


def _verifiers_app(env: str, config: str | None) -> TaskApp:
    from tandem_taskapp.verifiers_env import verifiers_task_app  # noqa: PLC0415 - verifiers is optional

    parsed: dict[str, Any] = {}
    if config is not None:
        text = config if config.lstrip().startswith(("{", "[")) else Path(config).read_text()
        try:
            loaded = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--verifiers-config is not JSON: {e}") from None
        if not isinstance(loaded, dict):
            raise ValueError("--verifiers-config must be a JSON object")
        parsed = loaded
    try:
        return verifiers_task_app(env, config=parsed)
    except ValidationError as e:
        raise ValueError(f"the verifiers env config is not valid: {e}") from None


def load_openenv_adapter(path_or_module: str) -> Any:
    """The `OpenEnvAdapter` named by a file path (`path/to/adapter.py[:attr]`) or module (`pkg.mod[:attr]`);
    `attr` defaults to `adapter`."""
    from tandem_taskapp.openenv_env import OpenEnvAdapter  # noqa: PLC0415

    target, attr = _split_target(path_or_module, "adapter")
    module = _import_target(target, "OpenEnv adapter")
    adapter = getattr(module, attr, None)
    if not isinstance(adapter, OpenEnvAdapter):
        raise TypeError(
            f"{target} must define a module-level `{attr}: OpenEnvAdapter` (found {type(adapter).__name__})"
        )
    return adapter


def _openenv_app(url: str, adapter: str) -> TaskApp:
    from tandem_taskapp.openenv_env import openenv_task_app  # noqa: PLC0415

    return openenv_task_app(url, load_openenv_adapter(adapter))


def _read_key(stream: TextIO) -> str:
    key = stream.readline().strip()
    if not key:
        raise ValueError("--key-from-stdin: standard input's first line is empty")
    return key


def build_parser(prog: str = "tandem taskapp serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a Task App over the Tandem Task App contract.")
    p.add_argument(
        "path",
        nargs="?",
        help="the app file (path/to/app.py[:attr]) or module (pkg.mod[:attr]); attr defaults to app",
    )
    p.add_argument(
        "--verifiers",
        metavar="ENV",
        help="serve a verifiers environment instead: an installed taskset id (my-taskset,"
        " owner/my-taskset@1.0) or a path/to/env.py that defines one",
    )
    p.add_argument(
        "--verifiers-config",
        metavar="JSON",
        help="the verifiers env config laid over it, as JSON or a path to a JSON file"
        ' (e.g. \'{"agent": {"max_turns": 4}}\')',
    )
    p.add_argument(
        "--openenv",
        metavar="URL",
        help="serve an OpenEnv environment instead: the base URL of its env server (http://host:port);"
        " each episode holds one /ws session on it",
    )
    p.add_argument(
        "--openenv-adapter",
        metavar="ADAPTER",
        help="with --openenv: the file (path/to/adapter.py[:attr]) or module (pkg.mod[:attr]) defining the"
        " OpenEnvAdapter (observation -> prompt, reply -> action); attr defaults to adapter",
    )
    p.add_argument("--host", default=DEFAULT_HOST, help=f"interface to listen on (default {DEFAULT_HOST})")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})"
    )
    p.add_argument(
        "--key-from-stdin",
        action="store_true",
        help=f"read the environment key from the first line of standard input instead of ${KEY_ENV}",
    )
    p.add_argument(
        "--no-auth", action="store_true", help="serve without an environment key (local experiments only)"
    )
    p.add_argument("--private-health", action="store_true", help="require the key on GET /health too")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def main(argv: Sequence[str] | None = None, *, prog: str = "tandem taskapp serve") -> int:
    """The command line: `serve PATH|--verifiers ENV|--openenv URL --openenv-adapter A [--host H] [--port P]
    [--key-from-stdin] [--no-auth]`.
    Answers the exit status: 0 after a clean shutdown, 2 for a usage or loading error."""
    args = build_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        named = [x for x in (args.path, args.verifiers, args.openenv) if x is not None]
        if len(named) != 1:
            raise ValueError("name the app: a PATH, --verifiers ENV or --openenv URL (one of them)")
        if args.verifiers_config is not None and args.verifiers is None:
            raise ValueError("--verifiers-config goes with --verifiers")
        if (args.openenv_adapter is None) != (args.openenv is None):
            raise ValueError("--openenv URL and --openenv-adapter ADAPTER go together")
        key: str | None = _read_key(sys.stdin) if args.key_from_stdin else os.environ.get(KEY_ENV) or None
        if key is None and not args.no_auth:
            raise ValueError(f"no environment key: set {KEY_ENV}, pass --key-from-stdin, or --no-auth")
        if args.verifiers is not None:
            task_app = _verifiers_app(args.verifiers, args.verifiers_config)
        elif args.openenv is not None:
            task_app = _openenv_app(args.openenv, args.openenv_adapter)
        else:
            task_app = load_task_app(args.path)
    except (ValueError, OSError, ImportError, TypeError, SyntaxError, TaskAppError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if key is None:
        print(f"{prog}: warning: serving {task_app.name} WITHOUT authentication", file=sys.stderr)
    serve(
        task_app,
        args.host,
        args.port,
        key,
        require_key=False,
        public_health=not args.private_health,
        log_level=args.log_level,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(prog="python -m tandem_taskapp.serve"))

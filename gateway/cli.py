"""`tandem`: the command line. Every subcommand talks to the gateway, except `up`, which starts the mesh.

tandem up                 run every service in this process (state in ./.tandem)
tandem up --state-dir D   keep state elsewhere
tandem status             ask a running mesh which services are serving
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from mesh.launcher import MESH_SERVICES, up
from mesh.settings import Settings


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
    from mesh.status import RpcError  # noqa: PLC0415

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: online reinforcement learning for language models, self-hosted.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Settings also come from TANDEM_* environment variables and the TOML file in TANDEM_CONFIG.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p_up = sub.add_parser("up", help="run every Tandem service in this process until Ctrl-C")
    p_up.add_argument("--state-dir", help="folder for databases, keys, logs and traces (default .tandem)")
    p_up.set_defaults(func=_cmd_up)

    p_status = sub.add_parser("status", help="check which services of a running mesh are serving")
    p_status.add_argument("--state-dir", help="state folder of the mesh (default .tandem)")
    p_status.add_argument("--json", action="store_true", help="print JSON for scripts")
    p_status.set_defaults(func=_cmd_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

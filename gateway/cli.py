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


def _read_secret_value(name: str) -> bytes:
    """The value from standard input when it is piped, else from a prompt that does not echo. Never argv:
    command lines end up in shell history and in every process listing."""
    if sys.stdin.isatty():
        import getpass  # noqa: PLC0415

        value = getpass.getpass(f"Value for {name} (input hidden): ").encode()
    else:
        value = sys.stdin.buffer.read().rstrip(b"\r\n")
    if not value:
        raise SystemExit("error: the value is empty; pipe it on standard input or type it at the prompt")
    return value


async def _secrets(args: argparse.Namespace) -> int:
    from tandem.vault.v1 import vault_service_pb2 as pb  # noqa: PLC0415
    from tandem.vault.v1 import vault_service_pb2_grpc  # noqa: PLC0415

    from mesh.clients import open_channel  # noqa: PLC0415
    from mesh.identity import TokenSigner, load_signing_key  # noqa: PLC0415
    from mesh.secrets import seal_for_upload  # noqa: PLC0415
    from mesh.status import RpcError  # noqa: PLC0415

    settings = _settings(args)
    # Until the gateway's API keys exist, the CLI acts as the local administrator of a mesh it can reach
    # the state folder of: it signs its calls with that mesh's key.
    token = TokenSigner(load_signing_key(settings.mesh_key, settings.state_dir)).issue("service", "cli")
    parent = f"orgs/{args.org}"
    async with open_channel(settings.target("vault"), settings, token=token) as channel:
        vault = vault_service_pb2_grpc.VaultServiceStub(channel)
        try:
            if args.action == "put":
                value = _read_secret_value(args.name)
                key = await vault.GetPublicKey(pb.GetPublicKeyRequest(parent=parent))
                sealed = seal_for_upload(key.public_key, value)
                del value
                reply = await vault.PutSecret(
                    pb.PutSecretRequest(
                        parent=parent, secret_id=args.name, key_id=key.key_id, ciphertext=sealed
                    )
                )
                verb = "created" if reply.created else "updated"
                result = {
                    "secret": reply.secret.name,
                    "version": reply.version.version,
                    "result": verb,
                    "fingerprint": reply.version.fingerprint,
                }
                print(
                    json.dumps(result)
                    if args.json
                    else f"{verb} {reply.secret.name} version {reply.version.version}"
                    f" (fingerprint {reply.version.fingerprint})"
                )
            else:
                listed = await vault.ListSecrets(pb.ListSecretsRequest(parent=parent))
                rows = [
                    {
                        "secret": s.name,
                        "versions": s.version_count,
                        "latest": s.latest_version.version,
                        "fingerprint": s.latest_version.fingerprint,
                    }
                    for s in listed.secrets
                ]
                if args.json:
                    print(json.dumps(rows, indent=2))
                else:
                    for row in rows:
                        print(f"{row['secret']:<50} v{row['latest']:<4} {row['fingerprint']}")
        except RpcError as error:
            print(f"error: {error.reason or error.code.name}: {error.message}", file=sys.stderr)
            return 1
    return 0


def _cmd_secrets(args: argparse.Namespace) -> int:
    return asyncio.run(_secrets(args))


def _cmd_taskapp(args: argparse.Namespace) -> int:
    """`tandem taskapp serve|check ...` hands its arguments to the Task App SDK's own commands."""
    if args.action == "serve":
        from tandem_taskapp.serve import main as serve_main  # noqa: PLC0415

        return serve_main(args.rest)
    from tandem_taskapp.check import main as check_main  # noqa: PLC0415

    return check_main(args.rest)


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

    p_secrets = sub.add_parser(
        "secrets",
        help="upload or list organization secrets (values are sealed on this machine before they leave it)",
        description="The value of `put` is read from standard input or a hidden prompt, never from the command "
        "line. It is sealed to the organization's public key here; the vault never sees it in transit.",
    )
    secrets_sub = p_secrets.add_subparsers(dest="action", required=True, metavar="ACTION")
    p_put = secrets_sub.add_parser(
        "put", help="seal and upload a value: `echo -n $KEY | tandem secrets put env-key`"
    )
    p_put.add_argument("name", help="secret id: lowercase letters, digits and hyphens")
    p_list = secrets_sub.add_parser("list", help="list secrets (metadata and fingerprints, never values)")
    for p in (p_put, p_list):
        p.add_argument("--org", default="default", help="organization id (default: default)")
        p.add_argument("--state-dir", help="state folder of the local mesh (default .tandem)")
        p.add_argument("--json", action="store_true", help="print JSON for scripts")
        p.set_defaults(func=_cmd_secrets)

    p_taskapp = sub.add_parser(
        "taskapp",
        help="serve a Task App written with the SDK, or check any Task App against the contract",
        description="`tandem taskapp serve path/to/app.py [--port N] [--key-from-stdin]` runs a Task App; "
        "`tandem taskapp check URL --key-from-stdin` runs the conformance checks and prints a pass/fail table.",
    )
    p_taskapp.add_argument("action", choices=["serve", "check"], help="what to do")
    p_taskapp.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the action (see its --help)")
    p_taskapp.set_defaults(func=_cmd_taskapp)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Render each service's RPC table into its README from the contracts.

For every service named in `READMES`, the table has one row per RPC: its name, request and response
messages, shape (unary or which side streams), idempotency (`idempotency_level` in the contract) and the
first sentence of the comment above the `rpc` line in the `.proto` file. The generated descriptors give the
structure; the comments come from the `.proto` sources, because the generated code does not keep them.

A table lives between a pair of markers that name the service, so one README can hold several:

    <!-- rpc-table:begin tandem.vault.v1.VaultService -->
    ...generated, do not edit...
    <!-- rpc-table:end tandem.vault.v1.VaultService -->

Run `python scripts/rpc_tables.py` to rewrite the tables; `--check` rewrites nothing and exits 1 when a
README's table is out of date or its markers are missing (CI runs that).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor, MethodDescriptor, ServiceDescriptor

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"

# README (relative to the repository root) -> the services whose tables it holds, in page order.
READMES: dict[str, tuple[str, ...]] = {
    "services/vault/README.md": ("tandem.vault.v1.VaultService",),
    "services/scheduler/README.md": ("tandem.scheduler.v1.SchedulerService",),
    "services/taskapp_proxy/README.md": ("tandem.taskapp.v1.TaskAppService",),
    "services/events/README.md": ("tandem.events.v1.EventService",),
    "gateway/README.md": ("tandem.gateway.v1.GatewayService",),
    "trainer/README.md": ("tandem.trainer.v1.TrainerService", "tandem.inference.v1.InferenceService"),
}

MARKER = re.compile(r"<!-- rpc-table:(?P<edge>begin|end) (?P<service>[A-Za-z0-9_.]+) -->")
RPC_LINE = re.compile(r"^\s*rpc\s+(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*\(")
SERVICE_LINE = re.compile(r"^\s*service\s+(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*\{")
COMMENT_LINE = re.compile(r"^\s*//\s?(?P<text>.*)$")
# A sentence ends at `.`, `!` or `?` followed by whitespace or the end, except after these abbreviations.
SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)[.!?](?=\s|$)")

_Level = descriptor_pb2.MethodOptions.IdempotencyLevel
IDEMPOTENCY = {
    _Level.Value("NO_SIDE_EFFECTS"): "read-only",
    _Level.Value("IDEMPOTENT"): "idempotent",
}


class TableError(Exception):
    """A README or contract is not in the shape this script expects."""


@dataclass(frozen=True)
class Rpc:
    name: str
    request: str
    response: str
    shape: str
    idempotency: str
    summary: str


def service_modules() -> Iterator[FileDescriptor]:
    """The file descriptor of every `*_service.proto` contract, imported from its generated module."""
    for proto in sorted(PROTOS.glob("tandem/*/v1/*_service.proto")):
        module_name = ".".join(proto.relative_to(PROTOS).with_suffix("").parts) + "_pb2"
        module = importlib.import_module(module_name)
        descriptor: FileDescriptor = module.DESCRIPTOR
        yield descriptor


def find_service(full_name: str) -> ServiceDescriptor:
    for file in service_modules():
        for service in file.services_by_name.values():
            if service.full_name == full_name:
                return service
    raise TableError(f"no service {full_name} in any protos/tandem/*/v1/*_service.proto")


def rpc_comments(proto_text: str, service: str) -> dict[str, list[str]]:
    """The `//` comment block directly above each `rpc` line of `service`, one entry per comment line."""
    comments: dict[str, list[str]] = {}
    pending: list[str] = []
    current = ""
    for line in proto_text.splitlines():
        if match := SERVICE_LINE.match(line):
            current = match["name"]
            pending = []
        elif match := COMMENT_LINE.match(line):
            pending.append(match["text"].rstrip())
        elif match := RPC_LINE.match(line):
            if current == service:
                comments[match["name"]] = pending
            pending = []
        else:
            pending = []
    return comments


def first_sentence(comment: Sequence[str]) -> str:
    """The first sentence of the comment's first paragraph, on one line."""
    paragraph: list[str] = []
    for line in comment:
        if not line.strip():
            if paragraph:
                break
            continue
        paragraph.append(line.strip())
    text = " ".join(paragraph)
    end = SENTENCE_END.search(text)
    return text[: end.end()] if end else text


def short_name(message: str, package: str) -> str:
    prefix = package + "."
    return message[len(prefix) :] if message.startswith(prefix) else message


def shape(method: MethodDescriptor) -> str:
    client, server = method.client_streaming, method.server_streaming
    if client and server:
        return "bidi stream"
    if client:
        return "client stream"
    if server:
        return "server stream"
    return "unary"


def rpcs(full_name: str) -> list[Rpc]:
    service = find_service(full_name)
    package = service.file.package
    comments = rpc_comments((PROTOS / service.file.name).read_text(encoding="utf-8"), service.name)
    rows: list[Rpc] = []
    for method in service.methods:
        comment = comments.get(method.name)
        if not comment:
            raise TableError(f"{service.file.name}: rpc {method.name} has no leading comment")
        level = method.GetOptions().idempotency_level
        rows.append(
            Rpc(
                name=method.name,
                request=short_name(method.input_type.full_name, package),
                response=short_name(method.output_type.full_name, package),
                shape=shape(method),
                idempotency=IDEMPOTENCY.get(level, "no"),
                summary=first_sentence(comment),
            )
        )
    return rows


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(full_name: str) -> str:
    """The Markdown that goes between the service's markers, without the markers."""
    service = find_service(full_name)
    lines = [
        "<!-- Generated by scripts/rpc_tables.py from the contracts; edit the .proto comments, not this. -->",
        "",
        f"`{full_name}` in [`protos/{service.file.name}`](/protos/{service.file.name})",
        "",
        "| RPC | Request → response | Shape | Read-only / idempotent | Summary |",
        "|---|---|---|---|---|",
    ]
    for rpc in rpcs(full_name):
        lines.append(
            f"| `{rpc.name}` | `{rpc.request}` → `{rpc.response}` | {rpc.shape} | {rpc.idempotency} "
            f"| {cell(rpc.summary)} |"
        )
    lines += [
        "",
        "*read-only*: `idempotency_level = NO_SIDE_EFFECTS`; *idempotent*: `IDEMPOTENT`, safe to retry; "
        "*no*: neither, so the RPC's comment says how to retry (usually the same `request_id`).",
    ]
    return "\n".join(lines)


def update(text: str, services: Sequence[str], path: str) -> str:
    """`text` with the region of each service's marker pair replaced by its current table."""
    found = [(m["edge"], m["service"]) for m in MARKER.finditer(text)]
    names = [service for edge, service in found if edge == "begin"]
    if sorted(names) != sorted(services):
        raise TableError(f"{path}: expected rpc-table markers for {list(services)}, found {names}")
    for service in services:
        begin = f"<!-- rpc-table:begin {service} -->"
        end = f"<!-- rpc-table:end {service} -->"
        if text.count(begin) != 1 or text.count(end) != 1:
            raise TableError(f"{path}: needs exactly one `{begin}` and one `{end}`")
        start = text.index(begin) + len(begin)
        stop = text.index(end)
        if stop < start:
            raise TableError(f"{path}: `{end}` comes before `{begin}`")
        text = text[:start] + "\n" + render(service) + "\n" + text[stop:]
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    args = parser.parse_args(argv)
    stale: list[str] = []
    try:
        for relative, services in READMES.items():
            path = ROOT / relative
            if not path.is_file():
                raise TableError(f"{relative}: missing")
            current = path.read_text(encoding="utf-8")
            wanted = update(current, services, relative)
            if wanted == current:
                continue
            stale.append(relative)
            if not args.check:
                path.write_text(wanted, encoding="utf-8")
    except TableError as error:
        print(f"rpc_tables: {error}", file=sys.stderr)
        return 1
    if args.check and stale:
        print("rpc_tables: out of date: " + ", ".join(stale), file=sys.stderr)
        print("rpc_tables: run `python scripts/rpc_tables.py` and commit the result", file=sys.stderr)
        return 1
    for relative in stale:
        print(f"rpc_tables: updated {relative}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

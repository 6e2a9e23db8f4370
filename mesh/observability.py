"""Structured logs and OpenTelemetry tracing for every Tandem process.

Logs are JSON lines (or text for people) carrying the request id, the caller and the trace id of the call
being served. Spans go to an OTLP collector when one is configured and to a local JSON-lines file
otherwise, so a trace can always be inspected after the fact.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util import ns_to_iso_str
from opentelemetry.trace import SpanContext

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("tandem_request_id", default="")
caller_var: contextvars.ContextVar[str] = contextvars.ContextVar("tandem_caller", default="")

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, context, and any `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if rid := request_id_var.get():
            entry["request_id"] = rid
        if caller := caller_var.get():
            entry["caller"] = caller
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            entry["trace_id"] = format(span.trace_id, "032x")
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str = "INFO", fmt: str = "json", stream: IO[str] | None = None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # httpx logs every request at INFO; the proxy's own rpc line already records each rollout.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))


def _context(context: SpanContext) -> dict[str, str]:
    return {
        "trace_id": f"0x{trace.format_trace_id(context.trace_id)}",
        "span_id": f"0x{trace.format_span_id(context.span_id)}",
        "trace_state": repr(context.trace_state),
    }


def _attributes(attributes: Any) -> dict[str, Any] | None:
    return attributes if attributes is None or isinstance(attributes, dict) else dict(attributes)


def _stamp(ns: int | None) -> str | None:
    return ns_to_iso_str(ns) if ns else None


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans to a file, one OTLP-shaped JSON object per line: `ReadableSpan.to_json()`
    written compactly. Built here rather than by it, which encoded the process's resource with the
    pure-Python (indented) JSON encoder for every span and parsed the result back: half the mesh's CPU when
    every rollout ends two spans."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._path = path
        self._lock = threading.Lock()
        self._resource: tuple[Resource, dict[str, Any]] | None = None  # the provider's one, encoded once

    def _encoded(self, resource: Resource) -> dict[str, Any]:
        if self._resource is None or self._resource[0] is not resource:
            self._resource = (resource, json.loads(resource.to_json()))
        return self._resource[1]

    def line(self, span: ReadableSpan) -> str:
        """The span as `json.dumps(json.loads(span.to_json()), separators=(",", ":"))` writes it."""
        status: dict[str, str] = {"status_code": span.status.status_code.name}
        if span.status.description:
            status["description"] = span.status.description
        body = {
            "name": span.name,
            "context": _context(span.context) if span.context else None,
            "kind": str(span.kind),
            "parent_id": f"0x{trace.format_span_id(span.parent.span_id)}"
            if span.parent is not None
            else None,
            "start_time": _stamp(span.start_time),
            "end_time": _stamp(span.end_time),
            "status": status,
            "attributes": _attributes(span.attributes),
            "events": [
                {
                    "name": event.name,
                    "timestamp": ns_to_iso_str(event.timestamp),
                    "attributes": _attributes(event.attributes),
                }
                for event in span.events
            ],
            "links": [
                {"context": _context(link.context), "attributes": _attributes(link.attributes)}
                for link in span.links
            ],
            "resource": self._encoded(span.resource),
        }
        return json.dumps(body, separators=(",", ":"))

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [self.line(span) for span in spans]
        with self._lock:  # owner-only from the first span on: tasks may run as other users
            fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a") as handle:
                handle.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


_configured = False
_trace_file: Path | None = None  # where this process's spans go, when a file


def trace_file_in_use() -> Path | None:
    """The span file this process writes (the first mesh's to start, in a one-process session), or None."""
    return _trace_file


def configure_tracing(service_name: str, otlp_endpoint: str, trace_file: Path) -> None:
    """Install the global tracer provider once per process (the one-process mesh shares it)."""
    global _configured, _trace_file  # noqa: PLW0603 - OpenTelemetry's provider is process-global by design
    if _configured:
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter: SpanExporter
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: PLC0415

        exporter = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=not otlp_endpoint.startswith("https"))
    else:
        exporter = JsonLinesSpanExporter(trace_file)
        _trace_file = trace_file
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _configured = True


def flush_tracing() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush()

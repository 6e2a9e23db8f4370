"""The span file: each line is exactly the span's own `to_json()`, written compactly."""

from __future__ import annotations

import json
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mesh.observability import JsonLinesSpanExporter


def _spans() -> tuple[ReadableSpan, ...]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "tandem-test", "n": 3}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span(
        "outer", kind=trace.SpanKind.SERVER, attributes={"a": "é", "b": [1, 2]}
    ):
        with tracer.start_as_current_span("inner", kind=trace.SpanKind.CLIENT) as inner:
            inner.add_event("retry", {"attempt": 2, "ok": False, "ratio": 0.25})
            inner.set_status(trace.StatusCode.ERROR, "the app answered HTTP 503")
        link = trace.Link(inner.get_span_context(), {"why": "joined"})
        with tracer.start_span("linked", links=[link]):
            pass
    return memory.get_finished_spans()


def test_each_line_is_the_spans_to_json_written_compactly(tmp_path: Path) -> None:
    spans = _spans()
    path = tmp_path / "traces.jsonl"
    JsonLinesSpanExporter(path).export(spans)
    lines = path.read_text().splitlines()
    assert lines == [json.dumps(json.loads(span.to_json()), separators=(",", ":")) for span in spans]
    assert {json.loads(line)["name"] for line in lines} == {"outer", "inner", "linked"}

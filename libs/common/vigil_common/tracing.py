"""OpenTelemetry setup and W3C trace-context propagation through bus message headers.

Each service gets its own tracer provider (so one process hosting every service still
names each span's service correctly). Spans are exported over OTLP/HTTP when the standard
`OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; otherwise
they are created and dropped, which costs next to nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract as _extract
from opentelemetry.propagate import inject as _inject
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter


def otlp_configured() -> bool:
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def setup_tracing(
    service_name: str, exporter: SpanExporter | None = None, *, trace_file: Path | None = None
) -> TracerProvider:
    """A tracer provider for one service.

    Spans go over OTLP when configured, to `exporter` when given (tests), and as JSON lines
    to `trace_file` when given (`VIGIL_TRACE_FILE`: traces without a collector).
    """
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: f"vigil-{service_name}"}))
    if exporter is None and otlp_configured():
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    if trace_file is not None:
        trace_file.parent.mkdir(parents=True, exist_ok=True)
        out = trace_file.open("a", buffering=1)  # closed with the process; line-buffered JSON lines
        lines = ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
        provider.add_span_processor(BatchSpanProcessor(lines))
    return provider


def inject(headers: dict[str, str], context: otel_context.Context | None = None) -> dict[str, str]:
    """Write the current (or given) trace context into `headers` as `traceparent`/`tracestate`."""
    _inject(headers, context=context)
    return headers


def extract(headers: dict[str, str] | None) -> otel_context.Context:
    """The trace context carried by a message's headers (an empty context when there is none)."""
    return _extract(headers or {})


def tracer(provider: TracerProvider | None, name: str) -> trace.Tracer:
    """A tracer from `provider`, or the global (no-op unless configured) one."""
    return provider.get_tracer(name) if provider is not None else trace.get_tracer(name)

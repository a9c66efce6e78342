"""OpenTelemetry for the worker: continue the request's ``traceparent``; export over OTLP.

The SDK is set up in each worker process (after the prefork fork) when the standard variables
ask for it (``OTEL_TRACES_EXPORTER=otlp`` or ``OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT``); otherwise
spans are no-ops. The pipeline's spans (cuvil.load, cuvil.export … cuvil.push) become children of
one ``cuvil.compile_target`` span in the caller's trace, whose id the artifact records.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from opentelemetry import context, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)
tracer = trace.get_tracer("cuvil.worker")
_provider = None


def wants_export(env: dict[str, str] | None = None) -> bool:
    env = dict(os.environ if env is None else env)
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "") == "none":
        return False
    return bool(
        env.get("OTEL_TRACES_EXPORTER")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def setup_tracing() -> None:
    """Install an SDK tracer provider exporting over OTLP/gRPC (once per process)."""
    global _provider
    if _provider is not None or not wants_export():
        return
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_* asks for traces but opentelemetry-sdk is missing (cuvil[telemetry])")
        return
    service = os.environ.get("OTEL_SERVICE_NAME", "cuvil-worker")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider


def flush(timeout_ms: int = 5000) -> None:
    if _provider is not None:
        _provider.force_flush(timeout_ms)


def shutdown() -> None:
    if _provider is not None:
        _provider.shutdown()


@contextlib.contextmanager
def continued(traceparent: str | None, name: str, **attributes: str) -> Iterator[trace.Span]:
    """A span named ``name`` continuing ``traceparent`` (a new trace when it is absent)."""
    parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent or ""})
    token = context.attach(parent)
    try:
        with tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span
    finally:
        context.detach(token)
        flush()


def trace_id_of(span: trace.Span) -> str | None:
    span_context = span.get_span_context()
    if not span_context.is_valid:
        return None
    return format(span_context.trace_id, "032x")


def current_traceparent() -> str | None:
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent")

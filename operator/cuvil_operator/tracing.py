"""The root of every compile trace: one ``cuvil.compilation`` span per attempt, exported by
the operator over OTLP when ``OTEL_*`` asks for traces (as the workers do).

Its trace and span ids are the ones ``build_traceparent`` derives from uid, generation and
attempt, the traceparent the workers continue, so their spans are its children. It is
written when the compile ends (Succeeded, Failed, cancelled), from ``status.queuedAt`` to
then, with the outcome as its status: built from the object's status, it survives operator
restarts, and a compile that runs for hours is still one span.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from cuvil_worker.telemetry import wants_export

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, Any] = {}


def setup() -> None:
    """An SDK tracer provider of the operator's own, exporting over OTLP/gRPC (once)."""
    if _state or not wants_export():
        return
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
    except ImportError:
        log.warning("OTEL_* asks for traces but opentelemetry-sdk is missing")
        return

    class FixedIds(IdGenerator):
        """Hands out the ids set in ``pending`` (under ``_lock``), else random ones."""

        def __init__(self) -> None:
            self.pending: tuple[int, int] | None = None
            self.random = RandomIdGenerator()

        def generate_trace_id(self) -> int:
            return self.pending[0] if self.pending else self.random.generate_trace_id()

        def generate_span_id(self) -> int:
            return self.pending[1] if self.pending else self.random.generate_span_id()

    ids = FixedIds()
    service = os.environ.get("OTEL_SERVICE_NAME", "cuvil-operator")
    provider = TracerProvider(resource=Resource.create({"service.name": service}), id_generator=ids)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _state.update(provider=provider, ids=ids, tracer=provider.get_tracer("cuvil.operator"))


def shutdown() -> None:
    if _state:
        _state["provider"].shutdown()


def _nanoseconds(rfc3339: str) -> int:
    moment = datetime.datetime.fromisoformat(rfc3339.replace("Z", "+00:00"))
    return int(moment.timestamp() * 1e9)


def export_root(
    traceparent: str,
    start: str,
    end: str,
    attributes: Mapping[str, str | int],
    error: str | None = None,
) -> None:
    """Write the root span of the trace ``traceparent`` names (its own span id included)."""
    if not _state:
        return
    from opentelemetry import context
    from opentelemetry.trace import Status, StatusCode

    _, trace_id, span_id, _ = traceparent.split("-")
    with _lock:
        _state["ids"].pending = (int(trace_id, 16), int(span_id, 16))
        try:
            span = _state["tracer"].start_span(
                "cuvil.compilation",
                context=context.Context(),
                start_time=_nanoseconds(start),
                attributes=dict(attributes),
            )
        finally:
            _state["ids"].pending = None
    span.set_status(Status(StatusCode.ERROR, error) if error else Status(StatusCode.OK))
    span.end(end_time=max(_nanoseconds(end), _nanoseconds(start)))

"""OpenTelemetry for the sidecar: a tracer provider from the standard ``OTEL_*`` variables, the
per-request child spans, and the link to the trace that compiled the artifact.

Span tree per ModelInfer (the server span comes from opentelemetry-instrumentation-grpc on the
grpcio front end, from ``server_span`` on the native one, from ``http_span`` over REST; all
continue the caller's W3C ``traceparent``)::

    /inference.GRPCInferenceService/ModelInfer     (server span, kind SERVER)
      cuvil.infer      decode, wait, encode; linked to the compile trace when the artifact has one
        cuvil.queue    enqueued -> its batch starts executing
        cuvil.batch    the joined batch this request rode in (requests, rows, and whether it
                       ran inline on the event loop; see ``batcher``)
          cuvil.execute   the model run

The batch runs once for many requests, so its spans are recorded afterwards with the measured
start and end times, once under each request's trace.

A generation request has one ``cuvil.generate`` span from its arrival to its last token,
with a ``first_token`` event and the attributes ``cuvil.generate.time_to_first_token_ms``,
``cuvil.generate.prompt_tokens``, ``cuvil.generate.tokens`` and ``cuvil.generate.finish_reason``.

Environment: ``OTEL_SDK_DISABLED``; ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console`` or ``none``;
when unset, ``otlp`` if an ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` is set, else none, so an
unconfigured sidecar does not retry a collector that is not there); ``OTEL_SERVICE_NAME``
(default ``cuvil-sidecar``), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER[_ARG]``,
``OTEL_EXPORTER_OTLP_*`` and ``OTEL_BSP_*`` are read by the SDK itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

log = logging.getLogger("cuvil_sidecar.tracing")
tracer = trace.get_tracer("cuvil_sidecar")
_NO_SPAN = nullcontext()
_enabled = False  # set by configure(): whether a tracer provider records the sidecar's spans

# Where an artifact carries the trace of the compile that made it (a bare 32-hex trace id, as
# the worker annotates its manifests, or a W3C traceparent): the OCI manifest's annotations
# (merged into config["annotations"] at load), the config's own annotations, or its top level.
COMPILE_TRACE_KEYS = (
    "dev.cuvil.trace-id",
    "dev.cuvil.compile.traceparent",
    "dev.cuvil.compile.trace-id",
)


def configure(environ: Mapping[str, str] | None = None) -> Any:
    """Install the global tracer provider; returns it (for shutdown) or None when tracing is
    off."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporters = [
        name.strip().lower()
        for name in env.get("OTEL_TRACES_EXPORTER", "").split(",")
        if name.strip()
    ]
    if not exporters and (
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        exporters = ["otlp"]
    exporters = [name for name in exporters if name != "none"]
    if not exporters:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME", "cuvil-sidecar")})
    provider = TracerProvider(resource=resource)
    for name in exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            log.warning("OTEL_TRACES_EXPORTER %r is not supported here; ignored", name)
    trace.set_tracer_provider(provider)
    global _enabled
    _enabled = True
    return provider


def infer_span(model: str, digest: str, links: Sequence[Link]) -> AbstractContextManager[Any]:
    """The ``cuvil.infer`` span of one request, current while the request is served; nothing
    at all when ``configure`` installed no tracer provider (a no-op span still makes objects
    and sets and resets the current context on every request, and there is no server span for
    it to join either)."""
    if not _enabled:
        return _NO_SPAN
    return tracer.start_as_current_span(
        "cuvil.infer", links=links, attributes={"cuvil.model": model, "cuvil.model.digest": digest}
    )


def server_span(
    path: str, metadata: Callable[[], Sequence[tuple[str, Any]]]
) -> AbstractContextManager[Any]:
    """The SERVER span of one call on the native front end, continuing the caller's
    ``traceparent`` from the call's metadata (read only when tracing is on), named and
    attributed as opentelemetry-instrumentation-grpc names grpcio's."""
    if not _enabled:
        return _NO_SPAN
    carrier = {key: value for key, value in metadata() if isinstance(value, str)}
    service, _, method = path.lstrip("/").partition("/")
    return tracer.start_as_current_span(
        path,
        context=propagate.extract(carrier),
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
    )


def http_span(route: str, headers: Mapping[str, str]) -> AbstractContextManager[Any]:
    """The SERVER span of one REST request, continuing the caller's ``traceparent`` header."""
    if not _enabled:
        return _NO_SPAN
    method, _, _ = route.partition(" ")
    return tracer.start_as_current_span(
        route,
        context=propagate.extract(dict(headers)),
        kind=SpanKind.SERVER,
        attributes={"http.request.method": method, "http.route": route.partition(" ")[2]},
    )


def set_rpc_status(span: Any, code: int, details: str) -> None:
    """The call's gRPC status on its server span (from ``server_span``)."""
    if span is None:
        return
    span.set_attribute("rpc.grpc.status_code", code)
    if code != 0:
        span.set_status(Status(StatusCode.ERROR, details))


def server_interceptors(provider: Any) -> list[Any]:
    if provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

    # Health probes are not traced (nor are they on the native front end); the interceptor
    # also breaks the streaming Watch on grpcio's asyncio server.
    return [
        aio_server_interceptor(
            tracer_provider=provider, filter_=filters.negate(filters.health_check())
        )
    ]


def compile_links(config: Mapping[str, Any]) -> tuple[Link, ...]:
    """A link to the compile trace recorded in the artifact config, if any."""
    annotations = config.get("annotations") or {}
    for key in COMPILE_TRACE_KEYS:
        value = annotations.get(key) or config.get(key)
        context = _span_context(str(value)) if value else None
        if context is not None:
            return (Link(context, {"cuvil.link": "compile"}),)
    return ()


def _span_context(text: str) -> SpanContext | None:
    """``00-<trace>-<span>-<flags>`` or a bare 32-hex trace id -> a remote SpanContext."""
    parts = text.strip().split("-")
    try:
        if len(parts) == 4:
            trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
        else:
            trace_id, span_id, flags = int(text, 16), 1, 1
    except ValueError:
        return None
    if not (0 < trace_id < 2**128 and 0 < span_id < 2**64):
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags & 1))


def record_batch_spans(
    *,
    enqueued_ns: int,
    started_ns: int,
    finished_ns: int,
    requests: int,
    rows: int,
    inline: bool = False,
) -> None:
    """The queue/batch/execute spans of one request, under the current (cuvil.infer) span."""
    if not _enabled:
        return
    current = trace.get_current_span()
    if not current.get_span_context().is_valid or not current.is_recording():
        return
    queue = tracer.start_span("cuvil.queue", start_time=enqueued_ns)
    queue.end(end_time=started_ns)
    batch = tracer.start_span(
        "cuvil.batch",
        start_time=started_ns,
        attributes={
            "cuvil.batch.requests": requests,
            "cuvil.batch.rows": rows,
            "cuvil.batch.inline": inline,
        },
    )
    execute = tracer.start_span(
        "cuvil.execute", context=trace.set_span_in_context(batch), start_time=started_ns
    )
    execute.end(end_time=finished_ns)
    batch.end(end_time=finished_ns)


def start_generate_span(model: str, digest: str, links: Sequence[Link]) -> Any:
    """The ``cuvil.generate`` span of one generation request (a child of the current span),
    ended by ``end_generate_span``; None when tracing is off."""
    if not _enabled:
        return None
    return tracer.start_span(
        "cuvil.generate",
        links=links,
        attributes={"cuvil.model": model, "cuvil.model.digest": digest},
    )


def first_token(span: Any, seconds: float) -> None:
    if span is not None:
        span.add_event("first_token")
        span.set_attribute("cuvil.generate.time_to_first_token_ms", seconds * 1e3)


def end_generate_span(
    span: Any, *, prompt_tokens: int = 0, tokens: int = 0, finish: str = "", error: str = ""
) -> None:
    if span is None:
        return
    span.set_attribute("cuvil.generate.prompt_tokens", prompt_tokens)
    span.set_attribute("cuvil.generate.tokens", tokens)
    span.set_attribute("cuvil.generate.finish_reason", finish or "refused")
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()

"""The demo's traces: its own spans (the worker's compile spans run in this process) kept in
memory, the sidecar's spans received over OTLP/gRPC on 127.0.0.1, and one tree printed per trace.

The sidecar exports exactly as it would to a collector (``OTEL_EXPORTER_OTLP_ENDPOINT`` points at
``OtlpReceiver.endpoint``); both sources become ``ReceivedSpan``s so one printer shows the compile
and the serving spans of a model under the same root.
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import trace

from cuvil.otlp_receiver import ReceivedSpan


class LocalSpans:
    """An SDK tracer provider for this process whose finished spans stay in memory."""

    def __init__(self, service: str = "cuvil-demo") -> None:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        self.service = service
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def install(self) -> LocalSpans:
        trace.set_tracer_provider(self.provider)
        return self

    def records(self) -> list[ReceivedSpan]:
        records = []
        for span in self.exporter.get_finished_spans():
            context = span.context
            if context is None:
                continue
            records.append(
                ReceivedSpan(
                    name=span.name,
                    trace_id=format(context.trace_id, "032x"),
                    span_id=format(context.span_id, "016x"),
                    parent_span_id=format(span.parent.span_id, "016x") if span.parent else "",
                    start_ns=span.start_time or 0,
                    end_ns=span.end_time or 0,
                    service=self.service,
                )
            )
        return records


def current_trace_id() -> str:
    return format(trace.get_current_span().get_span_context().trace_id, "032x")


def render_tree(spans: Iterable[ReceivedSpan], trace_id: str, repeat_limit: int = 1) -> list[str]:
    """The spans of one trace as an indented tree; siblings of one name beyond ``repeat_limit``
    fold into one line (count, p50 ms) so that N requests do not print N subtrees."""
    mine = sorted((s for s in spans if s.trace_id == trace_id), key=lambda s: s.start_ns)
    ids = {s.span_id for s in mine}
    children: dict[str, list[ReceivedSpan]] = {}
    for span in mine:
        parent = span.parent_span_id if span.parent_span_id in ids else ""
        children.setdefault(parent, []).append(span)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        seen: dict[str, list[ReceivedSpan]] = {}
        for span in children.get(parent, []):
            seen.setdefault(span.name, []).append(span)
        for span in children.get(parent, []):
            group = seen[span.name]
            position = group.index(span)
            if position < repeat_limit:
                service = f"  [{span.service}]" if span.service != "cuvil-demo" else ""
                lines.append(f"{'  ' * depth}{span.name}  {span.ms:.1f} ms{service}")
                walk(span.span_id, depth + 1)
            elif position == repeat_limit:
                rest = sorted(s.ms for s in group[repeat_limit:])
                lines.append(
                    f"{'  ' * depth}… {len(rest)} more {span.name} "
                    f"(p50 {rest[len(rest) // 2]:.1f} ms)"
                )

    walk("", 0)
    return lines

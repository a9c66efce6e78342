"""A real OTLP/gRPC trace receiver on 127.0.0.1 that keeps every span it is sent.

Built on opentelemetry-proto's TraceServiceServicer, so exporters talk to it exactly as to a
collector: point a process at ``receiver.endpoint`` with ``OTEL_EXPORTER_OTLP_ENDPOINT``. The
demo prints the spans it receives; the tests assert on them (``tests/fixtures/otlp.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_span_id: str  # "" for a root
    kind: int = 0
    service: str = ""
    attributes: dict[str, object] = field(default_factory=dict)
    links: tuple[str, ...] = ()  # trace ids (hex) of linked spans
    start_ns: int = 0
    end_ns: int = 0

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _spans_of(request: Any) -> list[ReceivedSpan]:
    received = []
    for resource_spans in request.resource_spans:
        resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                attributes = {
                    a.key: getattr(a.value, a.value.WhichOneof("value"))
                    for a in span.attributes
                    if a.value.WhichOneof("value")
                }
                received.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        service=resource.get("service.name", ""),
                        attributes=attributes,
                        links=tuple(link.trace_id.hex() for link in span.links),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                    )
                )
    return received


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"

    def Export(self, request: Any, context: Any) -> Any:
        received = _spans_of(request)
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(0)

    def in_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20.0
    ) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

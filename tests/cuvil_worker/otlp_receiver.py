"""A minimal OTLP/gRPC trace receiver: the worker exports to it as to a collector; tests assert."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    service: str


@dataclass
class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: Any = None
    port: int = 0

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = resource_spans.resource
                attributes = {a.key: a.value.string_value for a in resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(
                            ReceivedSpan(
                                span.name,
                                span.trace_id.hex(),
                                span.span_id.hex(),
                                span.parent_span_id.hex(),
                                attributes.get("service.name", ""),
                            )
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [span for span in self.spans if span.trace_id == trace_id]

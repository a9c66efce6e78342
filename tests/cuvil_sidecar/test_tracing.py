"""A request carrying a W3C traceparent yields the sidecar's spans in that trace, as received by
a real OTLP/gRPC receiver: the server span continues the caller's span, and cuvil.infer (linked
to the compile trace recorded in the artifact) holds queue, batch and execute."""

from __future__ import annotations

import secrets

import numpy as np
import tritonclient.grpc as grpcclient

from tests.cuvil_sidecar.conftest import COMPILE_TRACE_ID, Sidecar
from tests.fixtures.otlp import OtlpReceiver

SPAN_KIND_SERVER = 2
WANTED = {"cuvil.infer", "cuvil.queue", "cuvil.batch", "cuvil.execute"}


def test_traceparent_continues_into_server_spans(
    mlp_sidecar: Sidecar, otlp_receiver: OtlpReceiver
) -> None:
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    client = grpcclient.InferenceServerClient(mlp_sidecar.url)
    item = grpcclient.InferInput("x", [2, 784], "FP32")
    item.set_data_from_numpy(np.ones((2, 784), np.float32))
    client.infer("mlp", [item], headers={"traceparent": f"00-{trace_id}-{caller_span}-01"})
    client.close()

    def complete(spans: list) -> bool:
        names = {span.name for span in spans if span.trace_id == trace_id}
        return names >= WANTED and any("ModelInfer" in name for name in names)

    otlp_receiver.wait_for(complete)
    spans = {span.name: span for span in otlp_receiver.in_trace(trace_id)}
    assert set(spans) >= WANTED, sorted(spans)
    server = next(span for name, span in spans.items() if name.endswith("/ModelInfer"))
    assert server.kind == SPAN_KIND_SERVER
    assert server.parent_span_id == caller_span
    assert server.service == "cuvil-sidecar-test"
    infer = spans["cuvil.infer"]
    assert infer.parent_span_id == server.span_id
    assert COMPILE_TRACE_ID in infer.links
    assert spans["cuvil.queue"].parent_span_id == infer.span_id
    assert spans["cuvil.batch"].parent_span_id == infer.span_id
    assert spans["cuvil.execute"].parent_span_id == spans["cuvil.batch"].span_id
    assert spans["cuvil.batch"].attributes["cuvil.batch.rows"] >= 2

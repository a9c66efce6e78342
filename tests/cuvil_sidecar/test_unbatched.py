"""The MLP sidecar with batching off, where a quick model runs each request on the event loop
instead of handing it to a worker thread: those requests still get their server, queue, batch
and execute spans in the caller's trace, and still move every counter in /metrics."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.cuvil_sidecar.conftest import Sidecar, ready_sidecar
from tests.cuvil_sidecar.test_server import metric, scrape
from tests.fixtures.otlp import OtlpReceiver

REQUESTS = 40  # the first runs on the worker thread; once runs are known quick, they go inline
WANTED = {"cuvil.infer", "cuvil.queue", "cuvil.batch", "cuvil.execute"}


@pytest.fixture(scope="module")
def unbatched_sidecar(
    mlp_artifact: Path, tmp_path_factory: pytest.TempPathFactory, otlp_receiver: OtlpReceiver
) -> Iterator[Sidecar]:
    sidecar = Sidecar(
        mlp_artifact,
        tmp_path_factory.mktemp("unbatched-sidecar") / "sidecar.log",
        CUVIL_MAX_BATCH_SIZE="1",
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_receiver.endpoint,
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_SERVICE_NAME="cuvil-sidecar-unbatched",
    )
    with ready_sidecar(sidecar):
        yield sidecar


def test_inline_requests_keep_spans_and_metrics(
    unbatched_sidecar: Sidecar, otlp_receiver: OtlpReceiver
) -> None:
    before = scrape(unbatched_sidecar)
    client = grpcclient.InferenceServerClient(unbatched_sidecar.url)
    item = grpcclient.InferInput("x", [1, 784], "FP32")
    item.set_data_from_numpy(np.ones((1, 784), np.float32))
    callers = {}
    for _ in range(REQUESTS):
        trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
        client.infer("mlp", [item], headers={"traceparent": f"00-{trace_id}-{caller_span}-01"})
        callers[trace_id] = caller_span
    client.close()
    after = scrape(unbatched_sidecar)
    for name in ("nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count"):
        assert metric(after, name) - metric(before, name) == REQUESTS, (name, after)
    for name in ("nv_inference_request_duration_us", "nv_inference_compute_infer_duration_us"):
        assert metric(after, name) > metric(before, name), (name, after)

    def complete(spans: list) -> bool:
        batches = [span for span in spans if span.name == "cuvil.batch"]
        return sum(span.trace_id in callers for span in batches) == REQUESTS

    received = otlp_receiver.wait_for(complete)
    inline = [
        span.trace_id
        for span in received
        if span.name == "cuvil.batch"
        and span.trace_id in callers
        and span.attributes["cuvil.batch.inline"]
    ]
    assert inline, "no request ran inline"
    trace_id = inline[-1]
    spans = {span.name: span for span in otlp_receiver.in_trace(trace_id)}
    assert set(spans) >= WANTED, sorted(spans)
    server = next(span for name, span in spans.items() if name.endswith("/ModelInfer"))
    assert server.parent_span_id == callers[trace_id]
    assert spans["cuvil.infer"].parent_span_id == server.span_id
    assert spans["cuvil.batch"].parent_span_id == spans["cuvil.infer"].span_id
    assert spans["cuvil.execute"].parent_span_id == spans["cuvil.batch"].span_id
    assert spans["cuvil.batch"].attributes["cuvil.batch.requests"] == 1

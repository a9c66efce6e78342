"""The operator's span is the root of the compile trace: kmock as the API, ``cuvil-operator``
and a real ``cuvil-worker``, both exporting over OTLP to a receiver in the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cuvil.otlp_receiver import OtlpReceiver
from tests.cuvil_operator.compilations import apply, mlp_compilation, phase_of
from tests.cuvil_operator.conftest import Operator, celery_env, wait_for
from tests.cuvil_worker.workers import start_worker, worker_env
from tests.fixtures.kube import KubeApi
from tests.fixtures.redis import RedisServer
from tests.fixtures.registry import RunningRegistry, registry

__all__ = ["registry"]
pytestmark = pytest.mark.slow


@pytest.fixture
def otlp() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    receiver.start()
    yield receiver
    receiver.stop()


def test_the_operator_span_is_the_root_of_the_compile_trace(
    kube_api: KubeApi,
    redis_server: RedisServer,
    registry: RunningRegistry,
    otlp: OtlpReceiver,
    tmp_path: Path,
) -> None:
    telemetry = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    env = {**celery_env(redis_server), **kube_api.env(), "CUVIL_OPERATOR_POLL_INTERVAL": "0.05",
           **telemetry}  # fmt: skip
    operator = Operator(env, tmp_path / "operator.log").start()
    worker = start_worker(
        worker_env(redis_server.url(0), redis_server.url(1), tmp_path / "work",
                   CUVIL_WARM_UP="0", CUVIL_BENCH_ITERATIONS="3", **telemetry),
        tmp_path, name="traced",
    )  # fmt: skip
    try:
        worker.wait_ready()
        apply(kube_api, mlp_compilation("traced", registry), tmp_path)
        done = wait_for(lambda: phase_of(kube_api, "traced", "Succeeded", "Failed"), 120)
        assert done["status"]["phase"] == "Succeeded", done["status"].get("message")
        trace_id = done["status"]["traceId"]

        def spans() -> list[Any] | None:
            found = otlp.in_trace(trace_id)
            names = {s.name for s in found}
            return found if {"cuvil.compilation", "cuvil.compile_target"} <= names else None

        found = wait_for(spans, 30, "the operator's and the worker's spans")
    finally:
        worker.stop()
        operator.stop()
    (root,) = [s for s in found if s.name == "cuvil.compilation"]
    assert root.parent_span_id == "", "the operator's span has a parent"
    ids = {s.span_id for s in found}
    orphans = [s.name for s in found if s.parent_span_id and s.parent_span_id not in ids]
    assert orphans == [], f"spans whose parent nobody sent: {orphans}"
    compile_spans = [s for s in found if s.name in ("cuvil.compile_target", "cuvil.push_index")]
    assert compile_spans and all(s.parent_span_id == root.span_id for s in compile_spans)

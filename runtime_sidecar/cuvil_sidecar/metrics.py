"""Prometheus metrics under Triton's names, and the sidecar's small HTTP endpoint.

Triton exposes its counters without the ``_total`` suffix (``nv_inference_count{model="m",
version="1"} 12``); prometheus_client always appends ``_total`` to counters, so dashboards built
for Triton would not find them. These few counters are therefore kept here and written in the
text exposition format directly; everything prometheus_client's default registry holds
(process metrics) follows them.

Counters, per model and version (durations are cumulative microseconds, as in Triton):
``nv_inference_request_success``, ``nv_inference_request_failure``, ``nv_inference_count``
(rows inferred), ``nv_inference_exec_count`` (model executions; fewer than requests when
batching joins them), ``nv_inference_request_duration_us``, ``nv_inference_queue_duration_us``,
``nv_inference_compute_infer_duration_us``. Gauges: ``nv_inference_pending_request_count``,
``cuvil_model_ready``; counters ``cuvil_model_reloads`` with ``result`` ok/refused;
``cuvil_model_info{model, version, digest, index}`` 1 for the artifact served (``digest``: the
OCI manifest, as in the ModelCompilation's status.artifacts[]; ``index``: the index it came
from, empty when none).
"""

from __future__ import annotations

import http.server
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import prometheus_client

COUNTERS = {
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes",
    "nv_inference_count": "Number of inferences performed (a batch of n counts n)",
    "nv_inference_exec_count": "Number of model executions performed (joined batches count 1)",
    "nv_inference_request_duration_us": "Cumulative inference request duration in microseconds",
    "nv_inference_queue_duration_us": "Cumulative inference queuing duration in microseconds",
    "nv_inference_compute_infer_duration_us": "Cumulative compute inference duration in "
    "microseconds",
}
GAUGES = {
    "nv_inference_pending_request_count": "Instantaneous number of pending requests awaiting "
    "execution",
    "cuvil_model_ready": "1 when the model is loaded, warmed up and golden-checked",
}
RELOADS = "cuvil_model_reloads"
INFO = "cuvil_model_info"

Labels = tuple[tuple[str, str], ...]


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[Labels, float]] = defaultdict(lambda: defaultdict(float))
        self._gauges: dict[str, dict[Labels, Callable[[], float]]] = defaultdict(dict)

    def add(self, name: str, model: str, version: str, value: float = 1.0) -> None:
        with self._lock:
            self._values[name][(("model", model), ("version", version))] += value

    def request_succeeded(
        self, model: str, version: str, *, request_us: float, queue_us: float, compute_us: float
    ) -> None:
        labels = (("model", model), ("version", version))
        with self._lock:
            self._values["nv_inference_request_success"][labels] += 1
            self._values["nv_inference_request_duration_us"][labels] += request_us
            self._values["nv_inference_queue_duration_us"][labels] += queue_us
            self._values["nv_inference_compute_infer_duration_us"][labels] += compute_us

    def served(self, model: str, version: str, digest: str, index: str) -> None:
        """The artifact now served (one at a time: a reload replaces the entry)."""
        labels = (("model", model), ("version", version), ("digest", digest), ("index", index))
        with self._lock:
            self._values[INFO] = defaultdict(float, {labels: 1.0})

    def reload(self, result: str) -> None:
        with self._lock:
            self._values[RELOADS][(("result", result),)] += 1

    def gauge(self, name: str, model: str, version: str, read: Callable[[], float]) -> None:
        with self._lock:
            self._gauges[name][(("model", model), ("version", version))] = read

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._values[name].get(tuple(labels.items()), 0.0)

    def render(self) -> bytes:
        lines: list[str] = []
        with self._lock:
            for name, help_text in COUNTERS.items():
                self._family(lines, name, help_text, "counter", self._values[name])
            for name, help_text in GAUGES.items():
                values = {labels: read() for labels, read in self._gauges[name].items()}
                self._family(lines, name, help_text, "gauge", values)
            self._family(
                lines, RELOADS, "Model reloads by result", "counter", self._values[RELOADS]
            )
            self._family(lines, INFO, "The artifact served", "gauge", self._values[INFO])
        return "".join(lines).encode() + prometheus_client.generate_latest()

    @staticmethod
    def _family(
        lines: list[str], name: str, help_text: str, kind: str, values: dict[Labels, float]
    ) -> None:
        lines.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")
        for labels, value in sorted(values.items()):
            text = ",".join(f'{key}="{_escape(val)}"' for key, val in labels)
            lines.append(f"{name}{{{text}}} {value:g}\n")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


Readiness = Callable[[], tuple[bool, str]]


def serve_http(host: str, port: int, metrics: Metrics, readiness: Readiness) -> Any:
    """``/metrics``, ``/v2/health/live`` and ``/v2/health/ready`` on a daemon thread; returns the
    server (``shutdown()`` stops it)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._answer(200, metrics.render(), prometheus_client.CONTENT_TYPE_LATEST)
            elif path == "/v2/health/live":
                self._answer(200, b"live\n")
            elif path == "/v2/health/ready":
                ready, reason = readiness()
                self._answer(200 if ready else 503, (reason + "\n").encode())
            else:
                self._answer(404, b"not found: try /metrics or /v2/health/ready\n")

        def _answer(self, code: int, body: bytes, kind: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="cuvil-metrics", daemon=True).start()
    return server

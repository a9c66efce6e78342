"""Prometheus metrics under Triton's names.

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
``cuvil_model_ready``, ``nv_cpu_utilization`` and ``nv_cpu_memory_used_bytes`` (the serving
process's; process_usage.py); counters ``cuvil_model_reloads`` with ``result`` ok/refused;
``cuvil_model_info{model, version, digest, index}`` 1 for the artifact served (``digest``: the
OCI manifest, as in the ModelCompilation's status.artifacts[]; ``index``: the index it came
from, empty when none).

Generation models add ``cuvil_generation_tokens`` (tokens generated; its rate is tokens/s),
``cuvil_prefix_reused_tokens`` (prompt tokens a prefix reuse saved prefilling),
histograms ``cuvil_time_to_first_token_seconds`` and ``cuvil_inter_token_latency_seconds``,
and gauges ``cuvil_kv_cache_usage`` (the fraction of the KV budget reserved),
``cuvil_generation_running`` (sequences holding a cache slot) and ``cuvil_generation_waiting``.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import prometheus_client

from cuvil_sidecar.http_server import Handler, HttpRequest, HttpResponse, error_response

COUNTERS = {
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes",
    "nv_inference_count": "Number of inferences performed (a batch of n counts n)",
    "nv_inference_exec_count": "Number of model executions performed (joined batches count 1)",
    "nv_inference_request_duration_us": "Cumulative inference request duration in microseconds",
    "nv_inference_queue_duration_us": "Cumulative inference queuing duration in microseconds",
    "nv_inference_compute_infer_duration_us": "Cumulative compute inference duration in "
    "microseconds",
    "cuvil_generation_tokens": "Tokens generated, all streams",
    "cuvil_prefix_reused_tokens": "Prompt tokens whose keys and values were copied from a "
    "cache slot rather than prefilled",
}
GAUGES = {
    "nv_inference_pending_request_count": "Instantaneous number of pending requests awaiting "
    "execution",
    "cuvil_model_ready": "1 when the model is loaded, warmed up and golden-checked",
    "nv_cpu_utilization": "CPU utilization of the serving process since the last scrape, as a "
    "fraction of its cores [0.0 - 1.0]",
    "nv_cpu_memory_used_bytes": "Resident memory of the serving process, in bytes",
    "cuvil_kv_cache_usage": "Fraction of the KV cache budget reserved by running sequences",
    "cuvil_generation_running": "Sequences holding a KV cache slot",
    "cuvil_generation_waiting": "Generation requests waiting for KV cache room",
}
# the cumulative microseconds of failed requests: read by ModelStatistics (its ``fail``
# duration), not exposed (Triton's metrics have no such counter)
FAILURE_DURATION = "cuvil_request_failure_duration_us"
RELOADS = "cuvil_model_reloads"
INFO = "cuvil_model_info"
REJECTED = "cuvil_inference_rejected"
HISTOGRAMS = {
    "cuvil_request_duration_seconds": "Time from a request's arrival to its answer",
    "cuvil_queue_duration_seconds": "Time a request waited before its batch ran",
    "cuvil_compute_duration_seconds": "Time the model ran for the batch a request rode in",
    "cuvil_time_to_first_token_seconds": "Time from a generation request's arrival to its "
    "first token",
    "cuvil_inter_token_latency_seconds": "Time between successive tokens of one stream",
}
REQUEST_HISTOGRAMS = tuple(HISTOGRAMS)[:3]  # what every inference request observes
BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

Labels = tuple[tuple[str, str], ...]


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[Labels, float]] = defaultdict(lambda: defaultdict(float))
        self._gauges: dict[str, dict[Labels, Callable[[], float]]] = defaultdict(dict)
        # per histogram and labels: a count per bucket (the last: above every bound), and the sum
        self._histograms: dict[str, dict[Labels, list[float]]] = defaultdict(dict)
        self._last_inference_ms: dict[Labels, int] = {}

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
            durations = (request_us, queue_us, compute_us)
            for name, us in zip(REQUEST_HISTOGRAMS, durations, strict=True):
                self._observe(name, labels, us / 1e6)
            self._last_inference_ms[labels] = time.time_ns() // 1_000_000

    def request_failed(self, model: str, version: str, *, request_us: float) -> None:
        """A request answered with an error after ``request_us``: counted, and its time added to
        ``FAILURE_DURATION`` (Triton's statistics report failures with their duration)."""
        labels = (("model", model), ("version", version))
        with self._lock:
            self._values["nv_inference_request_failure"][labels] += 1
            self._values[FAILURE_DURATION][labels] += request_us

    def token_generated(self, model: str, version: str, inter_token_s: float | None) -> None:
        """One streamed token: ``cuvil_generation_tokens`` and, for all but a stream's first,
        its gap in ``cuvil_inter_token_latency_seconds``, under one lock (per token, per
        stream: the event loop's commonest metric update)."""
        labels = (("model", model), ("version", version))
        with self._lock:
            self._values["cuvil_generation_tokens"][labels] += 1
            if inter_token_s is not None:
                self._observe("cuvil_inter_token_latency_seconds", labels, inter_token_s)

    def observe(self, name: str, model: str, version: str, seconds: float) -> None:
        """One value of the histogram ``name`` (one of ``HISTOGRAMS``)."""
        with self._lock:
            self._observe(name, (("model", model), ("version", version)), seconds)

    def _observe(self, name: str, labels: Labels, seconds: float) -> None:
        counts = self._histograms[name].get(labels)
        if counts is None:
            counts = self._histograms[name][labels] = [0.0] * (len(BUCKETS_S) + 2)
        counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        counts[-1] += seconds

    def rejected(self, model: str, version: str, reason: str) -> None:
        with self._lock:
            self._values[REJECTED][
                (("model", model), ("version", version), ("reason", reason))
            ] += 1

    def last_inference_ms(self, model: str, version: str) -> int:
        """Milliseconds since the epoch of the last success; 0 before the first."""
        with self._lock:
            return self._last_inference_ms.get((("model", model), ("version", version)), 0)

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
            self._family(
                lines,
                REJECTED,
                "Requests refused before they ran",
                "counter",
                self._values[REJECTED],
            )
            for name, help_text in HISTOGRAMS.items():
                self._histogram(lines, name, help_text, self._histograms[name])
        return "".join(lines).encode() + prometheus_client.generate_latest()

    @staticmethod
    def _family(
        lines: list[str], name: str, help_text: str, kind: str, values: dict[Labels, float]
    ) -> None:
        lines.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")
        for labels, value in sorted(values.items()):
            text = ",".join(f'{key}="{_escape(val)}"' for key, val in labels)
            lines.append(f"{name}{{{text}}} {value:g}\n")

    @staticmethod
    def _histogram(
        lines: list[str], name: str, help_text: str, values: dict[Labels, list[float]]
    ) -> None:
        lines.append(f"# HELP {name} {help_text}\n# TYPE {name} histogram\n")
        for labels, counts in sorted(values.items()):
            text = ",".join(f'{key}="{_escape(val)}"' for key, val in labels)
            total = 0.0
            for bound, count in zip([*BUCKETS_S, float("inf")], counts, strict=False):
                total += count
                le = "+Inf" if bound == float("inf") else f"{bound:g}"
                lines.append(f'{name}_bucket{{{text},le="{le}"}} {total:g}\n')
            lines.append(f"{name}_sum{{{text}}} {counts[-1]:.9g}\n")
            lines.append(f"{name}_count{{{text}}} {total:g}\n")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metrics_handler(metrics: Metrics, readiness: Callable[[], tuple[bool, str]]) -> Handler:
    """The metrics port: ``/metrics``, ``/v2/health/live``, ``/v2/health/ready`` (503 with the
    reason while not ready)."""

    async def handle(request: HttpRequest) -> HttpResponse:
        if request.method != "GET":
            return error_response(405, "the metrics port takes GET")
        if request.path == "/metrics":
            return HttpResponse(200, [metrics.render()], prometheus_client.CONTENT_TYPE_LATEST)
        if request.path == "/v2/health/live":
            return HttpResponse(200, [b"live\n"], "text/plain; charset=utf-8")
        if request.path == "/v2/health/ready":
            ready, reason = readiness()
            return HttpResponse(200 if ready else 503, [(reason + "\n").encode()], "text/plain")
        return error_response(404, "not found: try /metrics or /v2/health/ready")

    return handle

"""The warm-up measurement a sidecar reports for a target its compiler could not time.

A plan compiled where it cannot run (a CUDA plan on a CPU worker, checked there by
interpretation) has its speed gates deferred: the artifact's report says so
(``gates.<gate>.deferred``), and its ModelCompilation waits as ``status.candidate`` until the
gates are measured where the plan runs. When the sidecar loads such an artifact, the last step of
its warm-up (``measure``) times the golden inputs ``CUVIL_MEASURE_RUNS`` times on this node and
takes the largest error against the golden outputs. Once the model serves, the measurement is
logged and published (``publish``): written to the pod's own ``cuvil.dev/measurement``
annotation through the Kubernetes API with the pod's service account, which needs ``patch`` on
pods in its namespace. The operator reads that annotation from its pod index and promotes or
rejects the candidate (``cuvil_operator.serving``).

The sidecar has no eager model to compare with, so it measures latency (the ``maxLatencyP99Ms``
gate) and error, not a speedup: a ``minSpeedup`` gate is measured by a benchmark Job that posts
on the compilation itself.

Settings (read once, with the rest of ``SidecarConfig``):

- ``CUVIL_MEASURE_RUNS`` (50): timed runs; 0 measures nothing.
- ``CUVIL_POD_NAME``, ``CUVIL_POD_NAMESPACE``, ``CUVIL_NODE_NAME``: the pod to annotate and the
  node it runs on (the injection webhook sets them from the downward API); without a pod name
  the measurement is only logged.
- ``CUVIL_KUBE_API`` (``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``): the API
  server; ``CUVIL_KUBE_TOKEN_FILE`` and ``CUVIL_KUBE_CA`` (the service account's mounted token
  and CA): how the sidecar authenticates it and is sure of it.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config imports this module before torch may load (main.set_omp_spin)
    import torch

log = logging.getLogger("cuvil_sidecar.measurement")

MEASUREMENT_ANNOTATION = "cuvil.dev/measurement"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
Run = Callable[[Mapping[str, "torch.Tensor"]], Mapping[str, "torch.Tensor"]]


@dataclass(frozen=True)
class MeasurementSettings:
    runs: int = 50
    pod_name: str | None = None
    pod_namespace: str | None = None
    node_name: str | None = None
    api: str | None = None
    token_file: Path | None = None
    ca_file: Path | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> MeasurementSettings:
        runs_text = env.get("CUVIL_MEASURE_RUNS", "").strip() or str(cls.runs)
        if not runs_text.isdigit():
            raise ValueError(f"CUVIL_MEASURE_RUNS={runs_text!r} is not a count")
        api = env.get("CUVIL_KUBE_API", "").strip() or None
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        if api is None and host:
            api = f"https://{f'[{host}]' if ':' in host else host}:{port or 443}"
        token = env.get("CUVIL_KUBE_TOKEN_FILE", "").strip()
        ca = env.get("CUVIL_KUBE_CA", "").strip()
        return cls(
            runs=int(runs_text),
            pod_name=env.get("CUVIL_POD_NAME", "").strip() or None,
            pod_namespace=env.get("CUVIL_POD_NAMESPACE", "").strip() or None,
            node_name=env.get("CUVIL_NODE_NAME", "").strip() or None,
            api=api.rstrip("/") if api else None,
            token_file=Path(token) if token else SERVICE_ACCOUNT / "token",
            ca_file=Path(ca) if ca else SERVICE_ACCOUNT / "ca.crt",
        )


def deferred_gates(report: Mapping[str, Any]) -> dict[str, float]:
    """``{gate: limit}`` of the gates the artifact's report left to be measured where it runs."""
    gates = report.get("gates") or {}
    return {
        str(gate): float(checked.get("limit") or 0.0)
        for gate, checked in gates.items()
        if isinstance(checked, Mapping) and checked.get("deferred")
    }


def _percentile(sorted_ms: list[float], fraction: float) -> float:
    index = min(len(sorted_ms) - 1, max(0, round(fraction * (len(sorted_ms) - 1))))
    return sorted_ms[index]


def measure(
    run: Run,
    inputs: Mapping[str, torch.Tensor],
    golden: Mapping[str, torch.Tensor],
    runs: int,
) -> dict[str, Any]:
    """Latency of ``runs`` runs of the golden inputs (the model warmed up already) and the
    largest absolute error of their outputs against the golden ones."""
    times: list[float] = []
    error = 0.0
    for _ in range(runs):
        started = time.perf_counter()
        outputs = run(inputs)
        if outputs:  # a device run ends when its outputs are read
            next(iter(outputs.values())).cpu()
        times.append((time.perf_counter() - started) * 1e3)
        for name, actual in outputs.items():
            expected = golden.get(f"output.{name}")
            if expected is not None and expected.shape == actual.shape:
                difference = (actual.detach().double().cpu() - expected.double()).abs()
                error = max(error, float(difference.max()) if difference.numel() else 0.0)
    times.sort()
    return {
        "runs": runs,
        "latencyP50Ms": round(_percentile(times, 0.5), 4),
        "latencyP99Ms": round(_percentile(times, 0.99), 4),
        "maxAbsError": error,
    }


def build_measurement(
    timed: Mapping[str, Any],
    target: str,
    digest: str,
    deferred: Mapping[str, float],
    settings: MeasurementSettings,
) -> dict[str, Any]:
    """What the pod's annotation holds: the manifest measured (the digest the compilation's
    ``status.candidate.targets`` pins), its target, the node, the gates it was measured for."""
    measurement = {"target": target, "digest": digest, **timed, "deferred": sorted(deferred)}
    if settings.node_name:
        measurement["node"] = settings.node_name
    return measurement


def publish(measurement: Mapping[str, Any], settings: MeasurementSettings) -> bool:
    """Log the measurement and write it to the pod's annotation (False: only logged, the log
    saying why)."""
    text = json.dumps(measurement, sort_keys=True, separators=(",", ":"))
    log.info("measured on this node: %s", text)
    if not (settings.pod_name and settings.pod_namespace and settings.api):
        log.warning("measurement not published: CUVIL_POD_NAME/NAMESPACE or the API are not set")
        return False
    pod = (
        f"{urllib.parse.quote(settings.pod_namespace)}/pods/{urllib.parse.quote(settings.pod_name)}"
    )
    body = json.dumps({"metadata": {"annotations": {MEASUREMENT_ANNOTATION: text}}}).encode()
    request = urllib.request.Request(
        f"{settings.api}/api/v1/namespaces/{pod}",
        data=body,
        method="PATCH",
        headers={"Content-Type": "application/merge-patch+json"},
    )
    if settings.token_file is not None and settings.token_file.is_file():
        token = settings.token_file.read_text().strip()  # the kubelet rotates it: read each time
        request.add_header("Authorization", f"Bearer {token}")
    context = None
    if settings.api.startswith("https:"):
        ca = settings.ca_file if settings.ca_file and settings.ca_file.is_file() else None
        context = ssl.create_default_context(cafile=str(ca) if ca else None)
    try:
        with urllib.request.urlopen(request, timeout=10, context=context):
            pass
    except (OSError, ValueError) as error:  # HTTPError is an OSError
        log.warning("measurement not published to pod %s: %s", pod, error)
        return False
    log.info("measurement published on pod %s (%s)", pod, MEASUREMENT_ANNOTATION)
    return True

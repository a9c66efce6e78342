"""A CUDA generation measured by the sidecar that serves it: kmock, Redis, the stub worker (its
CUDA target's latency gate is deferred, as the real CPU worker defers it) and ``cuvil-operator``
with its webhook. A canary pod (``cuvil.dev/track: candidate``) is pinned to the candidate; its
sidecar's measurement, published on the pod by the sidecar's own ``publish``
(tests/cuvil_sidecar/test_measurement.py runs it in a real sidecar), promotes the candidate, and
a later generation whose measurement misses the gate is rejected and the canary sent back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from cuvil_sidecar.measurement import MeasurementSettings, build_measurement, publish

from tests.cuvil_operator import webhook_server
from tests.cuvil_operator.conftest import StubWorker, events_for, get_mc, wait_for
from tests.cuvil_operator.webhook_server import Webhook, build_pod, patched_pod
from tests.fixtures.kube import REPO, KubeApi

NAME = "canary"
webhook = webhook_server.webhook


def _apply(kube: KubeApi, tmp_path: Path, max_p99_ms: float) -> None:
    manifest = yaml.safe_load((REPO / "examples" / "resnet50-cpu.yaml").read_text())
    manifest["metadata"]["name"] = NAME
    manifest["spec"] |= {"targets": ["cpu-x86_64", "cuda-sm_90"], "queue": "cuvil.cpu",
                         "gates": {"maxLatencyP99Ms": max_p99_ms}}  # fmt: skip
    path = tmp_path / f"canary-{max_p99_ms}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    kube.kubectl("apply", "--validate=false", "-f", str(path))


def _status(kube: KubeApi, what: str, check: Any) -> dict[str, Any]:
    def look() -> dict[str, Any] | None:
        status = (get_mc(kube, NAME) or {}).get("status") or {}
        return status if check(status) else None

    return wait_for(look, 60, what)


def _admit(kube: KubeApi, webhook: Webhook, name: str, **annotations: str) -> str:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": "app-", "labels": {"cuvil.dev/model": NAME},
                        "annotations": {"cuvil.dev/target": "cuda-sm_90", **annotations}},
           "spec": {"containers": [{"name": "app", "image": "example/app:1"}]}}  # fmt: skip
    pod = patched_pod(pod, webhook.review(pod))
    pod["metadata"] |= {"name": name, "namespace": "default"}
    kube.create("v1", "pods", pod)
    return str(pod["metadata"]["annotations"]["cuvil.dev/injected"])


def _pinned(kube: KubeApi, name: str) -> str:
    pod = kube.get("v1", "pods", "default", name) or {}
    return str(pod.get("metadata", {}).get("annotations", {}).get("cuvil.dev/injected"))


def _sidecar_measures(kube: KubeApi, pod: str, p99_ms: float) -> None:
    """What the canary's sidecar publishes after its warm-up of the pinned artifact."""
    timed = {"runs": 50, "latencyP50Ms": p99_ms / 2, "latencyP99Ms": p99_ms, "maxAbsError": 1e-6}
    settings = MeasurementSettings(pod_name=pod, pod_namespace="default", node_name="gpu-a",
                                   api=kube.url, token_file=None)  # fmt: skip
    digest = _pinned(kube, pod).rpartition("@")[2]
    measurement = build_measurement(timed, "cuda-sm_90", digest, {"maxLatencyP99Ms": 5.0}, settings)
    assert publish(measurement, settings)


def test_a_canarys_sidecar_measurement_promotes_or_rejects_the_candidate(
    kube_api: KubeApi, stub_worker: StubWorker, webhook: Webhook, tmp_path: Path
) -> None:
    _apply(kube_api, tmp_path, 5.0)
    first = _status(kube_api, "generation 1 awaiting", lambda s: s.get("candidate"))
    assert first["candidate"]["awaiting"] == {"cuda-sm_90": {"maxLatencyP99Ms": 5.0}}
    refused = webhook.review(build_pod(**{"cuvil.dev/model": NAME}))
    assert refused["allowed"] is False  # nothing promoted: only a canary may serve it
    pinned = _admit(kube_api, webhook, "canary-1", **{"cuvil.dev/track": "candidate"})
    assert pinned == first["candidate"]["targets"]["cuda-sm_90"]

    _sidecar_measures(kube_api, "canary-1", 3.1)
    served = _status(kube_api, "generation 1 promoted", lambda s: s.get("promoted"))
    assert served["promoted"]["generation"] == 1 and not served.get("candidate")
    condition = next(c for c in served["conditions"] if c["type"] == "Promoted")
    assert condition["reason"] == "MeasuredOnNode" and "on node gpu-a" in condition["message"]
    assert _admit(kube_api, webhook, "app-1") == served["promoted"]["targets"]["cuda-sm_90"]

    # Generation 2: the canary moves to the new candidate, the app pod stays; then the
    # canary's measurement misses the gate and sends the canary back.
    _apply(kube_api, tmp_path, 2.0)
    second = _status(kube_api, "generation 2 awaiting",
                     lambda s: (s.get("candidate") or {}).get("generation") == 2)  # fmt: skip
    wanted = second["candidate"]["targets"]["cuda-sm_90"]
    wait_for(lambda: _pinned(kube_api, "canary-1") == wanted, 30, "the canary on generation 2")
    assert _pinned(kube_api, "app-1") == served["promoted"]["targets"]["cuda-sm_90"]
    _sidecar_measures(kube_api, "canary-1", 3.1)
    rejected = _status(
        kube_api, "generation 2 rejected",
        lambda s: not s.get("candidate") and s.get("promoted", {}).get("generation") == 1,
    )  # fmt: skip
    condition = next(c for c in rejected["conditions"] if c["type"] == "Promoted")
    assert condition["reason"] == "MeasurementFailed"
    assert "maxLatencyP99Ms measured 3.1, required <= 2" in condition["message"]
    back = served["promoted"]["targets"]["cuda-sm_90"]
    wait_for(lambda: _pinned(kube_api, "canary-1") == back, 30, "the canary back")
    rolled = [e["message"] for e in events_for(kube_api, NAME) if e["reason"] == "RolledOut"]
    assert "1 pods moved to candidate generation 2: canary-1" in rolled
    assert "1 pods moved to generation 1: canary-1" in rolled

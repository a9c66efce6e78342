"""Rollout gated on measurement, with the operator running for real against kmock (Redis, the
stub Celery worker, the webhook over HTTPS): a CUDA target's speed gate is deferred by the CPU
worker, so each generation waits as ``status.candidate`` until a ``cuvil.dev/measurement``
promotes or rejects it. A pod admitted with a sidecar is re-pinned to each promoted generation
(its ``cuvil.dev/injected`` annotation, which its sidecar follows: tests/cuvil_sidecar/
test_reload.py) and stays on it when the next one is rejected."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.cuvil_operator import webhook_server
from tests.cuvil_operator.conftest import StubWorker, events_for, get_mc, wait_for
from tests.cuvil_operator.webhook_server import Webhook, build_pod, patched_pod
from tests.fixtures.kube import REPO, KubeApi
from tests.fixtures.redis import RedisServer

NAME = "rollout"
webhook = webhook_server.webhook


def _manifest(tmp_path: Path, min_speedup: float) -> Path:
    manifest = yaml.safe_load((REPO / "examples" / "resnet50-cpu.yaml").read_text())
    manifest["metadata"]["name"] = NAME
    manifest["spec"]["targets"] = ["cpu-x86_64", "cuda-sm_90"]
    manifest["spec"]["queue"] = "cuvil.cpu"  # the stub worker takes both
    manifest["spec"]["gates"] = {"maxAbsError": 0.01, "minSpeedup": min_speedup}
    path = tmp_path / f"rollout-{min_speedup}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def _status_when(kube: KubeApi, what: str, check: Any) -> dict[str, Any]:
    def look() -> dict[str, Any] | None:
        status = (get_mc(kube, NAME) or {}).get("status") or {}
        return status if check(status) else None

    return wait_for(look, 60, what)


def _pod_ref(kube: KubeApi) -> str:
    pod = kube.get("v1", "pods", "default", "app-1") or {}
    return str(pod.get("metadata", {}).get("annotations", {}).get("cuvil.dev/injected"))


def _promoted_condition(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "Promoted")


def _measure(kube: KubeApi, generation: int, speedup: float) -> None:
    measurement = {"generation": generation, "target": "cuda-sm_90", "speedup": speedup,
                   "node": "gpu-a"}  # fmt: skip
    kube.kubectl("annotate", "--overwrite", "mc", NAME,
                 f"cuvil.dev/measurement={json.dumps(measurement)}")  # fmt: skip


def test_each_promoted_generation_is_rolled_out_and_a_rejected_one_is_not(
    kube_api: KubeApi,
    redis_server: RedisServer,
    stub_worker: StubWorker,
    webhook: Webhook,
    tmp_path: Path,
) -> None:
    from cuvil_worker import contract

    app = contract.create_app(redis_server.url(0), redis_server.url(1))
    app.backend.client.set("cuvil-stub:stage-seconds", "0.1")
    kube_api.kubectl("apply", "--validate=false", "-f", str(_manifest(tmp_path, 1.2)))
    first = _status_when(kube_api, "generation 1 awaiting", lambda s: s.get("candidate"))
    assert first["phase"] == "Succeeded" and "promoted" not in first
    assert first["candidate"]["awaiting"] == {"cuda-sm_90": {"minSpeedup": 1.2}}
    condition = _promoted_condition(first)
    assert condition["status"] == "False" and condition["reason"] == "AwaitingMeasurement"
    assert "cuda-sm_90: minSpeedup (not measured)" in condition["message"]
    refused = webhook.review(build_pod(**{"cuvil.dev/model": NAME}))
    assert refused["allowed"] is False
    assert "generation 1 awaits a measurement" in refused["status"]["message"]

    _measure(kube_api, 1, 1.7)
    served = _status_when(kube_api, "generation 1 promoted", lambda s: s.get("promoted"))
    assert served["promoted"]["generation"] == 1 and not served.get("candidate")
    assert served["promoted"]["ref"] == first["candidate"]["ref"]
    assert _promoted_condition(served)["reason"] == "MeasuredOnNode"
    row = kube_api.kubectl("get", "mc", NAME, "--no-headers").stdout.split()
    assert row[6] == "1"  # the Served column
    assert "Promoted" in [e["reason"] for e in events_for(kube_api, NAME)]

    # A pod admitted now is pinned to generation 1.
    pod = build_pod(**{"cuvil.dev/model": NAME})
    pod = patched_pod(pod, webhook.review(pod))
    pod["metadata"] |= {
        "name": "app-1",
        "namespace": "default",
        "labels": {"cuvil.dev/model": NAME},
    }
    kube_api.create("v1", "pods", pod)
    assert _pod_ref(kube_api) == served["promoted"]["ref"]

    # Generation 2 is measured and met: the running pod moves to it.
    kube_api.kubectl("apply", "--validate=false", "-f", str(_manifest(tmp_path, 1.5)))
    _status_when(kube_api, "generation 2 awaiting",
                 lambda s: (s.get("candidate") or {}).get("generation") == 2)  # fmt: skip
    assert _pod_ref(kube_api) == served["promoted"]["ref"]  # not moved while it waits
    _measure(kube_api, 2, 1.8)
    second = _status_when(kube_api, "generation 2 promoted",
                          lambda s: (s.get("promoted") or {}).get("generation") == 2)  # fmt: skip
    wait_for(lambda: _pod_ref(kube_api) == second["promoted"]["ref"], 30, "the pod to move")
    wait_for(
        lambda: [(s["ref"], s["pods"]) for s in
                 (get_mc(kube_api, NAME) or {}).get("status", {}).get("serving") or []]
        == [(second["promoted"]["ref"], 1)],
        30, "status.serving on generation 2",
    )  # fmt: skip
    assert "RolledOut" in [e["reason"] for e in events_for(kube_api, NAME)]

    # Generation 3's measurement misses its gate: generation 2 stays served, the pod with it.
    kube_api.kubectl("apply", "--validate=false", "-f", str(_manifest(tmp_path, 5.0)))
    _status_when(kube_api, "generation 3 awaiting",
                 lambda s: (s.get("candidate") or {}).get("generation") == 3)  # fmt: skip
    _measure(kube_api, 3, 1.9)
    rejected = _status_when(
        kube_api, "generation 3 rejected",
        lambda s: _promoted_condition(s)["reason"] == "MeasurementFailed",
    )  # fmt: skip
    assert rejected["promoted"] == second["promoted"] and not rejected.get("candidate")
    message = _promoted_condition(rejected)["message"]
    assert "minSpeedup measured 1.9, required >= 5" in message
    assert "generation 2" in message and "stays served" in message
    assert _pod_ref(kube_api) == second["promoted"]["ref"]

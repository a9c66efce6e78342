"""Rollout gated on measurement, with the operator running for real against kmock (Redis and the
stub Celery worker): a CUDA target's speed gate is deferred by the CPU worker, so the generation
waits as ``status.candidate`` until a ``cuvil.dev/measurement`` promotes or rejects it; the
promoted generation is what stays served."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.cuvil_operator.conftest import Operator, StubWorker, events_for, get_mc, wait_for
from tests.fixtures.kube import REPO, KubeApi
from tests.fixtures.redis import RedisServer

NAME = "rollout"


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


def _promoted_condition(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "Promoted")


def _measure(kube: KubeApi, generation: int, speedup: float) -> None:
    measurement = {"generation": generation, "target": "cuda-sm_90", "speedup": speedup,
                   "node": "gpu-a"}  # fmt: skip
    kube.kubectl("annotate", "--overwrite", "mc", NAME,
                 f"cuvil.dev/measurement={json.dumps(measurement)}")  # fmt: skip


def test_deferred_speed_gates_wait_for_a_measurement_and_a_miss_keeps_the_served_one(
    kube_api: KubeApi,
    redis_server: RedisServer,
    stub_worker: StubWorker,
    running_operator: Operator,
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

    _measure(kube_api, 1, 1.7)
    served = _status_when(kube_api, "generation 1 promoted", lambda s: s.get("promoted"))
    assert served["promoted"]["generation"] == 1 and not served.get("candidate")
    assert served["promoted"]["ref"] == first["candidate"]["ref"]
    assert _promoted_condition(served)["reason"] == "MeasuredOnNode"
    row = kube_api.kubectl("get", "mc", NAME, "--no-headers").stdout.split()
    assert row[6] == "1"  # the Served column
    assert "Promoted" in [e["reason"] for e in events_for(kube_api, NAME)]

    # Generation 2 compiles and waits; its measurement misses the gate: generation 1 stays.
    kube_api.kubectl("apply", "--validate=false", "-f", str(_manifest(tmp_path, 1.5)))
    _status_when(kube_api, "generation 2 awaiting",
                 lambda s: (s.get("candidate") or {}).get("generation") == 2)  # fmt: skip
    _measure(kube_api, 2, 0.9)
    rejected = _status_when(
        kube_api, "generation 2 rejected",
        lambda s: _promoted_condition(s)["reason"] == "MeasurementFailed",
    )  # fmt: skip
    assert rejected["promoted"] == served["promoted"] and not rejected.get("candidate")
    message = _promoted_condition(rejected)["message"]
    assert "minSpeedup measured 0.9, required >= 1.5" in message
    assert "generation 1" in message and "stays served" in message

"""Conditions as Kubernetes conventions want them, from real failures: kmock as the API,
``cuvil-operator``, real Redis, the real registry and a real ``cuvil-worker`` (the MLP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cuvil_operator.compilations import app, apply, mlp_compilation, phase_of, workers
from tests.cuvil_operator.conftest import Operator, events_for, get_mc, wait_for
from tests.fixtures.kube import KubeApi
from tests.fixtures.registry import RunningRegistry, registry

__all__ = ["app", "registry", "workers"]
pytestmark = pytest.mark.slow


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj["status"]["conditions"]}


def test_two_failing_gates_show_on_validated_with_values_and_a_retry_runs_again(
    kube_api: KubeApi,
    registry: RunningRegistry,
    running_operator: Operator,
    workers: Any,
    tmp_path: Path,
) -> None:
    gates = {"minSpeedup": 1000.0, "maxLatencyP99Ms": 1e-6, "maxAbsError": 1.0}
    obj = mlp_compilation("gated", registry, gates=gates)
    worker = workers("gates")
    apply(kube_api, obj, tmp_path)
    failed = wait_for(lambda: phase_of(kube_api, "gated", "Failed"), 120, "Failed")
    found = conditions(failed)
    validated = found["Validated"]
    assert (validated["status"], validated["reason"]) == ("False", "GateFailed"), validated
    message = validated["message"]
    assert "gate minSpeedup failed: measured" in message and "required >= 1000" in message
    assert "gate maxLatencyP99Ms failed: measured" in message and "required <= 1e-06" in message
    assert "maxAbsError" not in message  # it passed
    assert (found["Compiling"]["status"], found["Compiling"]["reason"]) == ("False", "Compiled")
    assert (found["Accepted"]["status"], found["Ready"]["reason"]) == ("True", "GateFailed")
    report = failed["status"]["report"]
    assert report["speedup"] > 0 and "GateFailed" in report["error"]
    measured = report["targets"]["cpu-x86_64"]
    assert measured["gates"]["minSpeedup"]["passed"] is False
    assert measured["gates"]["maxAbsError"]["passed"] is True
    assert measured["benchmark"]["speedup"] == measured["gates"]["minSpeedup"]["measured"]
    assert measured["validation"]["maxAbsError"] >= 0
    first_task = failed["status"]["taskId"]

    kube_api.kubectl("annotate", "mc", "gated", "cuvil.dev/retry=1")

    def retried() -> dict[str, Any] | None:
        now = phase_of(kube_api, "gated", "Failed")
        return now if now and now["status"].get("attempt") == 1 else None

    again = wait_for(retried, 120, "the retried attempt to fail again")
    assert again["status"]["taskId"] == f"{first_task}-r1"
    assert again["metadata"]["generation"] == 1  # no spec change
    assert f"cuvil.compile[{first_task}-r1-cpu-x86_64] received" in worker.log
    reasons = [e["reason"] for e in events_for(kube_api, "gated")]
    assert "Retried" in reasons, reasons


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a worker that has no GPU")
def test_a_cuda_target_on_a_worker_without_a_gpu_is_no_invalid_spec(
    kube_api: KubeApi,
    registry: RunningRegistry,
    running_operator: Operator,
    workers: Any,
    tmp_path: Path,
) -> None:
    """CUDA artifacts are compiled on CPU-only workers (verified by interpretation, speed not
    measured there): the spec is valid and the compile goes through."""
    obj = mlp_compilation("no-gpu", registry, targets=["cuda-sm_90"], queue="cuvil.cpu")
    workers("cpu-only")
    apply(kube_api, obj, tmp_path)
    done = wait_for(lambda: phase_of(kube_api, "no-gpu", "Succeeded", "Failed"), 180, "done")
    assert "InvalidSpec" not in str(get_mc(kube_api, "no-gpu"))
    found = conditions(done)
    assert (found["Accepted"]["status"], found["Accepted"]["reason"]) == ("True", "Submitted")
    assert done["status"]["phase"] == "Succeeded", done["status"].get("message")
    benchmark = done["status"]["report"]["targets"]["cuda-sm_90"]["benchmark"]
    assert benchmark["measured"] is False

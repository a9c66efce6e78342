"""Stalls are said out loud: kmock as the API, ``cuvil-operator`` (stall threshold 3 s), real
Redis; the stub worker consuming ``cuvil.cpu`` only, or a real ``cuvil-worker`` against a
stopped registry."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.cuvil_operator.compilations import app, apply, mlp_compilation, phase_of, workers
from tests.cuvil_operator.conftest import Operator, StubWorker, events_for, get_mc, wait_for
from tests.fixtures.kube import KubeApi
from tests.fixtures.registry import RunningRegistry, registry

__all__ = ["app", "registry", "workers"]


def _warning(kube: KubeApi, name: str, reason: str) -> dict[str, Any] | None:
    found = [e for e in events_for(kube, name) if e["type"] == "Warning" and e["reason"] == reason]
    return found[0] if found else None


def _condition(kube: KubeApi, name: str, type_: str) -> dict[str, Any]:
    obj = get_mc(kube, name) or {}
    found = [c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_]
    return found[0] if found else {}


def test_a_queue_without_a_worker_raises_a_warning_naming_it(
    kube_api: KubeApi,
    registry: RunningRegistry,
    stub_worker: StubWorker,
    running_operator: Operator,
    tmp_path: Path,
) -> None:
    apply(kube_api, mlp_compilation("gpu-wanted", registry, targets=["cuda-sm_90"]), tmp_path)
    wait_for(lambda: phase_of(kube_api, "gpu-wanted", "Pending"), 30, "Pending")
    started = time.monotonic()
    warning = wait_for(lambda: _warning(kube_api, "gpu-wanted", "NoWorker"), 20, "a Warning")
    print(f"\nNoWorker Warning {time.monotonic() - started:.1f}s after Pending (threshold 3 s)")
    assert "cuvil.cuda.sm_90" in warning["message"] and "cuda-sm_90" in warning["message"]
    compiling = _condition(kube_api, "gpu-wanted", "Compiling")
    assert (compiling["status"], compiling["reason"]) == ("False", "NoWorker"), compiling
    assert "no worker consumes queue cuvil.cuda.sm_90" in compiling["message"]
    assert (get_mc(kube_api, "gpu-wanted") or {})["status"]["phase"] == "Pending"


def test_spec_timeout_fails_a_compile_that_never_starts(
    kube_api: KubeApi,
    registry: RunningRegistry,
    stub_worker: StubWorker,
    running_operator: Operator,
    tmp_path: Path,
) -> None:
    obj = mlp_compilation("never", registry, targets=["cuda-sm_90"], timeout="5s")
    apply(kube_api, obj, tmp_path)
    failed = wait_for(lambda: phase_of(kube_api, "never", "Failed"), 30, "Failed")
    compiling = _condition(kube_api, "never", "Compiling")
    assert (compiling["status"], compiling["reason"]) == ("False", "Timeout"), compiling
    assert (
        "spec.timeout (5s)" in compiling["message"] and "cuvil.cuda.sm_90" in compiling["message"]
    )
    assert failed["status"]["message"] == compiling["message"]
    assert _warning(kube_api, "never", "Timeout") is not None


@pytest.mark.slow
def test_a_registry_fault_older_than_the_threshold_is_a_warning_naming_it(
    kube_api: KubeApi,
    registry: RunningRegistry,
    running_operator: Operator,
    workers: Any,
    tmp_path: Path,
) -> None:
    workers("blocked")
    registry.stop()
    try:
        apply(kube_api, mlp_compilation("unpushed", registry), tmp_path)
        warning = wait_for(lambda: _warning(kube_api, "unpushed", "RegistryFault"), 60, "Warning")
        pushed = _condition(kube_api, "unpushed", "Pushed")
    finally:
        registry.start()
    assert f"registry {registry.host}" in warning["message"], warning
    assert "unavailable" in warning["message"], warning
    assert (pushed["status"], pushed["reason"]) == ("Unknown", "RegistryFault"), pushed
    assert registry.host in pushed["message"]
    done = wait_for(lambda: phase_of(kube_api, "unpushed", "Succeeded", "Failed"), 90, "done")
    assert done["status"]["phase"] == "Succeeded", done["status"].get("message")
    assert _condition(kube_api, "unpushed", "Ready")["reason"] == "Succeeded"

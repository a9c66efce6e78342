"""One digest story: the ModelCompilation's status, ``kubectl get mc -o wide`` and the sidecar
serving the artifact (readiness body, ``/metrics``, log, and the ``versions`` of ModelMetadata
through tritonclient) name the same manifest and index. kmock as the API, ``cuvil-operator``,
real Redis, the real registry, a real ``cuvil-worker`` and ``cuvil-sidecar``."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient

from tests.cuvil_operator.compilations import app, apply, mlp_compilation, phase_of, workers
from tests.cuvil_operator.conftest import Operator, wait_for
from tests.cuvil_sidecar.conftest import Sidecar
from tests.fixtures.kube import KubeApi
from tests.fixtures.registry import RunningRegistry, registry

__all__ = ["app", "registry", "workers"]
pytestmark = pytest.mark.slow


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())
    except OSError:
        return None


def test_status_kubectl_and_the_sidecar_agree_on_the_digests(
    kube_api: KubeApi,
    registry: RunningRegistry,
    running_operator: Operator,
    workers: Any,
    tmp_path: Path,
) -> None:
    obj = mlp_compilation("served", registry)
    repository = obj["spec"]["output"]["repository"]
    workers("digests")
    apply(kube_api, obj, tmp_path)
    done = wait_for(lambda: phase_of(kube_api, "served", "Succeeded", "Failed"), 120, "done")
    status = done["status"]
    assert status["phase"] == "Succeeded", status.get("message")
    (artifact,) = status["artifacts"]
    index, manifest = status["index"]["digest"], artifact["digest"]
    assert status["digest"] == index != manifest
    assert artifact["ref"] == f"{repository}@{manifest}"
    assert artifact["size"] > 100_000, "the artifact's size, not its manifest's"  # MLP weights
    wide = kube_api.kubectl("get", "mc", "served", "-o", "wide").stdout
    assert index in wide.split()

    cache = str(tmp_path / "cache")
    sidecar = Sidecar(f"{repository}:v1", tmp_path / "sidecar.log",
                      CUVIL_GRPC_FRONTEND="auto", CUVIL_CACHE_DIR=cache)  # fmt: skip
    try:
        ready_url = f"{sidecar.metrics_url}/v2/health/ready"
        sidecar.wait_until(lambda: (_get(ready_url) or "").startswith("ready"), 180)
        body = _get(ready_url) or ""
        metrics = _get(f"{sidecar.metrics_url}/metrics") or ""
        client = grpcclient.InferenceServerClient(sidecar.url)
        versions = list(client.get_model_metadata(body.split()[1]).versions)
        pinned = client.is_model_ready(body.split()[1], manifest)
    finally:
        sidecar.stop()
    assert body.split()[2:] == [manifest, "index", index], body
    assert versions == ["1", manifest, index] and pinned, "ModelMetadata names what it serves"
    assert f'digest="{manifest}"' in metrics and f'index="{index}"' in metrics
    assert f"manifest {manifest}, index {index}" in sidecar.log()

"""CUDA targets through the cluster path on machines without a GPU: one ModelCompilation for
``cpu-x86_64``, ``cuda-sm_90`` and ``cuda-sm_87`` is compiled by a CPU-only ``cuvil-worker``
that consumes all three queues, pushed as one index with three manifests (each CUDA one
carrying cubins of its architecture), and a ``cuvil-sidecar`` on this CPU-only node picks the
index's CPU entry. kmock as the API, ``cuvil-operator``, real Redis and the real registry."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cuvil.artifact import media_types as mt
from cuvil.artifact.kernels_layer import unpack_kernels
from tests.cuvil_operator.compilations import app, apply, mlp_compilation, phase_of, workers
from tests.cuvil_operator.conftest import Operator, wait_for
from tests.cuvil_sidecar.conftest import Sidecar
from tests.fixtures.kube import KubeApi
from tests.fixtures.registry import RunningRegistry, registry

__all__ = ["app", "registry", "workers"]
pytestmark = pytest.mark.slow
TARGETS = ["cpu-x86_64", "cuda-sm_90", "cuda-sm_87"]
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _get(url: str, accept: str = "*/*") -> bytes | None:
    request = urllib.request.Request(url, headers={"Accept": accept})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return bytes(response.read())
    except OSError:
        return None


def test_one_index_with_a_cpu_and_two_cuda_manifests_and_the_cpu_node_serves_the_cpu_one(
    kube_api: KubeApi,
    registry: RunningRegistry,
    running_operator: Operator,
    workers: Any,
    tmp_path: Path,
) -> None:
    obj = mlp_compilation("three-targets", registry, targets=TARGETS)
    repository = obj["spec"]["output"]["repository"]
    workers("all-queues", queues="cuvil.cpu,cuvil.cuda.sm_90,cuvil.cuda.sm_87")
    apply(kube_api, obj, tmp_path)
    done = wait_for(lambda: phase_of(kube_api, "three-targets", "Succeeded", "Failed"), 300, "done")
    status = done["status"]
    assert status["phase"] == "Succeeded", status.get("message")
    by_target = {artifact["target"]: artifact["digest"] for artifact in status["artifacts"]}
    assert sorted(by_target) == sorted(TARGETS)

    host, _, name = repository.partition("/")
    index = json.loads(_get(f"http://{host}/v2/{name}/manifests/v1", OCI_INDEX) or b"{}")
    entries = {m["annotations"]["dev.cuvil.target"]: m["digest"] for m in index["manifests"]}
    assert entries == by_target
    for target, arch in (("cuda-sm_90", "sm_90a"), ("cuda-sm_87", "sm_87")):
        manifest = json.loads(_get(f"http://{host}/v2/{name}/manifests/{by_target[target]}",
                                   OCI_MANIFEST) or b"{}")  # fmt: skip
        (layer,) = [layer for layer in manifest["layers"] if layer["mediaType"] == mt.KERNELS]
        files = unpack_kernels(_get(f"http://{host}/v2/{name}/blobs/{layer['digest']}") or b"")
        assert json.loads(files["manifest.json"])["arch"] == arch
        assert any(file.endswith(f".{arch}.cubin") for file in files)
    report = status["report"]
    for target in ("cuda-sm_90", "cuda-sm_87"):  # how it was checked, and that speed was not
        assert "verified on CPU by interpretation" in json.dumps(report["targets"][target])
        assert "at most 16" in json.dumps(report["targets"][target])  # small samples

    sidecar = Sidecar(f"{repository}:v1", tmp_path / "sidecar.log",
                      CUVIL_CACHE_DIR=str(tmp_path / "cache"))  # fmt: skip
    try:
        ready_url = f"{sidecar.metrics_url}/v2/health/ready"
        sidecar.wait_until(lambda: (_get(ready_url) or b"").startswith(b"ready"), 180)
        body = (_get(ready_url) or b"").decode()
    finally:
        sidecar.stop()
    assert by_target["cpu-x86_64"] in body.split(), body

"""The whole flow: kubectl apply an example -> cuvil-operator -> Celery (Redis) -> cuvil-worker
compiles MiniLM for real -> pushed to a real OCI registry -> Succeeded with the digest in status.

Needs ``cuvil-worker`` and Debian's ``docker-registry`` (the registry fixture skips without it).
Takes about three minutes on two cores (the worker validates and benchmarks the compile).
The example's output host (127.0.0.1:5000) is pointed at the test registry's port.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cuvil_operator.conftest import BIN, Operator, Process, celery_env, get_mc, wait_for
from tests.fixtures.kube import REPO, KubeApi
from tests.fixtures.redis import RedisServer
from tests.fixtures.registry import RunningRegistry, registry

__all__ = ["registry"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("cuvil_worker.app") is None, reason="cuvil-worker not there yet"
    ),
]


@pytest.fixture
def real_worker(redis_server: RedisServer, tmp_path: Path) -> Iterator[Process]:
    exe = shutil.which("cuvil-worker", path=str(BIN))
    argv = [exe] if exe else [sys.executable, "-m", "cuvil_worker.main"]
    env = celery_env(
        redis_server,
        CUVIL_WORK_DIR=str(tmp_path / "work"),
        CUVIL_BENCH_ITERATIONS="5",
        CUVIL_TORCH_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    process = Process([*argv, "--queues", "cuvil.cpu"], env, tmp_path / "cuvil-worker.log")
    process.start()
    try:
        wait_for(lambda: "ready" in process.text(), 120, "cuvil-worker to be ready")
        yield process
    finally:
        process.stop()
        print(process.text()[-6000:])


def test_minilm_example_compiles_to_succeeded_with_digest(
    kube_api: KubeApi,
    registry: RunningRegistry,
    real_worker: Process,
    running_operator: Operator,
    tmp_path: Path,
) -> None:
    manifest = yaml.safe_load((REPO / "examples" / "minilm-cpu.yaml").read_text())
    repository = manifest["spec"]["output"]["repository"]
    manifest["spec"]["output"]["repository"] = repository.replace("127.0.0.1:5000", registry.host)
    applied = tmp_path / "minilm-cpu.yaml"
    applied.write_text(yaml.safe_dump(manifest))
    kube_api.kubectl("apply", "--validate=false", "-f", str(applied))

    def finished() -> dict[str, Any] | None:
        obj = get_mc(kube_api, "minilm-cpu")
        phase = (obj or {}).get("status", {}).get("phase")
        return obj if phase in ("Succeeded", "Failed") else None

    done = wait_for(finished, 210, "the compile to finish")
    status = done["status"]
    assert status["phase"] == "Succeeded", status.get("message")
    digest = status["digest"]
    assert digest.startswith("sha256:") and len(digest) == len("sha256:") + 64
    (artifact,) = status["artifacts"]
    assert artifact["target"] == "cpu-x86_64" and artifact["ref"].startswith(registry.host)
    assert status["report"]["speedup"] > 0
    # The digest in status is in the registry.
    path = manifest["spec"]["output"]["repository"].split("/", 1)[1]
    request = urllib.request.Request(f"{registry.url}/v2/{path}/manifests/{digest}", method="HEAD")
    request.add_header(
        "Accept",
        "application/vnd.oci.image.index.v1+json,application/vnd.oci.image.manifest.v1+json",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Docker-Content-Digest"] == digest

    header, row = kube_api.kubectl("get", "mc").stdout.splitlines()[:2]
    assert header.split() == ["NAME", "READY", "PHASE", "TARGETS", "SPEEDUP", "SERVED", "AGE"]
    assert row.split()[:4] == ["minilm-cpu", "True", "Succeeded", "1"]
    assert row.split()[5:7] == ["cpu-x86_64", "1"]  # measured on the CPU worker: promoted
    assert status["promoted"]["ref"] == status["index"]["ref"]
    wide = kube_api.kubectl("get", "mc", "-o", "wide").stdout
    assert digest in wide

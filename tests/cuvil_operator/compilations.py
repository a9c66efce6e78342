"""Helpers for operator tests with real ``cuvil-worker`` processes: ModelCompilations of the
MLP, applied with kubectl, and a ``workers`` fixture that starts workers on demand."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from celery import Celery
from cuvil_worker import contract

from tests.cuvil_operator.conftest import API, get_mc, wait_for
from tests.cuvil_worker.workers import WorkerProcess, start_worker, worker_env
from tests.fixtures.kube import KubeApi
from tests.fixtures.redis import RedisServer
from tests.fixtures.registry import RunningRegistry


def mlp_compilation(name: str, registry: RunningRegistry, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "source": {"builtin": {"name": "mlp"}},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 784]}],
        "dynamicDims": {"batch": {"min": 1, "max": 64}},
        "targets": ["cpu-x86_64"],
        "validation": {"samples": 2},
        "output": {"repository": f"{registry.host}/models/{name}-{uuid.uuid4().hex[:6]}",
                   "tag": "v1"},
    }  # fmt: skip
    body.update(spec)
    return {"apiVersion": API, "kind": "ModelCompilation",
            "metadata": {"name": name, "namespace": "default"}, "spec": body}  # fmt: skip


def apply(kube: KubeApi, obj: dict[str, Any], folder: Path) -> None:
    path = folder / f"{obj['metadata']['name']}-{uuid.uuid4().hex[:4]}.yaml"
    path.write_text(yaml.safe_dump(obj))
    kube.kubectl("apply", "--validate=false", "-f", str(path))


def phase_of(kube: KubeApi, name: str, *phases: str, generation: int = 1) -> dict[str, Any] | None:
    obj = get_mc(kube, name)
    status = (obj or {}).get("status", {})
    if status.get("phase") in phases and status.get("observedGeneration") == generation:
        return obj
    return None


def delete_and_wait(kube: KubeApi, name: str) -> None:
    kube.kubectl("delete", "mc", name, "--wait=false")
    wait_for(lambda: get_mc(kube, name) is None, 30, f"{name} to be gone")


@pytest.fixture
def app(redis_server: RedisServer) -> Celery:
    return contract.create_app(redis_server.url(0), redis_server.url(1))


@pytest.fixture
def workers(redis_server: RedisServer, tmp_path: Path) -> Iterator[Any]:
    """Starts ``cuvil-worker`` processes on demand; all are stopped at the end."""
    started: list[WorkerProcess] = []
    env = worker_env(redis_server.url(0), redis_server.url(1), tmp_path / "work",
                     CUVIL_WARM_UP="0", CUVIL_BENCH_ITERATIONS="3")  # fmt: skip

    def start(name: str, queues: str = "cuvil.cpu") -> WorkerProcess:
        worker = start_worker(env, tmp_path, queues=queues, name=name)
        started.append(worker)
        worker.wait_ready()
        return worker

    yield start
    for worker in started:
        worker.stop()
        print(f"--- {worker.name}\n{worker.log[-4000:]}")

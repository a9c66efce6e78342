"""Cancellation that holds: kmock as the API, ``cuvil-operator``, real Redis, the real registry
and real ``cuvil-worker`` processes compiling the MLP.

In each test the worker that meets the cancelled generation's tasks never heard Celery's revoke
(it starts after it, or the worker that held the task died), so only the durable cancel can
stop the push. Afterwards the registry holds no tag or manifest of the cancelled generation.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from celery import Celery
from cuvil_worker import contract

from tests.cuvil_operator.conftest import API, Operator, events_for, get_mc, wait_for
from tests.cuvil_worker.workers import WorkerProcess, start_worker, wait_state, worker_env
from tests.fixtures.kube import KubeApi
from tests.fixtures.redis import RedisServer
from tests.fixtures.registry import RunningRegistry, registry

__all__ = ["registry"]
pytestmark = pytest.mark.slow


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

    def start(name: str) -> WorkerProcess:
        worker = start_worker(env, tmp_path, name=name)
        started.append(worker)
        worker.wait_ready()
        return worker

    yield start
    for worker in started:
        worker.stop()
        print(f"--- {worker.name}\n{worker.log[-4000:]}")


def chord_outcome(app: Celery, task_id: str) -> dict[str, Any] | None:
    """The index task's stored result, once it has one."""
    result = app.AsyncResult(task_id)
    return dict(result.result) if result.state == "SUCCESS" else None


def test_delete_before_pickup_pushes_nothing(
    kube_api: KubeApi,
    app: Celery,
    registry: RunningRegistry,
    running_operator: Operator,
    workers: Any,
    tmp_path: Path,
) -> None:
    obj = mlp_compilation("ghost", registry)
    repository = obj["spec"]["output"]["repository"]
    apply(kube_api, obj, tmp_path)
    pending = wait_for(lambda: phase_of(kube_api, "ghost", "Pending"), 30, "Pending")
    task_id = pending["status"]["taskId"]
    delete_and_wait(kube_api, "ghost")

    worker = workers("late")  # never heard the revoke: it was not running
    outcome = wait_for(lambda: chord_outcome(app, task_id), 90, "the index task to end")
    assert "was deleted or cancelled" in outcome["cancelled"], outcome
    target = app.AsyncResult(f"{task_id}-cpu-x86_64").result
    assert "cancelled before it started" in target["cancelled"], target
    assert f"{task_id} cancelled before it started" in worker.log
    assert registry.manifests(repository) == set()
    assert registry.tags(repository) == {}


def test_delete_during_a_registry_retry_pushes_nothing(
    kube_api: KubeApi,
    app: Celery,
    registry: RunningRegistry,
    running_operator: Operator,
    workers: Any,
    tmp_path: Path,
) -> None:
    obj = mlp_compilation("retrying", registry)
    repository = obj["spec"]["output"]["repository"]
    first = workers("first")
    registry.stop()
    try:
        apply(kube_api, obj, tmp_path)
        pushing = wait_for(lambda: phase_of(kube_api, "retrying", "Pushing"), 60, "Pushing")
        task_id = pushing["status"]["taskId"]
        wait_state(app, f"{task_id}-cpu-x86_64", ("RETRY",), timeout=60)
        first.kill_hard()  # the retry's message comes back after the visibility timeout
        delete_and_wait(kube_api, "retrying")
    finally:
        registry.start()
    second = workers("second")
    outcome = wait_for(lambda: chord_outcome(app, task_id), 90, "the index task to end")
    assert "cancelled" in outcome, outcome
    assert f"{task_id}-cpu-x86_64] received" in second.log, "the retry never came back"
    assert f"{task_id} cancelled before it started" in second.log
    assert registry.manifests(repository) == set()
    assert registry.tags(repository) == {}


def _referrers(registry: RunningRegistry, repository: str, digest: str) -> set[str]:
    """The referrers-tag index of ``digest`` and the referrers it lists."""
    path = repository.split("/", 1)[1]
    tag = digest.replace(":", "-")
    request = urllib.request.Request(
        f"{registry.url}/v2/{path}/manifests/{tag}",
        headers={"Accept": "application/vnd.oci.image.index.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        index = json.loads(response.read())
        own = response.headers["Docker-Content-Digest"]
    return {own} | {m["digest"] for m in index["manifests"]}


def test_supersede_by_spec_edit_leaves_only_the_new_generation(
    kube_api: KubeApi,
    app: Celery,
    registry: RunningRegistry,
    running_operator: Operator,
    workers: Any,
    tmp_path: Path,
) -> None:
    obj = mlp_compilation("edited", registry)
    repository = obj["spec"]["output"]["repository"]
    apply(kube_api, obj, tmp_path)
    first = wait_for(lambda: phase_of(kube_api, "edited", "Pending"), 30, "Pending")
    first_task = first["status"]["taskId"]
    obj["spec"]["validation"] = {"samples": 3}
    apply(kube_api, obj, tmp_path)
    wait_for(lambda: phase_of(kube_api, "edited", "Pending", generation=2), 30, "generation 2")

    worker = workers("both")  # finds both generations' tasks queued
    done = wait_for(
        lambda: phase_of(kube_api, "edited", "Succeeded", "Failed", generation=2), 120, "done"
    )
    status = done["status"]
    assert status["phase"] == "Succeeded", status.get("message")
    outcome = wait_for(lambda: chord_outcome(app, first_task), 60, "generation 1 to end")
    assert "moved on to" in outcome["cancelled"], outcome
    assert f"{first_task} cancelled before it started" in worker.log
    reasons = [e["reason"] for e in events_for(kube_api, "edited")]
    assert "Superseded" in reasons, reasons

    (artifact,) = status["artifacts"]
    wanted = {status["index"]["digest"], artifact["digest"]}
    wanted |= _referrers(registry, repository, artifact["digest"])
    assert registry.manifests(repository) == wanted
    tags = registry.tags(repository)
    assert tags["v1"] == status["index"]["digest"]
    assert set(tags) == {"v1", artifact["digest"].replace(":", "-")}, tags

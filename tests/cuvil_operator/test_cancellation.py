"""Cancellation that holds: kmock as the API, ``cuvil-operator``, real Redis, the real registry
and real ``cuvil-worker`` processes compiling the MLP.

In each test the worker that meets the cancelled generation's tasks never heard Celery's revoke
(it starts after it, or the worker that held the task died), so only the durable cancel can
stop the push. Afterwards the registry holds no tag or manifest of the cancelled generation.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.cuvil_operator.compilations import (
    app,
    apply,
    delete_and_wait,
    mlp_compilation,
    phase_of,
    workers,
)
from tests.cuvil_operator.conftest import Operator, events_for, wait_for
from tests.cuvil_worker.workers import wait_state
from tests.fixtures.kube import KubeApi
from tests.fixtures.registry import RunningRegistry, registry

__all__ = ["app", "registry", "workers"]
pytestmark = pytest.mark.slow


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

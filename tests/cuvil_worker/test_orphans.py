"""Manifests of killed attempts do not outlive the compilation: real Redis, the real registry,
a real ``cuvil-worker``.

A worker killed after its artifact manifest landed leaves that manifest in the registry and
its record in the push ledger (written before every push); the redelivered compile pushes
another (its benchmark figures give another digest). The leftover is made here the way the
killed attempt made it: the same push, recorded in the ledger first."""

from __future__ import annotations

import json
import re
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from cuvil_worker import contract
from cuvil_worker.cancellation import undo_push

import cuvil
from cuvil.artifact import push_artifact
from cuvil.models import mlp
from tests.cuvil_worker.test_worker import mlp_spec
from tests.cuvil_worker.workers import (
    WorkerProcess,
    compilation_request,
    start_worker,
    wait_done,
    worker_env,
)
from tests.fixtures.redis import RedisServer
from tests.fixtures.registry import RunningRegistry


@pytest.fixture
def app(redis_session: RedisServer) -> Celery:
    return contract.create_app(redis_session.url(0), redis_session.url(1))


@pytest.fixture
def worker(redis_session: RedisServer, tmp_path: Path) -> Iterator[WorkerProcess]:
    env = worker_env(redis_session.url(0), redis_session.url(1), tmp_path / "work",
                     CUVIL_WARM_UP="0", CUVIL_BENCH_ITERATIONS="3")  # fmt: skip
    process = start_worker(env, tmp_path, queues="cuvil.test.orphans", name="orphans")
    process.wait_ready()
    yield process
    process.stop()


def _referrers(registry: RunningRegistry, repository: str, digest: str) -> set[str]:
    path = repository.split("/", 1)[1]
    request = urllib.request.Request(
        f"{registry.url}/v2/{path}/manifests/{digest.replace(':', '-')}",
        headers={"Accept": "application/vnd.oci.image.index.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        index = json.loads(response.read())
        return {response.headers["Docker-Content-Digest"]} | {
            m["digest"] for m in index["manifests"]
        }


def test_a_killed_attempts_manifest_is_deleted_once_the_index_is_up(
    app: Celery, worker: WorkerProcess, registry: RunningRegistry
) -> None:
    spec = mlp_spec(registry, queue="cuvil.test.orphans")
    repository = spec["output"]["repository"]
    request = compilation_request(spec)
    model = mlp()
    compiled = cuvil.jit(model.model, model.example_inputs, dynamic_shapes=model.dynamic_shapes)
    annotations = {"dev.cuvil.compilation": "default/test"}
    ledger_key = f"cuvil:pushed:{contract.chord_task_id(request)}"
    leftover = push_artifact(compiled.contents, repository, annotations=annotations)
    app.backend.client.hset(ledger_key, leftover.ref, "cpu-x86_64")
    assert registry.manifests(repository) == {leftover.digest}

    contract.submit_compilation(app, request)
    progress = wait_done(app, request, timeout=120, workers=[worker])
    assert progress.phase == contract.PHASE_SUCCEEDED, progress.error
    assert progress.result is not None
    (artifact,) = progress.result["artifacts"]
    assert artifact["digest"] != leftover.digest
    kept = {progress.result["index"]["digest"], artifact["digest"]}
    kept |= _referrers(registry, repository, artifact["digest"])
    assert registry.manifests(repository) == kept, "the killed attempt's manifest is still there"
    assert app.backend.client.hkeys(ledger_key) != [], "the ledger keeps what it kept"
    assert leftover.ref.encode() not in app.backend.client.hkeys(ledger_key)


def test_duplicate_tasks_of_one_generation_give_one_tagged_index(
    app: Celery, worker: WorkerProcess, registry: RunningRegistry
) -> None:
    """A submitter that died between marker and "published" has its tasks published again:
    every task arrives twice under the same id. One index is tagged, nothing else pushed."""
    spec = mlp_spec(registry, queue="cuvil.test.orphans")
    repository = spec["output"]["repository"]
    request = compilation_request(spec)
    contract.submit_compilation(app, request)
    marker = contract.SUBMITTED_KEY.format(chord_id=contract.chord_task_id(request))
    app.backend.client.set(marker, contract.PUBLISHING)
    contract.submit_compilation(app, request)  # publishes the same task ids again
    progress = wait_done(app, request, timeout=120, workers=[worker])
    assert progress.phase == contract.PHASE_SUCCEEDED, progress.error
    target_id = contract.target_task_id(request, "cpu-x86_64")
    deadline = time.monotonic() + 60
    while worker.log.count(f"cuvil.compile[{target_id}] received") < 2:
        assert time.monotonic() < deadline, "the duplicate never arrived"
        time.sleep(0.2)
    while worker.log.count(f"cuvil.compile[{target_id}] succeeded") < 2:
        assert time.monotonic() < deadline, "the duplicate never ended"
        time.sleep(0.2)
    assert progress.result is not None
    (artifact,) = progress.result["artifacts"]
    index = progress.result["index"]["digest"]
    kept = {index, artifact["digest"]} | _referrers(registry, repository, artifact["digest"])
    assert registry.manifests(repository) == kept
    assert registry.tags(repository)["v1"] == index


def test_a_cancel_while_the_artifact_is_pushed_leaves_nothing(
    app: Celery, worker: WorkerProcess, registry: RunningRegistry
) -> None:
    """The cancel lands as the manifest arrives: the push's own re-check, the index task or
    the cancel's clean-up deletes it, whichever the timing leaves to do it."""
    spec = mlp_spec(registry, queue="cuvil.test.orphans")
    repository = spec["output"]["repository"]
    path = repository.split("/", 1)[1]
    request = compilation_request(spec)
    contract.submit_compilation(app, request)
    deadline = time.monotonic() + 90
    while not registry.requests(rf'"PUT /v2/{path}/manifests/sha256:'):
        assert time.monotonic() < deadline, worker.log[-3000:]
        time.sleep(0.002)
    contract.cancel_compilation(app, request)
    while not re.search(r"cuvil\.cleanup\[[^\]]+\] succeeded", worker.log[-20000:]):
        assert time.monotonic() < deadline, worker.log[-3000:]
        time.sleep(0.1)
    time.sleep(1.0)  # a push still in flight re-checks and undoes itself
    assert registry.manifests(repository) == set()
    assert registry.tags(repository) == {}


def test_a_cancels_cleanup_runs_on_each_queue_that_pushed(
    redis_server: RedisServer, registry: RunningRegistry, tmp_path: Path
) -> None:
    """A two-queue compile (a GPU target first, whose queue no worker consumes yet, and the
    CPU): what the CPU worker pushed is deleted by the CPU queue's cleanup at once; the GPU
    target's manifest waits for a worker on its own queue, which deletes it on arrival."""
    app = contract.create_app(redis_server.url(0), redis_server.url(1))
    spec = mlp_spec(registry, targets=["cuda-sm_90", "cpu-x86_64"])
    repository = spec["output"]["repository"]
    request = compilation_request(spec)
    model = mlp()
    compiled = cuvil.jit(model.model, model.example_inputs, dynamic_shapes=model.dynamic_shapes)
    ledger_key = f"cuvil:pushed:{contract.chord_task_id(request)}"
    pushed = {}
    for target in ("cuda-sm_90", "cpu-x86_64"):  # what each queue's worker pushed
        leftover = push_artifact(compiled.contents, repository, annotations={"t": target})
        app.backend.client.hset(ledger_key, leftover.ref, target)
        pushed[target] = leftover.digest
    contract.mark_current(app, request)
    env = worker_env(redis_server.url(0), redis_server.url(1), tmp_path / "work")
    cpu = start_worker(env, tmp_path, queues="cuvil.cpu", name="cpu-cleanup")
    gpu = None
    try:
        cpu.wait_ready()
        contract.cancel_compilation(app, request)
        deadline = time.monotonic() + 60
        while registry.manifests(repository) != {pushed["cuda-sm_90"]}:
            assert time.monotonic() < deadline, (registry.manifests(repository), cpu.log[-3000:])
            time.sleep(0.2)
        gpu = start_worker(env, tmp_path, queues="cuvil.cuda.sm_90", name="gpu-cleanup")
        gpu.wait_ready()
        while registry.manifests(repository):
            assert time.monotonic() < deadline, (registry.manifests(repository), gpu.log[-3000:])
            time.sleep(0.2)
    finally:
        for worker in (cpu, gpu):
            if worker is not None:
                worker.stop()
    assert app.backend.client.hkeys(ledger_key) == []


def test_a_worker_sigkilled_after_its_artifact_push_leaves_one_manifest(
    app: Celery, redis_session: RedisServer, registry: RunningRegistry, tmp_path: Path
) -> None:
    """A real kill -9 between the artifact's manifest PUT and the task's result: the compile
    is redelivered to a worker on another node, which pushes its own manifest (other benchmark
    figures, another digest); the index task then deletes the killed attempt's. Should a try
    miss that window (the task stored its result before the kill landed) it runs again, up to
    3 times."""
    from celery.result import AsyncResult

    env = worker_env(redis_session.url(0), redis_session.url(1), tmp_path / "work",
                     CUVIL_WARM_UP="0", CUVIL_BENCH_ITERATIONS="3")  # fmt: skip
    for attempt in range(3):
        queue = f"cuvil.test.kill-after-push-{attempt}"
        spec = mlp_spec(registry, queue=queue)
        repository = spec["output"]["repository"]
        path = repository.split("/", 1)[1]
        request = compilation_request(spec)
        doomed = start_worker(env, tmp_path, queues=queue, name=f"doomed-{attempt}")
        try:
            doomed.wait_ready()
            contract.submit_compilation(app, request)
            deadline = time.monotonic() + 90
            while not registry.requests(rf'"PUT /v2/{path}/manifests/sha256:'):
                assert time.monotonic() < deadline, doomed.log[-3000:]
                time.sleep(0.001)
        finally:
            doomed.kill_hard()
        target_id = contract.target_task_id(request, "cpu-x86_64")
        if AsyncResult(target_id, app=app).state != "SUCCESS":
            break
    else:
        pytest.fail("3 tries, and the kill never landed between the push and the result")
    left = registry.manifests(repository)
    assert left, "the killed attempt pushed nothing"
    # On another node: no packaged artifact of the killed attempt in its work dir to reuse.
    elsewhere = {**env, "CUVIL_WORK_DIR": str(tmp_path / "work-elsewhere")}
    rescuer = start_worker(elsewhere, tmp_path, queues=queue, name="rescuer")
    try:
        rescuer.wait_ready()
        progress = wait_done(app, request, timeout=120, workers=[rescuer])
    finally:
        rescuer.stop()
    assert progress.phase == contract.PHASE_SUCCEEDED, progress.error
    assert f"cuvil.compile[{target_id}] received" in rescuer.log, "not redelivered"
    assert progress.result is not None
    (artifact,) = progress.result["artifacts"]
    kept = {progress.result["index"]["digest"], artifact["digest"]}
    kept |= _referrers(registry, repository, artifact["digest"])
    assert registry.manifests(repository) == kept, f"left by the killed attempt: {left - kept}"
    assert left - kept, "the redelivered compile pushed the same digest: nothing was orphaned"


def test_undoing_a_push_tells_deleted_manifests_from_ones_never_pushed(
    registry: RunningRegistry,
) -> None:
    """The ledger records a ref before its push, so a cancel may find refs whose push never
    happened: undo_push deletes what is there and returns only those refs."""
    model = mlp()
    compiled = cuvil.jit(model.model, model.example_inputs, dynamic_shapes=model.dynamic_shapes)
    repository = f"{registry.host}/models/undo-{uuid.uuid4().hex[:6]}"
    pushed = push_artifact(compiled.contents, repository, annotations={"t": "pushed"})
    never = f"{repository}@sha256:{'0' * 64}"
    assert registry.manifests(repository) == {pushed.digest}
    assert undo_push([pushed.ref, never]) == [pushed.ref]
    assert registry.manifests(repository) == set()
    assert undo_push([pushed.ref]) == []  # deleted already

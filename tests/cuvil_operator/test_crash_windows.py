"""Crash windows that must lose or duplicate no compile: an operator killed around its submit,
and a Redis restarted without persistence mid-compile. kmock as the API, real Redis, the
operator as its own process; the stub worker where counting executions matters, a real
``cuvil-worker`` where the compile itself must come through."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from cuvil_worker import contract

from tests.cuvil_operator.compilations import app, apply, mlp_compilation, phase_of, workers
from tests.cuvil_operator.conftest import (
    Operator,
    StubWorker,
    celery_env,
    events_for,
    get_mc,
    wait_for,
)
from tests.fixtures.kube import KubeApi
from tests.fixtures.redis import RedisServer
from tests.fixtures.registry import RunningRegistry, registry

__all__ = ["app", "registry", "workers"]


def _operator(kube: KubeApi, redis: RedisServer, log: Path) -> Operator:
    env = {**celery_env(redis), **kube.env(), "CUVIL_OPERATOR_POLL_INTERVAL": "0.05"}
    return Operator(env, log)


def _set_stage_seconds(redis: RedisServer, seconds: float) -> None:
    client = contract.create_app(redis.url(0), redis.url(1)).backend.client
    client.set("cuvil-stub:stage-seconds", str(seconds))


def test_an_operator_dead_between_marker_and_publish_is_redone(
    kube_api: KubeApi, redis_server: RedisServer, stub_worker: StubWorker, tmp_path: Path
) -> None:
    """The window itself: the marker says "publishing" and nothing was published (the
    submitter died in between). A restarted operator publishes; the compile runs once."""
    _set_stage_seconds(redis_server, 0.2)
    kube_api.kubectl("apply", "--validate=false", "-f", "examples/minilm-cpu.yaml")
    uid = wait_for(lambda: (get_mc(kube_api, "minilm-cpu") or {}).get("metadata", {}).get("uid"))
    request = {"uid": uid, "generation": 1}
    client = contract.create_app(redis_server.url(0), redis_server.url(1)).backend.client
    client.set(contract.SUBMITTED_KEY.format(chord_id=contract.chord_task_id(request)),
               contract.PUBLISHING)  # fmt: skip
    operator = _operator(kube_api, redis_server, tmp_path / "operator.log").start()
    try:
        done = wait_for(lambda: phase_of(kube_api, "minilm-cpu", "Succeeded", "Failed"), 60)
    finally:
        operator.stop()
    assert done["status"]["phase"] == "Succeeded", done["status"]
    task_id = done["status"]["taskId"]
    lines = stub_worker.lines()
    assert lines.count(f"start {task_id}-cpu-x86_64") == 1, lines
    assert lines.count(f"start {task_id}") == 1, lines


def test_an_operator_sigkilled_right_after_submit_compiles_once(
    kube_api: KubeApi, redis_server: RedisServer, stub_worker: StubWorker, tmp_path: Path
) -> None:
    _set_stage_seconds(redis_server, 0.5)
    client = contract.create_app(redis_server.url(0), redis_server.url(1)).backend.client
    operator = _operator(kube_api, redis_server, tmp_path / "operator.log").start()
    try:
        kube_api.kubectl("apply", "--validate=false", "-f", "examples/minilm-cpu.yaml")
        deadline = time.monotonic() + 30
        while not client.keys("cuvil:submitted:*") and time.monotonic() < deadline:
            time.sleep(0.001)
        operator.kill()  # SIGKILL as soon as the marker exists: mid-submit or just after
        operator.start()
        done = wait_for(lambda: phase_of(kube_api, "minilm-cpu", "Succeeded", "Failed"), 60)
    finally:
        operator.stop()
    assert done["status"]["phase"] == "Succeeded", done["status"]
    task_id = done["status"]["taskId"]
    lines = stub_worker.lines()
    assert lines.count(f"start {task_id}-cpu-x86_64") == 1, lines
    assert lines.count(f"start {task_id}") == 1, lines


@pytest.mark.slow
def test_redis_restarted_without_its_data_mid_compile_still_ends(
    kube_api: KubeApi,
    redis_server: RedisServer,
    registry: RunningRegistry,
    running_operator: Operator,
    workers: Any,
    tmp_path: Path,
) -> None:
    resnet: dict[str, Any] = {
        "source": {"builtin": {"name": "resnet18"}},
        "inputs": [{"name": "pixel_values", "dtype": "float32", "shape": ["batch", 3, 64, 64]}],
        "dynamicDims": {"batch": {"min": 1, "max": 8}},
    }
    obj = mlp_compilation("survivor", registry, **resnet)
    workers("steady")
    apply(kube_api, obj, tmp_path)
    wait_for(lambda: phase_of(kube_api, "survivor", "Compiling", "Validating"), 60, "running")
    lost_at = time.monotonic()
    redis_server.stop()
    redis_server.start()  # empty: no tasks, no chord join, no results, no markers

    def resubmitted() -> bool:
        return "Resubmitted" in [e["reason"] for e in events_for(kube_api, "survivor")]

    wait_for(resubmitted, 30, "the Resubmitted Warning")
    noticed = time.monotonic() - lost_at
    # A poll that met Redis down is retried after kopf's broker-error delay (5 s, main.py);
    # the threshold here is 3 s (120 by default), so the bound is their sum.
    bound = float(running_operator.env["CUVIL_OPERATOR_STALL_SECONDS"]) + 5.0
    assert noticed < bound, f"the loss was noticed {noticed:.1f}s later, past {bound:g}s"
    done = wait_for(lambda: phase_of(kube_api, "survivor", "Succeeded", "Failed"), 150, "an end")
    took = time.monotonic() - lost_at
    print(f"\nRedis lost its data -> resubmitted {noticed:.1f}s, {done['status']['phase']}"
          f" {took:.1f}s later")  # fmt: skip
    assert done["status"]["phase"] == "Succeeded", done["status"].get("message")
    (artifact,) = done["status"]["artifacts"]
    assert artifact["digest"] in registry.manifests(obj["spec"]["output"]["repository"])


def test_a_compilation_gone_without_its_cancel_leaves_no_current_key(
    kube_api: KubeApi, redis_server: RedisServer, tmp_path: Path
) -> None:
    """The broker stayed unreachable through the delete handler's retries, so kopf released
    the finalizer without a cancel (here: the operator is gone and the finalizer is dropped, as
    kopf does once the handler gives up). The current-key, kept fresh by every poll while the
    compile was followed, then expires within its TTL instead of staying for weeks."""
    ttl = 3.0
    env = {**celery_env(redis_server), **kube_api.env(), "CUVIL_OPERATOR_POLL_INTERVAL": "0.2",
           "CUVIL_OPERATOR_CURRENT_TTL": str(ttl)}  # fmt: skip
    client = contract.create_app(redis_server.url(0), redis_server.url(1)).backend.client
    operator = Operator(env, tmp_path / "operator.log").start()
    try:
        kube_api.kubectl("apply", "--validate=false", "-f", "examples/minilm-cpu.yaml")
        pending = wait_for(lambda: phase_of(kube_api, "minilm-cpu", "Pending"), 30, "Pending")
        key = contract.CURRENT_KEY.format(uid=pending["metadata"]["uid"])
        assert 0 < client.ttl(key) <= ttl
        time.sleep(2 * ttl)  # no worker consumes cuvil.cpu here: still followed, still kept
        assert client.get(key) == pending["status"]["taskId"].encode(), operator.text()[-3000:]
    finally:
        operator.kill()
    kube_api.kubectl("delete", "mc", "minilm-cpu", "--wait=false")
    kube_api.kubectl("patch", "mc", "minilm-cpu", "--type=merge",
                     "-p", '{"metadata": {"finalizers": null}}')  # fmt: skip
    wait_for(lambda: get_mc(kube_api, "minilm-cpu") is None, 30, "the object to be gone")
    gone_by = time.monotonic() + ttl + 1.0
    while client.exists(key):
        assert time.monotonic() < gone_by, f"{key} outlived its TTL: {client.ttl(key)} s left"
        time.sleep(0.1)

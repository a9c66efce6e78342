"""The operator running for real (``cuvil-operator``) against kmock, with a real Redis and a
real Celery worker (the stub compile: stages that sleep, so tests can land mid-compile)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from cuvil_worker import contract

from tests.cuvil_operator.conftest import (
    API,
    PLURAL,
    Operator,
    StubWorker,
    events_for,
    get_mc,
    wait_for,
)
from tests.fixtures.kube import REPO, KubeApi
from tests.fixtures.redis import RedisServer


def _app(redis: RedisServer) -> Any:
    return contract.create_app(redis.url(0), redis.url(1))


def _set_stage_seconds(redis: RedisServer, seconds: float) -> None:
    app = _app(redis)
    app.backend.client.set("cuvil-stub:stage-seconds", str(seconds))


def _phase(kube: KubeApi, name: str, *phases: str) -> dict[str, Any] | None:
    obj = get_mc(kube, name)
    return obj if obj and obj.get("status", {}).get("phase") in phases else None


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == type_)


def test_apply_example_reaches_succeeded_and_kubectl_shows_columns(
    kube_api: KubeApi,
    redis_server: RedisServer,
    stub_worker: StubWorker,
    running_operator: Operator,
) -> None:
    _set_stage_seconds(redis_server, 0.2)
    kube_api.kubectl("apply", "--validate=false", "-f", "examples/two-targets.yaml")
    done = wait_for(
        lambda: _phase(kube_api, "minilm-two-targets", "Succeeded", "Failed"), 60, "Succeeded"
    )
    status = done["status"]
    assert status["phase"] == "Succeeded", status
    assert status["observedGeneration"] == 1
    assert status["digest"].startswith("sha256:") and status["digest"] == status["index"]["digest"]
    assert {a["target"] for a in status["artifacts"]} == {"cpu-x86_64", "cpu-x86_64-amx"}
    assert status["report"]["speedup"] == 2.0
    for type_ in ("Accepted", "Validated", "Pushed", "Ready"):
        condition = _condition(done, type_)
        assert condition["status"] == "True", condition
        assert condition["observedGeneration"] == 1 and condition["lastTransitionTime"]
    reasons = [e["reason"] for e in events_for(kube_api, "minilm-two-targets")]
    assert "Submitted" in reasons and "Succeeded" in reasons, reasons
    # The log: timestamped lines naming the object and generation, none per quiet poll.
    log = running_operator.text()
    assert re.search(
        r"^\[\d{4}-\d\d-\d\d [\d:,.]+\] cuvil_operator +\[INFO +\] "
        r"\[default/minilm-two-targets generation 1\] Submitted: generation 1 queued",
        log,
        re.MULTILINE,
    ), log[-3000:]
    assert "Timer 'on_timer_modelcompilation' succeeded" not in log

    table = kube_api.kubectl("get", "mc").stdout
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "READY", "PHASE", "TARGETS", "SPEEDUP", "SERVED", "AGE"]
    assert row.split()[:7] == [
        "minilm-two-targets", "True", "Succeeded", "2", "2.00x", "cpu-x86_64", "1",
    ]  # fmt: skip
    assert status["promoted"]["digest"] == status["digest"]
    assert _condition(done, "Promoted")["reason"] == "GatesPassed"
    wide = kube_api.kubectl("get", "mc", "-o", "wide").stdout.splitlines()
    assert wide[0].split()[7:] == ["PROMOTED", "DIGEST", "MESSAGE"]
    assert wide[1].split()[8:10] == [status["digest"], status["digest"]]
    print(f"\nkubectl get mc: {max(map(len, table.splitlines()))} columns")


def test_invalid_example_fails_naming_the_field_and_submits_nothing(
    kube_api: KubeApi,
    redis_server: RedisServer,
    running_operator: Operator,
) -> None:
    kube_api.kubectl("apply", "--validate=false", "-f", "examples/invalid.yaml")
    failed = wait_for(lambda: _phase(kube_api, "invalid", "Failed"), 30, "Failed")
    accepted = _condition(failed, "Accepted")
    assert accepted["status"] == "False" and accepted["reason"] == "InvalidSpec"
    assert "spec.inputs[0].shape[1]" in accepted["message"]
    assert "spec.inputs[0].shape[1]" in failed["status"]["message"]
    assert "taskId" not in failed["status"]
    events = wait_for(lambda: events_for(kube_api, "invalid"), 10, "an Event")
    assert any(
        e["type"] == "Warning"
        and e["reason"] == "InvalidSpec"
        and "spec.inputs[0].shape[1]" in e["message"]
        for e in events
    ), events
    # Nothing reached the broker or the submit markers.
    app = _app(redis_server)
    assert app.backend.client.keys("cuvil:submitted:*") == []
    with app.connection_for_write() as conn:
        assert conn.default_channel.client.llen("cuvil.cpu") == 0


def test_delete_during_compile_revokes_and_releases(
    kube_api: KubeApi,
    redis_server: RedisServer,
    stub_worker: StubWorker,
    running_operator: Operator,
) -> None:
    _set_stage_seconds(redis_server, 20)
    kube_api.kubectl("apply", "--validate=false", "-f", "examples/minilm-cpu.yaml")
    compiling = wait_for(lambda: _phase(kube_api, "minilm-cpu", "Compiling"), 30, "Compiling")
    assert compiling["metadata"]["finalizers"] == ["cuvil.dev/finalizer"]
    task_id = compiling["status"]["taskId"]
    kube_api.kubectl("delete", "mc", "minilm-cpu", "--wait=false")
    wait_for(lambda: get_mc(kube_api, "minilm-cpu") is None, 30, "the object to be gone")
    app = _app(redis_server)
    assert app.AsyncResult(f"{task_id}-cpu-x86_64").state == "REVOKED"
    # The index chord never runs: revoked, or failed by Celery for its revoked dependency.
    assert app.AsyncResult(task_id).state in ("REVOKED", "FAILURE")
    # The running compile was terminated: it started and never finished.
    wait_for(lambda: f"start {task_id}-cpu-x86_64" in stub_worker.lines(), 5, "a start line")
    assert f"done {task_id}-cpu-x86_64" not in stub_worker.lines()
    # Its Event was posted before the finalizer went away.
    reasons = [e["reason"] for e in events_for(kube_api, "minilm-cpu")]
    assert "Cancelled" in reasons, reasons


def test_restart_mid_compile_follows_the_same_task(
    kube_api: KubeApi,
    redis_server: RedisServer,
    stub_worker: StubWorker,
    running_operator: Operator,
) -> None:
    _set_stage_seconds(redis_server, 2)
    kube_api.kubectl("apply", "--validate=false", "-f", "examples/resnet50-cpu.yaml")
    compiling = wait_for(lambda: _phase(kube_api, "resnet50-cpu", "Compiling"), 30, "Compiling")
    task_id = compiling["status"]["taskId"]
    running_operator.kill()
    running_operator.start()
    done = wait_for(lambda: _phase(kube_api, "resnet50-cpu", "Succeeded", "Failed"), 60, "done")
    assert done["status"]["phase"] == "Succeeded"
    assert done["status"]["taskId"] == task_id
    lines = stub_worker.lines()
    assert lines.count(f"start {task_id}-cpu-x86_64") == 1, lines
    assert lines.count(f"start {task_id}") == 1, lines
    submitted = [e for e in events_for(kube_api, "resnet50-cpu") if e["reason"] == "Submitted"]
    assert len(submitted) == 1, submitted


def test_spec_update_compiles_the_new_generation(
    kube_api: KubeApi,
    redis_server: RedisServer,
    stub_worker: StubWorker,
    running_operator: Operator,
    tmp_path: Path,
) -> None:
    _set_stage_seconds(redis_server, 1.5)
    kube_api.kubectl("apply", "--validate=false", "-f", "examples/resnet50-cpu.yaml")
    first = wait_for(lambda: _phase(kube_api, "resnet50-cpu", "Compiling"), 30, "Compiling")
    first_task = first["status"]["taskId"]
    manifest = yaml.safe_load((REPO / "examples" / "resnet50-cpu.yaml").read_text())
    manifest["spec"]["precision"] = "bf16"
    manifest["spec"]["targets"] = ["cpu-x86_64-amx"]  # the old target's task must still go
    changed = tmp_path / "resnet50-bf16.yaml"
    changed.write_text(yaml.safe_dump(manifest))
    kube_api.kubectl("apply", "--validate=false", "-f", str(changed))

    def second_done() -> dict[str, Any] | None:
        obj = _phase(kube_api, "resnet50-cpu", "Succeeded", "Failed")
        return obj if obj and obj["status"]["observedGeneration"] == 2 else None

    done = wait_for(second_done, 60, "generation 2 to finish")
    assert done["metadata"]["generation"] == 2
    assert done["status"]["phase"] == "Succeeded"
    assert done["status"]["taskId"] == first_task[: -len("-1")] + "-2" != first_task
    assert all(c["observedGeneration"] == 2 for c in done["status"]["conditions"])
    app = _app(redis_server)
    assert app.AsyncResult(f"{first_task}-cpu-x86_64").state == "REVOKED"
    assert [a["target"] for a in done["status"]["artifacts"]] == ["cpu-x86_64-amx"]
    reasons = [e["reason"] for e in events_for(kube_api, "resnet50-cpu")]
    assert "Superseded" in reasons, reasons
    assert kube_api.get(API, PLURAL, "default", "resnet50-cpu") is not None


def test_broker_outage_is_retried_not_failed(
    kube_api: KubeApi, redis_server: RedisServer, running_operator: Operator
) -> None:
    redis_server.stop()
    try:
        kube_api.kubectl("apply", "--validate=false", "-f", "examples/minilm-cpu.yaml")
        wait_for(lambda: "broker unavailable" in running_operator.text(), 30, "a retry")
        obj = get_mc(kube_api, "minilm-cpu")
        assert obj is not None and "phase" not in obj.get("status", {}), obj
    finally:
        redis_server.start()
    pending = wait_for(lambda: _phase(kube_api, "minilm-cpu", "Pending"), 30, "Pending")
    assert pending["status"]["taskId"].endswith("-1")
    assert _app(redis_server).backend.client.keys("cuvil:submitted:*") != []


def test_kubectl_get_mc_fits_120_columns_for_three_targets(
    kube_api: KubeApi,
    redis_server: RedisServer,
    stub_worker: StubWorker,
    running_operator: Operator,
    tmp_path: Path,
) -> None:
    _set_stage_seconds(redis_server, 0.1)
    manifest = yaml.safe_load((REPO / "examples" / "resnet50-cpu.yaml").read_text())
    manifest["metadata"]["name"] = "resnet50-three-targets"
    manifest["spec"]["targets"] = ["cpu-x86_64", "cpu-x86_64-amx", "cuda-sm_90"]
    manifest["spec"]["queue"] = "cuvil.cpu"  # the stub worker takes all three
    path = tmp_path / "three.yaml"
    path.write_text(yaml.safe_dump(manifest))
    kube_api.kubectl("apply", "--validate=false", "-f", str(path))
    wait_for(lambda: _phase(kube_api, "resnet50-three-targets", "Succeeded"), 60, "Succeeded")
    table = kube_api.kubectl("get", "mc").stdout.splitlines()
    width = max(len(line) for line in table)
    print(f"\nkubectl get mc, three targets: {width} columns\n" + "\n".join(table))
    assert width < 120
    assert table[1].split()[1:4] == ["True", "Succeeded", "3"]

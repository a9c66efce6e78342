"""The reconcile flows with plain dicts and a recording queue (no cluster, no broker)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from cuvil_operator.config import OperatorConfig
from cuvil_operator.main import on_cleanup_operator, on_startup_operator
from cuvil_operator.reconcile_compilation import (
    reconcile_delete,
    reconcile_progress,
    reconcile_submit,
)

REPO = Path(__file__).resolve().parents[2]
NOW = "2026-01-01T00:00:00Z"


class RecordingQueue:
    def __init__(self, progress: dict[str, Any] | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.next_progress = progress or {"phase": "Pending", "targets": {}}
        self.submitted: set[str] = set()

    def submit(self, request: Mapping[str, Any]) -> str:
        self.calls.append(("submit", f"{request['uid']}-{request['generation']}"))
        self.submitted.add(f"{request['uid']}-{request['generation']}")
        return f"cuvil-{request['uid']}-{request['generation']}"

    def store_push_config(self, request: Mapping[str, Any], docker_config: str) -> None:
        self.calls.append(("push-config", f"{request['uid']}-{request['generation']}"))

    def idle_queues(self, queues: Any) -> set[str]:
        return set()

    def is_submitted(self, request: Mapping[str, Any]) -> bool:
        return f"{request['uid']}-{request['generation']}" in self.submitted

    def keep_current(self, request: Mapping[str, Any]) -> None:
        self.calls.append(("keep", f"{request['uid']}-{request['generation']}"))

    def progress(self, request: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append(("progress", f"{request['uid']}-{request['generation']}"))
        return self.next_progress

    def cancel(self, request: Mapping[str, Any]) -> None:
        targets = ",".join(request["spec"]["targets"])
        self.calls.append(("cancel", f"{request['uid']}-{request['generation']}:{targets}"))


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []

    def __call__(self, type_: str, reason: str, message: str) -> None:
        self.posted.append((type_, reason, message))

    @property
    def reasons(self) -> list[str]:
        return [reason for _, reason, _ in self.posted]


def _object(example: str = "minilm-cpu.yaml", generation: int = 1) -> dict[str, Any]:
    obj = yaml.safe_load((REPO / "examples" / example).read_text())
    obj["metadata"].update(uid="u1", namespace="default", generation=generation)
    return dict(obj)


def test_submit_once_per_generation() -> None:
    obj, queue, events = _object(), RecordingQueue(), Events()
    status = reconcile_submit(obj["metadata"], obj["spec"], {}, queue, events, NOW)
    assert status is not None and status["taskId"] == "cuvil-u1-1"
    assert status["observedGeneration"] == 1 and status["phase"] == "Pending"
    assert status["traceId"] is not None and len(status["traceId"]) == 32
    # Resume after a restart, or a retried handler: nothing new.
    again = reconcile_submit(obj["metadata"], obj["spec"], status, queue, events, NOW)
    assert again is None
    assert queue.calls == [("submit", "u1-1")] and events.reasons == ["Submitted"]


def test_invalid_spec_submits_nothing() -> None:
    obj, queue, events = _object("invalid.yaml"), RecordingQueue(), Events()
    status = reconcile_submit(obj["metadata"], obj["spec"], {}, queue, events, NOW)
    assert status is not None and status["phase"] == "Failed"
    assert queue.calls == []
    assert events.posted[0][:2] == ("Warning", "InvalidSpec")
    assert "spec.inputs[0].shape[1]" in events.posted[0][2]
    reconcile_delete(obj["metadata"], obj["spec"], status, queue, events)
    assert queue.calls == []  # nothing was queued, nothing to revoke


def test_spec_update_cancels_the_running_generation_with_its_old_targets() -> None:
    obj, queue, events = _object(), RecordingQueue(), Events()
    status = reconcile_submit(obj["metadata"], obj["spec"], {}, queue, events, NOW)
    assert status is not None
    old_spec = copy.deepcopy(obj["spec"])
    obj["spec"]["targets"] = ["cpu-x86_64", "cpu-x86_64-amx"]
    obj["metadata"]["generation"] = 2
    new = reconcile_submit(
        obj["metadata"], obj["spec"], status, queue, events, NOW, old_spec=old_spec
    )
    assert new is not None and new["taskId"] == "cuvil-u1-2" and new["observedGeneration"] == 2
    assert queue.calls == [("submit", "u1-1"), ("cancel", "u1-1:cpu-x86_64"), ("submit", "u1-2")]
    assert events.reasons == ["Submitted", "Superseded", "Submitted"]


def test_progress_writes_only_changes_and_posts_an_event_per_phase() -> None:
    obj, queue, events = _object(), RecordingQueue(), Events()
    status = reconcile_submit(obj["metadata"], obj["spec"], {}, queue, events, NOW)
    assert status is not None
    assert reconcile_progress(obj["metadata"], obj["spec"], status, queue, events, NOW) is None
    queue.next_progress = {
        "phase": "Compiling",
        "targets": {"cpu-x86_64": {"state": "COMPILING", "stage": "passes"}},
    }
    patch = reconcile_progress(obj["metadata"], obj["spec"], status, queue, events, NOW)
    assert patch is not None and patch["phase"] == "Compiling"
    status = {**status, **patch}
    queue.next_progress = {"phase": "Failed", "error": "cpu-x86_64: ExportError: boom"}
    patch = reconcile_progress(obj["metadata"], obj["spec"], status, queue, events, NOW)
    assert patch is not None and patch["phase"] == "Failed"
    assert events.posted[-1] == ("Warning", "Failed", "cpu-x86_64: ExportError: boom")
    status = {**status, **patch}
    calls = len(queue.calls)
    assert reconcile_progress(obj["metadata"], obj["spec"], status, queue, events, NOW) is None
    assert len(queue.calls) == calls  # finished: no more reads
    assert events.reasons == ["Submitted", "Compiling", "Failed"]


def test_progress_waits_for_the_update_handler_on_a_new_generation() -> None:
    obj, queue, events = _object(), RecordingQueue(), Events()
    status = reconcile_submit(obj["metadata"], obj["spec"], {}, queue, events, NOW)
    assert status is not None
    obj["metadata"]["generation"] = 2
    assert reconcile_progress(obj["metadata"], obj["spec"], status, queue, events, NOW) is None
    assert queue.calls == [("submit", "u1-1")]


def test_delete_cancels_every_generation_but_announces_only_a_running_one() -> None:
    obj, queue, events = _object(), RecordingQueue(), Events()
    status = reconcile_submit(obj["metadata"], obj["spec"], {}, queue, events, NOW)
    assert status is not None
    reconcile_delete(obj["metadata"], obj["spec"], status, queue, events)
    assert queue.calls[-1] == ("cancel", "u1-1:cpu-x86_64") and events.reasons[-1] == "Cancelled"
    announced = len(events.reasons)
    finished = {**status, "phase": "Succeeded"}
    reconcile_delete(obj["metadata"], obj["spec"], finished, queue, events)
    assert queue.calls[-1] == ("cancel", "u1-1:cpu-x86_64"), "the current-key must go too"
    assert len(events.reasons) == announced


def test_progress_resubmits_a_compile_the_broker_lost() -> None:
    obj, queue, events = _object(), RecordingQueue(), Events()
    status = reconcile_submit(obj["metadata"], obj["spec"], {}, queue, events, NOW)
    assert status is not None
    reconcile_progress(obj["metadata"], obj["spec"], status, queue, events, NOW)
    assert [c[0] for c in queue.calls] == ["submit", "keep", "progress"]
    queue.submitted.clear()  # Redis restarted without its data
    reconcile_progress(obj["metadata"], obj["spec"], status, queue, events, NOW)
    assert [c[0] for c in queue.calls] == ["submit", "keep", "progress", "submit", "progress"]
    assert events.posted[-1][:2] == ("Warning", "Resubmitted"), events.posted


def test_config_from_environment() -> None:
    config = OperatorConfig.from_env(
        {
            "CUVIL_BROKER_URL": "redis://h:1/0",
            "CUVIL_OPERATOR_POLL_INTERVAL": "0.5",
            "CUVIL_OPERATOR_NAMESPACE": "ml",
        }
    )
    assert config.broker_url == "redis://h:1/0" and config.poll_interval == 0.5
    assert config.namespace == "ml" and config.result_backend.endswith("/1")
    assert config.current_ttl == 86400
    with pytest.raises(ValueError):
        OperatorConfig.from_env({"CUVIL_OPERATOR_POLL_INTERVAL": "0"})
    assert OperatorConfig.from_env({"CUVIL_OPERATOR_CURRENT_TTL": "30"}).current_ttl == 30
    with pytest.raises(ValueError, match="CUVIL_OPERATOR_CURRENT_TTL"):
        OperatorConfig.from_env({"CUVIL_OPERATOR_CURRENT_TTL": "5"})  # 2.5 polls


def test_fixing_an_invalid_spec_submits_the_new_generation() -> None:
    obj, queue, events = _object("invalid.yaml"), RecordingQueue(), Events()
    failed = reconcile_submit(obj["metadata"], obj["spec"], {}, queue, events, NOW)
    assert failed is not None and failed["phase"] == "Failed"
    obj["spec"]["dynamicDims"]["seq"] = {"min": 8, "max": 128}
    obj["metadata"]["generation"] = 2
    status = reconcile_submit(obj["metadata"], obj["spec"], failed, queue, events, NOW)
    assert status is not None and status["phase"] == "Pending" and status["taskId"] == "cuvil-u1-2"
    accepted = next(c for c in status["conditions"] if c["type"] == "Accepted")
    assert accepted["status"] == "True" and accepted["observedGeneration"] == 2
    assert queue.calls == [("submit", "u1-2")]  # the refused generation had nothing to cancel


def test_startup_bounds_how_long_a_deletion_waits_for_the_timer() -> None:
    """kopf re-checks a timer that is mid-call at deletion after ``cancellation_polling``
    seconds (60 by default): that long the finalizer would pin a deleted object."""
    settings, memo = kopf.OperatorSettings(), kopf.Memo()
    on_startup_operator(settings=settings, memo=memo)
    try:
        assert settings.persistence.finalizer == "cuvil.dev/finalizer"
        assert settings.background.cancellation_polling <= 2.0
        assert (settings.background.instant_exit_timeout or 0) >= 0.1
    finally:
        on_cleanup_operator(memo=memo)

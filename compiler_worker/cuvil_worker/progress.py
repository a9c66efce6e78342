"""Progress of a compilation as the operator reads it from the result backend: one GET per
task, per-target state and stage, and on failure the worker's reason, condition and details
(see ``cuvil_worker.errors``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from celery import Celery

from cuvil_worker.contract import (
    PHASE_FAILED,
    PHASE_OF_STATE,
    PHASE_ORDER,
    PHASE_PENDING,
    PHASE_PUSHING,
    PHASE_SUCCEEDED,
    RUNNING_STATES,
    chord_task_id,
    target_task_id,
    targets_of,
)


@dataclass
class TargetProgress:
    """One task's state. On failure: ``reason`` (CamelCase), ``condition`` (the status
    condition of the stage that failed, when the worker says) and ``details`` (what was
    measured: failing gates, the report so far)."""

    state: str
    stage: str | None = None
    error: str | None = None
    reason: str | None = None
    condition: str | None = None
    details: dict[str, Any] | None = None
    fault: str | None = None  # a registry fault it is retrying (state RETRY)


@dataclass
class Progress:
    """What the operator writes into status: phase, per-target stage, result or error."""

    phase: str
    targets: dict[str, TargetProgress] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    error: str | None = None
    reason: str | None = None
    condition: str | None = None

    @property
    def done(self) -> bool:
        return self.phase in (PHASE_SUCCEEDED, PHASE_FAILED)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _snapshot(app: Celery, task_id: str) -> tuple[str, Any]:
    """State and info of a task from one read (two reads could straddle a state change)."""
    meta = app.backend.get_task_meta(task_id)
    state, info = meta.get("status", "PENDING"), meta.get("result")
    if state in ("FAILURE", "RETRY", "REVOKED") and isinstance(info, Mapping):
        info = app.backend.exception_to_python(info)
    return state, info


def _error_text(info: Any) -> str:
    if isinstance(info, BaseException):
        message = info.args[0] if len(info.args) == 2 else info  # (message, details)
        return f"{type(info).__name__}: {message}"
    return str(info)


def _failure(state: str, info: Any) -> TargetProgress | None:
    """The failure a task's state and info describe, or None if it did not fail."""
    if state == "REVOKED":
        return TargetProgress(state, error="cancelled", reason="Cancelled")
    if state == "SUCCESS" and isinstance(info, Mapping) and info.get("cancelled"):
        return TargetProgress(state, error=f"cancelled: {info['cancelled']}", reason="Cancelled")
    if state != "FAILURE":
        return None
    details = getattr(info, "details", None)
    return TargetProgress(
        state,
        error=_error_text(info),
        reason=str(getattr(info, "reason", None) or type(info).__name__),
        condition=getattr(info, "condition", None),
        details=dict(details) if isinstance(details, Mapping) else None,
    )


def _target_progress(state: str, info: Any) -> TargetProgress:
    failure = _failure(state, info)
    if failure is not None:
        return failure
    if state == "RETRY":
        return TargetProgress(state, stage="push", fault=_error_text(info))
    stage = info.get("stage") if isinstance(info, Mapping) else None
    return TargetProgress(state, stage=stage)


def read_progress(app: Celery, request: Mapping[str, Any]) -> Progress:
    """The compilation's progress, read from the result backend (cheap: one GET per task)."""
    targets = targets_of(request)
    per_target = {
        target: _target_progress(*_snapshot(app, target_task_id(request, target)))
        for target in targets
    }
    failed = {t: p for t, p in per_target.items() if p.error is not None}
    if failed:
        reasons = "; ".join(f"{t}: {p.error}" for t, p in failed.items())
        first = next(iter(failed.values()))
        return Progress(PHASE_FAILED, per_target, error=reasons, reason=first.reason,
                        condition=first.condition)  # fmt: skip
    final_state, final_info = _snapshot(app, chord_task_id(request))
    final = _failure(final_state, final_info)
    if final is not None:
        return Progress(PHASE_FAILED, per_target, error=final.error, reason=final.reason,
                        condition=final.condition or "Pushed")  # fmt: skip
    if final_state == "SUCCESS":
        return Progress(PHASE_SUCCEEDED, per_target, result=final_info)
    if final_state in RUNNING_STATES:
        return Progress(PHASE_PUSHING, per_target)
    phases = [PHASE_OF_STATE.get(p.state, PHASE_PENDING) for p in per_target.values()]
    running = [p for p in phases if p != PHASE_PENDING]
    if not running:
        return Progress(PHASE_PENDING, per_target)
    return Progress(min(running, key=PHASE_ORDER.index), per_target)

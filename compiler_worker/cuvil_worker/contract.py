"""The Celery contract between the operator and the compile workers (see docs/contracts.md).

Light on purpose: only celery/kombu/redis are imported here, so the operator can submit, follow
and cancel compilations without importing torch or the compiler.

    submit_compilation(app, request) -> chord id   (idempotent per uid + generation)
    read_progress(app, request)      -> Progress   (phase, stage per target, result or error)
    cancel_compilation(app, request)               (revokes every task of that generation)

One ``cuvil.compile`` task per target, routed to the target's queue, joined by a
``cuvil.push_index`` chord callback that pushes the OCI index; the chord's id is what the
operator follows.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from celery import Celery, chord

from cuvil.targets import TargetError, parse_target

TASK_COMPILE = "cuvil.compile"
TASK_INDEX = "cuvil.push_index"

# Custom task states; their meta is {"stage": <pipeline stage>, "target": <target>,
# "worker": <worker hostname>}.
STATE_COMPILING = "COMPILING"
STATE_VALIDATING = "VALIDATING"
STATE_PUSHING = "PUSHING"
RUNNING_STATES = ("STARTED", STATE_COMPILING, STATE_VALIDATING, STATE_PUSHING, "RETRY")

# Operator phases (ModelCompilation status.phase), in the order a compilation passes them.
PHASE_PENDING = "Pending"
PHASE_COMPILING = "Compiling"
PHASE_VALIDATING = "Validating"
PHASE_PUSHING = "Pushing"
PHASE_SUCCEEDED = "Succeeded"
PHASE_FAILED = "Failed"
_PHASE_OF_STATE = {
    "PENDING": PHASE_PENDING,
    "RECEIVED": PHASE_PENDING,
    "STARTED": PHASE_COMPILING,
    STATE_COMPILING: PHASE_COMPILING,
    STATE_VALIDATING: PHASE_VALIDATING,
    STATE_PUSHING: PHASE_PUSHING,
    "RETRY": PHASE_PUSHING,  # only registry faults are retried
    "SUCCESS": PHASE_PUSHING,  # a finished target waits for the index push
}
_PHASE_ORDER = (PHASE_PENDING, PHASE_COMPILING, PHASE_VALIDATING, PHASE_PUSHING)

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_RESULT_BACKEND = "redis://127.0.0.1:6379/1"
SUBMITTED_KEY = "cuvil:submitted:{chord_id}"
SUBMITTED_TTL_S = 30 * 24 * 3600

PRIORITY_INDEX = 0  # Redis: 0 is served first
PRIORITY_COMPILE = 6

REQUEST_KEYS = ("uid", "generation", "namespace", "name", "spec", "traceparent")


class RequestError(ValueError):
    """The request does not follow the contract (missing keys, no targets)."""


def queue_for_target(target: str, override: str | None = None) -> str:
    """``cpu-x86_64`` / ``cpu-x86_64-amx`` / ``cpu`` -> ``cuvil.cpu``; ``cuda-sm_90`` ->
    ``cuvil.cuda.sm_90``. A non-empty ``override`` (spec.queue) wins."""
    if override:
        return override
    try:
        parsed = parse_target(target)
    except TargetError as error:
        raise RequestError(str(error)) from None
    if parsed.family == "cuda" and not parsed.variant:
        raise RequestError(f"target {target!r} names no GPU architecture; use cuda-sm_XX")
    return parsed.queue


def chord_task_id(request: Mapping[str, Any]) -> str:
    return f"cuvil-{request['uid']}-{request['generation']}"


def target_task_id(request: Mapping[str, Any], target: str) -> str:
    return f"{chord_task_id(request)}-{target}"


def targets_of(request: Mapping[str, Any]) -> list[str]:
    targets = list(request.get("spec", {}).get("targets") or [])
    if not targets:
        raise RequestError("spec.targets is empty")
    if len(set(targets)) != len(targets):
        raise RequestError(f"spec.targets repeats a target: {targets}")
    return targets


def check_request(request: Mapping[str, Any]) -> None:
    missing = [key for key in REQUEST_KEYS if key not in request]
    if missing:
        raise RequestError(f"request lacks {missing}")
    targets_of(request)


def transport_options(visibility_timeout: float, restore_interval: float = 5.0) -> dict[str, Any]:
    """Broker options that make a killed worker's task come back (see shared/NOTES.md).

    Workers keep the message of a running task fresh (``cuvil_worker.lease``), so the
    visibility timeout bounds how long a crash goes unnoticed, not how long a compile may run.
    """
    return {
        "visibility_timeout": visibility_timeout,
        "unacked_restore_interval": restore_interval,
        "unacked_restore_throttle": 1,
        # Redis emulates priorities with one list per step ("cuvil.cpu", "cuvil.cpu:6"):
        # index pushes (PRIORITY_INDEX) overtake queued compiles (PRIORITY_COMPILE), so a
        # compilation finishes when its targets do, not after everything queued behind them.
        "priority_steps": [PRIORITY_INDEX, 3, PRIORITY_COMPILE, 9],
        "sep": ":",
        "queue_order_strategy": "priority",
    }


def create_app(
    broker_url: str | None = None,
    backend_url: str | None = None,
    *,
    visibility_timeout: float | None = None,
    restore_interval: float | None = None,
) -> Celery:
    """A Celery app speaking the contract; arguments default to the shared environment
    (``CUVIL_BROKER_URL``, ``CUVIL_RESULT_BACKEND``, ``CUVIL_VISIBILITY_TIMEOUT``)."""
    broker = broker_url or os.environ.get("CUVIL_BROKER_URL", DEFAULT_BROKER_URL)
    backend = backend_url or os.environ.get("CUVIL_RESULT_BACKEND", DEFAULT_RESULT_BACKEND)
    if visibility_timeout is None:
        visibility_timeout = float(os.environ.get("CUVIL_VISIBILITY_TIMEOUT", "60"))
    if restore_interval is None:
        restore_interval = float(os.environ.get("CUVIL_RESTORE_INTERVAL", "5"))
    app = Celery("cuvil", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_track_started=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        broker_transport_options=transport_options(visibility_timeout, restore_interval),
        result_backend_transport_options={"retry_policy": {"timeout": 5.0}},
        result_expires=7 * 24 * 3600,
        result_extended=True,
        task_default_queue="cuvil.cpu",
    )
    return app


def _submitted_key(request: Mapping[str, Any]) -> str:
    return SUBMITTED_KEY.format(chord_id=chord_task_id(request))


def submit_compilation(app: Celery, request: Mapping[str, Any]) -> str:
    """Queue one compile per target and the index chord; returns the chord id.

    A second call for the same uid + generation submits nothing (a marker set with SET NX in
    the result backend's Redis guards it), so operator handlers may repeat freely.
    """
    check_request(request)
    request = dict(request)
    targets = targets_of(request)
    override = request["spec"].get("queue") or None
    client = app.backend.client
    if not client.set(_submitted_key(request), "1", nx=True, ex=SUBMITTED_TTL_S):
        return chord_task_id(request)
    try:
        header = [
            app.signature(
                TASK_COMPILE,
                args=(request, target),
                task_id=target_task_id(request, target),
                queue=queue_for_target(target, override),
                priority=PRIORITY_COMPILE,
            )
            for target in targets
        ]
        callback = app.signature(
            TASK_INDEX,
            args=(request,),
            task_id=chord_task_id(request),
            queue=queue_for_target(targets[0], override),
            priority=PRIORITY_INDEX,
            immutable=True,
        )
        chord(header, app=app)(callback)
    except BaseException:
        client.delete(_submitted_key(request))
        raise
    _stop_listening(app, [target_task_id(request, t) for t in targets] + [chord_task_id(request)])
    return chord_task_id(request)


def _stop_listening(app: Celery, task_ids: list[str]) -> None:
    """Publishing subscribes to each task's result channel (Redis pub/sub); the operator polls
    instead, so drop those subscriptions now rather than one per submit for the process's life."""
    consumer = getattr(app.backend, "result_consumer", None)
    if consumer is not None:
        for task_id in task_ids:
            consumer.cancel_for(task_id)


def is_submitted(app: Celery, request: Mapping[str, Any]) -> bool:
    return bool(app.backend.client.exists(_submitted_key(request)))


@dataclass
class TargetProgress:
    state: str
    stage: str | None = None
    error: str | None = None


@dataclass
class Progress:
    """What the operator writes into status: phase, per-target stage, result or error."""

    phase: str
    targets: dict[str, TargetProgress] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    error: str | None = None

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
        return f"{type(info).__name__}: {info}"
    return str(info)


def _target_progress(state: str, info: Any) -> TargetProgress:
    if state in ("FAILURE", "REVOKED"):
        return TargetProgress(state, error="cancelled" if state == "REVOKED" else _error_text(info))
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
        return Progress(PHASE_FAILED, per_target, error=reasons)
    final_state, final_info = _snapshot(app, chord_task_id(request))
    if final_state == "SUCCESS":
        return Progress(PHASE_SUCCEEDED, per_target, result=final_info)
    if final_state in ("FAILURE", "REVOKED"):
        error = "cancelled" if final_state == "REVOKED" else _error_text(final_info)
        return Progress(PHASE_FAILED, per_target, error=error)
    if final_state in RUNNING_STATES:
        return Progress(PHASE_PUSHING, per_target)
    phases = [_PHASE_OF_STATE.get(p.state, PHASE_PENDING) for p in per_target.values()]
    running = [p for p in phases if p != PHASE_PENDING]
    if not running:
        return Progress(PHASE_PENDING, per_target)
    return Progress(min(running, key=_PHASE_ORDER.index), per_target)


def cancel_compilation(app: Celery, request: Mapping[str, Any]) -> None:
    """Revoke every task of this generation (running ones are terminated). The submit marker
    stays, so a repeated submit of a cancelled generation does not resurrect it."""
    ids = [target_task_id(request, t) for t in targets_of(request)] + [chord_task_id(request)]
    app.control.revoke(ids, terminate=True, signal="SIGTERM")
    for task_id in ids:
        if _snapshot(app, task_id)[0] not in ("SUCCESS", "FAILURE"):
            app.backend.mark_as_revoked(task_id, reason="cancelled")

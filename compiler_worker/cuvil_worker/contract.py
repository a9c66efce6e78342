"""The Celery contract between the operator and the compile workers (see docs/contracts.md).

Light on purpose: only celery/kombu/redis are imported here, so the operator can submit, follow
and cancel compilations without importing torch or the compiler.

    submit_compilation(app, request) -> chord id   (idempotent per uid + generation + attempt)
    read_progress(app, request)      -> Progress   (phase, stage per target, result or error)
    cancel_compilation(app, request)               (revokes every task of that generation)
    not_current(app, request)        -> reason     (None while the request is still wanted)

Which request is wanted is recorded in the result backend's Redis, one key per object
(``cuvil:current:<uid>`` = the chord id of the attempt the operator follows): submit sets it,
a newer generation or retry replaces it, cancel turns it into a tombstone, and it expires unless
the operator keeps it while it follows the compile (``keep_current``). A missing key means
Redis lost its data; the operator then queues the compile again, which sets it. Workers read
it before they start, at every stage, before each push and before the index is tagged.
Celery's revoke alone cannot hold a cancel: it reaches only workers alive when it is sent, and
only while they remember it.

One ``cuvil.compile`` task per target, routed to the target's queue, joined by a
``cuvil.push_index`` chord callback that pushes the OCI index; the chord's id is what the
operator follows.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from celery import Celery, chord

from cuvil.targets import TargetError, parse_target

# Celery rebuilds a stored failure as its own class only when that class's module is imported.
from cuvil_worker import errors  # noqa: F401

TASK_COMPILE = "cuvil.compile"
TASK_INDEX = "cuvil.push_index"
TASK_CLEANUP = "cuvil.cleanup"  # sent by a cancel: deletes what the cancelled request pushed
INDEX_LABEL = "index"  # the push ledger's label for the index (targets label their manifests)

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
PHASE_OF_STATE = {
    "PENDING": PHASE_PENDING,
    "RECEIVED": PHASE_PENDING,
    "STARTED": PHASE_COMPILING,
    STATE_COMPILING: PHASE_COMPILING,
    STATE_VALIDATING: PHASE_VALIDATING,
    STATE_PUSHING: PHASE_PUSHING,
    "RETRY": PHASE_PUSHING,  # only registry faults are retried
    "SUCCESS": PHASE_PUSHING,  # a finished target waits for the index push
}
PHASE_ORDER = (PHASE_PENDING, PHASE_COMPILING, PHASE_VALIDATING, PHASE_PUSHING)

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_RESULT_BACKEND = "redis://127.0.0.1:6379/1"
SUBMITTED_KEY = "cuvil:submitted:{chord_id}"
SUBMITTED_TTL_S = 30 * 24 * 3600
CURRENT_KEY = "cuvil:current:{uid}"
# How long a current-key lives unless the operator refreshes it (``keep_current``, every poll
# of a followed compile): a key whose object went away without a cancel (the broker was down
# past the delete handler's retries) expires, rather than staying for SUBMITTED_TTL_S.
CURRENT_TTL_S = 24 * 3600
# The submit marker's two values: set before publishing, then after. A submit that finds
# "publishing" (the last submitter died in between) publishes again under the same task ids.
PUBLISHING, PUBLISHED = b"publishing", b"published"

PRIORITY_INDEX = 0  # Redis: 0 is served first
PRIORITY_COMPILE = 6

REQUEST_KEYS = ("uid", "generation", "namespace", "name", "spec", "traceparent")
# Optional request keys: "attempt" (0 first; each cuvil.dev/retry of a failed generation adds
# one), "pushSecret" ("namespace/name" of the Secret whose docker config the push uses; the
# config itself is stored apart, see store_push_config).


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
    """``cuvil-<uid>-<generation>``, with ``-r<attempt>`` for a retried attempt."""
    base = f"cuvil-{request['uid']}-{request['generation']}"
    attempt = int(request.get("attempt") or 0)
    return f"{base}-r{attempt}" if attempt else base


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

    Each sweep that re-queues stale messages runs under a Redis lock that kombu holds for 300 s
    unless released, so a worker killed mid-sweep would stop every worker's sweeps for five
    minutes: here the lock lasts one visibility timeout. A sweep takes milliseconds, and two
    sweeps at once are safe (each message moves back in a transaction watching the unacked
    hash), so a short lock costs nothing.
    """
    return {
        "visibility_timeout": visibility_timeout,
        "unacked_mutex_expire": visibility_timeout,
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


def _current_key(request: Mapping[str, Any]) -> str:
    return CURRENT_KEY.format(uid=request["uid"])


# The current-key is written (ARGV[2], for ARGV[3] seconds) only while it names this request
# (ARGV[1]) or names none: a newer request's key, or a tombstone, is left as it is. A cancel
# writes the tombstone (where Redis lost the key, it then speaks for the operator); the
# operator's keep writes the request's own id again, refreshing its TTL.
_SET_IF_OURS = """
local now = redis.call('get', KEYS[1])
if now == false or now == ARGV[1] then
  return redis.call('set', KEYS[1], ARGV[2], 'EX', ARGV[3])
end
return 0
"""
TOMBSTONE = "cancelled"


def mark_current(app: Celery, request: Mapping[str, Any], ttl: float = CURRENT_TTL_S) -> None:
    app.backend.client.set(_current_key(request), chord_task_id(request), ex=int(ttl))


def keep_current(app: Celery, request: Mapping[str, Any], ttl: float = CURRENT_TTL_S) -> bool:
    """The operator still follows this request: its current-key lives ``ttl`` seconds more.
    False when another request (or a cancel) owns the key."""
    own = chord_task_id(request)
    return bool(app.backend.client.eval(_SET_IF_OURS, 1, _current_key(request), own, own, int(ttl)))


def release_current(app: Celery, request: Mapping[str, Any]) -> None:
    app.backend.client.eval(
        _SET_IF_OURS, 1, _current_key(request), chord_task_id(request), TOMBSTONE, SUBMITTED_TTL_S
    )


def not_current(app: Celery, request: Mapping[str, Any]) -> str | None:
    """Why this request is no longer wanted (deleted, superseded), or None while it is (or
    while nobody knows: see ``is_current_known``)."""
    now = app.backend.client.get(_current_key(request))
    if now is None:
        return None
    current = now.decode() if isinstance(now, bytes) else str(now)
    if current == TOMBSTONE:
        return f"{request['namespace']}/{request['name']} was deleted or cancelled"
    if current != chord_task_id(request):
        return f"{request['namespace']}/{request['name']} moved on to {current}"
    return None


def is_current_known(app: Celery, request: Mapping[str, Any]) -> bool:
    """False when Redis holds no word on the object at all: it lost its data (restarted
    without persistence), and the operator has not queued the compile again yet."""
    return bool(app.backend.client.exists(_current_key(request)))


def submit_compilation(
    app: Celery, request: Mapping[str, Any], current_ttl: float = CURRENT_TTL_S
) -> str:
    """Queue one compile per target and the index chord; returns the chord id.

    Idempotent and recoverable: a marker in the result backend's Redis says "publishing"
    before the tasks go out and "published" after. A repeat finds "published" and submits
    nothing; one that finds "publishing" (the caller died between the two) publishes again
    under the same task ids, which the workers run once. A cancelled request's marker stays,
    so a repeated submit does not resurrect it.
    """
    check_request(request)
    request = dict(request)
    targets = targets_of(request)
    override = request["spec"].get("queue") or None
    client = app.backend.client
    key = _submitted_key(request)
    first = client.set(key, PUBLISHING, nx=True, ex=SUBMITTED_TTL_S)
    if not first and client.get(key) != PUBLISHING:
        return chord_task_id(request)
    mark_current(app, request, current_ttl)
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
        queue=index_queue(request),
        priority=PRIORITY_INDEX,
        immutable=True,
    )
    chord(header, app=app)(callback)
    client.set(key, PUBLISHED, ex=SUBMITTED_TTL_S)
    _stop_listening(app, [target_task_id(request, t) for t in targets] + [chord_task_id(request)])
    return chord_task_id(request)


def index_queue(request: Mapping[str, Any]) -> str:
    """The index task's queue: the first target's."""
    return queue_for_target(targets_of(request)[0], request["spec"].get("queue") or None)


def cleanup_plan(request: Mapping[str, Any]) -> dict[str, list[str]]:
    """Queue -> the push-ledger labels (targets, and ``INDEX_LABEL``) whose manifests a
    cleanup on that queue deletes: each on the queue whose workers pushed them, so that a
    queue without a live worker cannot hold back the cleanup of another's pushes."""
    override = request["spec"].get("queue") or None
    plan: dict[str, list[str]] = {}
    for target in targets_of(request):
        plan.setdefault(queue_for_target(target, override), []).append(target)
    plan.setdefault(index_queue(request), []).append(INDEX_LABEL)
    return plan


def _stop_listening(app: Celery, task_ids: list[str]) -> None:
    """Publishing subscribes to each task's result channel (Redis pub/sub); the operator polls
    instead, so drop those subscriptions now rather than one per submit for the process's life."""
    consumer = getattr(app.backend, "result_consumer", None)
    if consumer is not None:
        for task_id in task_ids:
            consumer.cancel_for(task_id)


def is_submitted(app: Celery, request: Mapping[str, Any]) -> bool:
    """Whether the request's tasks were published (the marker says so)."""
    return bool(app.backend.client.get(_submitted_key(request)) == PUBLISHED)


PUSH_CONFIG_KEY = "cuvil:push-config:{chord_id}"


def store_push_config(app: Celery, request: Mapping[str, Any], docker_config: str) -> None:
    """The docker config of the request's ``pushSecret``, for the workers that push it (kept
    out of the task's arguments, which the result backend stores and logs may show)."""
    key = PUSH_CONFIG_KEY.format(chord_id=chord_task_id(request))
    app.backend.client.set(key, docker_config, ex=SUBMITTED_TTL_S)


def push_config(app: Celery, request: Mapping[str, Any]) -> str | None:
    data = app.backend.client.get(PUSH_CONFIG_KEY.format(chord_id=chord_task_id(request)))
    return data.decode() if isinstance(data, bytes) else data


def consumed_queues(app: Celery, timeout: float = 1.0) -> set[str]:
    """Queues some live worker consumes now (Celery's remote control: every worker answers
    from its main process, busy or not)."""
    replies = app.control.inspect(timeout=timeout).active_queues() or {}
    return {str(q["name"]) for queues in replies.values() for q in queues or []}


def cancel_compilation(app: Celery, request: Mapping[str, Any]) -> None:
    """Stop this request for good: it is no longer current (every worker that meets one of its
    tasks, now or after a redelivery, ends it without pushing), and its tasks are revoked
    (running ones are terminated at once; a push in flight finishes and is undone)."""
    release_current(app, request)
    targets = targets_of(request)
    ids = [target_task_id(request, t) for t in targets] + [chord_task_id(request)]
    app.control.revoke(ids, terminate=True, signal="SIGTERM")
    for task_id in ids:
        if app.backend.get_task_meta(task_id).get("status") not in ("SUCCESS", "FAILURE"):
            app.backend.mark_as_revoked(task_id, reason="cancelled")
    for queue, labels in cleanup_plan(request).items():
        app.send_task(TASK_CLEANUP, args=(dict(request), labels), queue=queue,
                      priority=PRIORITY_INDEX)  # fmt: skip


# Reading progress lives in its own module; its names stay importable from here.
from cuvil_worker.progress import (  # noqa: E402
    Progress,
    TargetProgress,
    read_progress,
)

__all__ = ["Progress", "TargetProgress", "read_progress"]

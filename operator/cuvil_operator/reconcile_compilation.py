"""The ModelCompilation flows behind main.py's thin handlers: submit, follow, cancel.

Each flow takes the object's parts as plain mappings, a queue (``CompileQueue`` or anything with
``submit``/``progress``/``cancel``), a ``notify(type, reason, message)`` for Kubernetes Events
and the time, and returns the status patch to write (``None``: nothing to write). They are
idempotent: a generation maps to one task id, and a handler that runs twice (operator restart,
retry after an API error) submits nothing new.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from cuvil_operator.compile_queue import build_request, queue_for_target, trace_id_of
from cuvil_operator.promotion import with_promotion
from cuvil_operator.push_secrets import PushSecretError
from cuvil_operator.spec_checks import check_spec
from cuvil_operator.stalls import apply_stall, find_stall
from cuvil_operator.status import (
    FAILED,
    build_invalid_status,
    build_progress_status,
    build_submitted_status,
    is_following,
    is_terminal,
    status_changed,
)
from cuvil_operator.tenancy import PushPolicy, check_push

Notify = Callable[[str, str, str], None]
NORMAL, WARNING = "Normal", "Warning"
RETRY_ANNOTATION = "cuvil.dev/retry"


class Queue(Protocol):
    def submit(self, request: Mapping[str, Any]) -> str: ...

    def progress(self, request: Mapping[str, Any]) -> dict[str, Any]: ...

    def cancel(self, request: Mapping[str, Any]) -> None: ...

    def is_submitted(self, request: Mapping[str, Any]) -> bool: ...

    def keep_current(self, request: Mapping[str, Any]) -> None: ...

    def idle_queues(self, queues: Iterable[str]) -> set[str]: ...

    def store_push_config(self, request: Mapping[str, Any], docker_config: str) -> None: ...


# (namespace, Secret name) -> the docker config JSON it holds; raises PushSecretError
ReadSecret = Callable[[str, str], str]


def _generation(meta: Mapping[str, Any]) -> int:
    return int(meta.get("generation") or 1)


def _attempt(status: Mapping[str, Any]) -> int:
    return int(status.get("attempt") or 0)


def reconcile_submit(
    meta: Mapping[str, Any],
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    queue: Queue,
    notify: Notify,
    now: str,
    old_spec: Mapping[str, Any] | None = None,
    policy: PushPolicy | None = None,
    read_secret: ReadSecret | None = None,
) -> dict[str, Any] | None:
    """Create, resume or spec update: check the spec and the push policy, then queue this
    generation's compile."""
    generation = _generation(meta)
    if status.get("observedGeneration") == generation and status.get("phase"):
        return None  # this generation was submitted (or refused) already; the timer follows it
    observed = status.get("observedGeneration")
    if observed and is_following(status):
        previous = build_request(meta, old_spec or spec, int(observed), _attempt(status))
        queue.cancel(previous)
        notify(
            NORMAL,
            "Superseded",
            f"generation {observed} ({status['taskId']}) cancelled:"
            f" generation {generation} replaces it",
        )

    def refuse(problems: list[Any], reason: str) -> dict[str, Any]:
        patch = build_invalid_status(status, generation, problems, now, reason=reason)
        notify(WARNING, reason, patch["message"])
        return patch

    problems = check_spec(spec)
    if problems:
        return refuse(problems, "InvalidSpec")
    refusals = check_push(policy or PushPolicy(), str(meta.get("namespace") or ""), spec)
    if refusals:
        return refuse(refusals, refusals[0].reason)
    request = build_request(meta, spec, generation)
    try:
        hand_over_push_secret(request, queue, read_secret)
    except PushSecretError as error:
        return refuse([error], "PushSecretNotFound")
    task_id = queue.submit(request)
    notify(NORMAL, "Submitted", f"generation {generation} queued as task {task_id}")
    trace_id = trace_id_of(request["traceparent"])
    submitted = build_submitted_status(status, generation, task_id, now, trace_id)
    return {**submitted, "targetCount": len(spec.get("targets") or [])}


def hand_over_push_secret(
    request: Mapping[str, Any], queue: Queue, read_secret: ReadSecret | None
) -> None:
    """The Secret ``spec.output.pushSecretRef`` names, read from the compilation's namespace
    and stored for the workers under this request (only its name travels in the request)."""
    secret = request.get("pushSecret")
    if not secret:
        return
    if read_secret is None:
        raise PushSecretError(f"Secret {secret}: this operator cannot read Secrets")
    namespace, name = str(secret).split("/", 1)
    queue.store_push_config(request, read_secret(namespace, name))


def reconcile_retry(
    meta: Mapping[str, Any],
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    queue: Queue,
    notify: Notify,
    now: str,
    read_secret: ReadSecret | None = None,
) -> dict[str, Any] | None:
    """``kubectl annotate mc NAME cuvil.dev/retry=<new value>``: queue a failed generation
    again as a new attempt (new task ids), without a spec change. Each value acts once
    (``status.retry`` remembers it); a running or succeeded compile, or a spec the operator
    refuses, is left as it is."""
    value = str((meta.get("annotations") or {}).get(RETRY_ANNOTATION) or "")
    if not value or status.get("retry") == value:
        return None
    generation = _generation(meta)
    if status.get("phase") != FAILED or status.get("observedGeneration") != generation:
        notify(
            NORMAL, "RetryIgnored", f"{RETRY_ANNOTATION}={value}: only a Failed compile is retried"
        )
        return {"retry": value}
    if check_spec(spec):
        notify(WARNING, "RetryIgnored", f"{RETRY_ANNOTATION}={value}: fix the spec instead")
        return {"retry": value}
    attempt = _attempt(status) + 1
    request = build_request(meta, spec, generation, attempt)
    try:
        hand_over_push_secret(request, queue, read_secret)
    except PushSecretError as error:
        notify(WARNING, "PushSecretNotFound", str(error))
        return {"retry": value, "message": str(error)}
    task_id = queue.submit(request)
    notify(NORMAL, "Retried", f"generation {generation} attempt {attempt} queued as task {task_id}")
    trace_id = trace_id_of(request["traceparent"])
    submitted = build_submitted_status(status, generation, task_id, now, trace_id)
    return {**submitted, "attempt": attempt, "retry": value}


def reconcile_progress(
    meta: Mapping[str, Any],
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    queue: Queue,
    notify: Notify,
    now: str,
    stall_after: float = 120.0,
    read_secret: ReadSecret | None = None,
) -> dict[str, Any] | None:
    """Timer: read the followed task's progress into status; an Event per phase change, a
    Warning per stall (``stalls``); a compile that timed out is cancelled.

    A followed compile whose submit marker is gone was lost by the broker (Redis restarted
    without its data: tasks, chord join and results with it): it is queued again under the
    same task ids, and whatever part of it still runs somewhere is not done twice. Each poll
    keeps the request current (its key expires once nothing follows it: ``contract``)."""
    if not is_following(status):
        return None
    generation = int(status.get("observedGeneration") or 0)
    if generation != _generation(meta):
        return None  # a newer spec is being submitted; the update handler takes over
    request = build_request(meta, spec, generation, _attempt(status))
    if not queue.is_submitted(request):
        try:
            hand_over_push_secret(request, queue, read_secret)
        except PushSecretError as error:
            notify(WARNING, "PushSecretNotFound", str(error))
        task_id = queue.submit(request)
        notify(WARNING, "Resubmitted", f"the broker had no record of {task_id}: queued again")
    else:
        queue.keep_current(request)
    progress = queue.progress(request)
    patch = build_progress_status(status, generation, progress, now)
    patch = _with_stall(spec, status, patch, progress, queue, generation, now, stall_after)
    patch = with_promotion(status, patch, generation, now)
    if patch.get("stalled") and patch["stalled"] != status.get("stalled"):
        notify(WARNING, str(patch["stalled"]), str(patch["message"]))
        if patch["phase"] == FAILED:
            queue.cancel(request)
            return patch  # the Warning said it
    if not status_changed(status, patch):
        return None
    if patch["phase"] != status.get("phase"):
        kind = WARNING if patch["phase"] == FAILED else NORMAL
        notify(kind, str(patch["phase"]), str(patch["message"]))
    return patch


def _with_stall(
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    patch: dict[str, Any],
    progress: Mapping[str, Any],
    queue: Queue,
    generation: int,
    now: str,
    stall_after: float,
) -> dict[str, Any]:
    """``patch`` with the stall the compile is in, and the first time a fault was seen."""
    faulty = any(p.get("fault") for p in (progress.get("targets") or {}).values())
    if faulty:
        patch["faultSince"] = status.get("faultSince") or now
    elif status.get("faultSince") and patch.get("phase") != "Pushing":
        patch["faultSince"] = None
    idle: dict[str, list[str]] = {}
    if patch.get("phase") == "Pending":
        waiting = {t: queue_for_target(t, spec.get("queue") or None) for t in spec["targets"]}
        for target, name in sorted(waiting.items()):
            if name in queue.idle_queues(waiting.values()):
                idle.setdefault(name, []).append(target)
    stall = find_stall(spec, {**status, **patch}, patch, progress, idle, now, stall_after)
    if stall is not None:
        return apply_stall(status, patch, stall, generation, now)
    if status.get("stalled"):
        patch["stalled"] = None
    return patch


def reconcile_delete(
    meta: Mapping[str, Any],
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    queue: Queue,
    notify: Notify,
) -> None:
    """Delete: cancel the generation in flight (harmless when nothing runs or it finished);
    kopf then releases the finalizer. The cancel is durable: a worker that meets one of its
    tasks later, or a redelivered one, ends it without pushing."""
    if check_spec(spec):
        return  # refused before anything was queued
    generation = int(status.get("observedGeneration") or _generation(meta))
    request = build_request(meta, spec, generation, _attempt(status))
    queue.cancel(request)
    if not is_terminal(status):
        task = status.get("taskId") or f"generation {generation}"
        notify(NORMAL, "Cancelled", f"{task} cancelled: the compilation is being deleted")

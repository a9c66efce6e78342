"""The Celery tasks: thin wrappers that sort errors into "fail now" and "retry later".

``cuvil.compile(request, target)``: one target (``target_pipeline``), acks late, its
packaged artifact kept in the work dir so a registry retry does not recompile.
``cuvil.push_index(request)``: the chord callback; reads every target's result by its task id
(so a redelivered target can never add a second entry), pushes the index under the tag.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Task
from celery.exceptions import Retry, SoftTimeLimitExceeded
from celery.result import AsyncResult

from cuvil_worker import telemetry
from cuvil_worker.app import app, config
from cuvil_worker.contract import (
    TASK_COMPILE,
    TASK_INDEX,
    check_request,
    chord_task_id,
    target_task_id,
    targets_of,
)
from cuvil_worker.errors import (
    CompileFailed,
    CompileTimeLimit,
    IndexIncomplete,
    InvalidSpec,
    RegistryFault,
)
from cuvil_worker.target_pipeline import (
    STATE_OF_STAGE,
    annotations_for,
    build_cached,
    forget_cached,
    publish,
    push_compilation_index,
)

log = logging.getLogger(__name__)


class StageReporter:
    """Publishes each pipeline stage as a custom task state; remembers the last one."""

    def __init__(self, task: Task, target: str | None) -> None:
        self.task, self.target, self.stage = task, target, "queued"

    def __call__(self, stage: str) -> None:
        self.stage = stage
        state = STATE_OF_STAGE.get(stage)
        if state is not None and self.task.request.id:
            meta = {"stage": stage, "target": self.target, "worker": self.task.request.hostname}
            self.task.update_state(state=state, meta=meta)


def _already_done(task: Task) -> Any:
    """A redelivered task whose first run stored its result (then died before acking)."""
    previous = AsyncResult(task.request.id, app=app)
    return previous.result if previous.state == "SUCCESS" else None


def _retry_registry(task: Task, error: Exception) -> Exception:
    retries = task.request.retries
    countdown = config.backoff(retries)
    log.warning("registry fault (try %d): %s; retrying in %.0fs", retries + 1, error, countdown)
    fault = RegistryFault(f"{type(error).__name__}: {error}")
    return task.retry(exc=fault, countdown=countdown, max_retries=config.push_retries)


def _annotations(request: dict[str, Any], trace_id: str | None) -> dict[str, str]:
    return annotations_for(f"{request['namespace']}/{request['name']}", trace_id)


def _fetcher(task_id: str) -> Callable[[str], Path]:
    """Pulls an ``oci`` source bundle into this task's scratch folder."""

    def fetch(ref: str) -> Path:
        from cuvil.frontend.source_bundle import fetch_source_bundle

        return fetch_source_bundle(ref, config.work_dir / "sources" / task_id)

    return fetch


@app.task(bind=True, name=TASK_COMPILE, acks_late=True)
def compile_target(self: Task, request: dict[str, Any], target: str) -> dict[str, Any]:
    check_request(request)
    done = _already_done(self)
    if done is not None:
        return dict(done)
    task_id = self.request.id or target_task_id(request, target)
    try:
        result = _compile_and_push(self, request, target, task_id)
    except Retry:
        raise  # the packaged artifact stays in the work dir for the next try
    except BaseException:
        _forget(task_id)
        raise
    _forget(task_id)
    return result


def _compile_and_push(
    task: Task, request: dict[str, Any], target: str, task_id: str
) -> dict[str, Any]:
    from cuvil.artifact import RegistryError

    with telemetry.continued(
        request.get("traceparent"), "cuvil.compile_target", target=target
    ) as span:
        on_stage = StageReporter(task, target)
        spec = request["spec"]
        try:
            packaged = build_cached(spec, target, config, on_stage, task_id, _fetcher(task_id))
            annotations = _annotations(request, telemetry.trace_id_of(span))
            result = publish(packaged, spec, target, on_stage, annotations)
        except RegistryError as error:
            if not error.retryable:
                raise CompileFailed(f"registry refused: {error}") from None
            raise _retry_registry(task, error) from None
        except SoftTimeLimitExceeded:
            raise CompileTimeLimit(
                f"{target}: time limit of {config.soft_time_limit:g}s exceeded "
                f"(stage {on_stage.stage}); raise CUVIL_TASK_TIME_LIMIT for bigger models"
            ) from None
        result["traceId"] = telemetry.trace_id_of(span)
    return result


def _forget(task_id: str) -> None:
    forget_cached(config, task_id)
    shutil.rmtree(config.work_dir / "sources" / task_id, ignore_errors=True)


def _target_results(request: dict[str, Any]) -> list[dict[str, Any]]:
    results = []
    for target in targets_of(request):
        found = AsyncResult(target_task_id(request, target), app=app)
        if found.state in ("FAILURE", "REVOKED"):
            raise CompileFailed(f"target {target} failed: {found.info}")
        if found.state != "SUCCESS":
            raise IndexIncomplete(f"target {target} is {found.state}")
        results.append(dict(found.result))
    return results


@app.task(bind=True, name=TASK_INDEX, acks_late=True, max_retries=None)
def push_index_task(self: Task, request: dict[str, Any]) -> dict[str, Any]:
    from cuvil.artifact import RegistryError

    check_request(request)
    done = _already_done(self)
    if done is not None:
        return dict(done)
    try:
        results = _target_results(request)
    except IndexIncomplete as error:  # the chord fired early (a redelivered header task)
        raise self.retry(exc=error, countdown=1.0, max_retries=300) from None
    output = request["spec"].get("output") or {}
    repository, tag = str(output.get("repository") or ""), str(output.get("tag") or "latest")
    if not repository:
        raise InvalidSpec("spec.output.repository is empty")
    with telemetry.continued(request.get("traceparent"), "cuvil.push_index") as span:
        StageReporter(self, None)("index")
        annotations = _annotations(request, telemetry.trace_id_of(span))
        try:
            index = push_compilation_index(f"{repository}:{tag}", results, annotations)
        except RegistryError as error:
            if not error.retryable:
                raise CompileFailed(f"registry refused the index: {error}") from None
            raise _retry_registry(self, error) from None
    return {
        "compilation": chord_task_id(request),
        "index": {"ref": index.ref, "digest": index.digest, "tag": tag, "size": index.size},
        "artifacts": [
            {k: r[k] for k in ("target", "ref", "digest", "size", "reportReferrer")}
            for r in results
        ],
        "report": {r["target"]: r["report"] for r in results},
        "traceId": telemetry.trace_id_of(span),
    }

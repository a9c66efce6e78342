"""The Celery tasks: thin wrappers that sort errors into "fail now" and "retry later".

``cuvil.compile(request, target)``: one target (``target_pipeline``), acks late, its
packaged artifact kept in the work dir so a registry retry does not recompile.
``cuvil.push_index(request)``: the chord callback; reads every target's result by its task id
(so a redelivered target can never add a second entry), pushes the index under the tag, and
deletes manifests of earlier attempts at a target that the index does not hold.

Both run only while their request is current (``cancellation``): a cancelled task returns
``{"cancelled": reason}`` and leaves nothing in the registry.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Task
from celery.exceptions import Retry, SoftTimeLimitExceeded
from celery.result import AsyncResult

from cuvil_worker import telemetry
from cuvil_worker.app import app, config
from cuvil_worker.cancellation import (
    Cancelled,
    Guard,
    PushLedger,
    registry_config_for,
    shielded,
    undo_push,
    undo_recorded,
)
from cuvil_worker.contract import (
    INDEX_LABEL,
    TASK_CLEANUP,
    TASK_COMPILE,
    TASK_INDEX,
    check_request,
    chord_task_id,
    not_current,
    target_task_id,
    targets_of,
)
from cuvil_worker.errors import (
    CompileFailed,
    CompileTimeLimit,
    IndexIncomplete,
    InvalidSpec,
    PushRefused,
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
    """Publishes each pipeline stage as a custom task state; remembers the last one. Each
    stage first checks that the request is still current (a cancel ends it there)."""

    def __init__(self, task: Task, target: str | None, guard: Guard) -> None:
        self.task, self.target, self.stage, self.guard = task, target, "queued", guard

    def __call__(self, stage: str) -> None:
        self.guard.check(f"at stage {stage}")
        self.stage = stage
        state = STATE_OF_STAGE.get(stage)
        if state is not None and self.task.request.id:
            meta = {"stage": stage, "target": self.target, "worker": self.task.request.hostname}
            self.task.update_state(state=state, meta=meta)


def _already_done(task: Task) -> Any:
    """A redelivered task whose first run stored its result (then died before acking). A
    stored cancel does not count: the request is current again (the operator queued it anew
    after the broker lost it), so the work is done now."""
    previous = AsyncResult(task.request.id, app=app)
    if previous.state != "SUCCESS" or "cancelled" in (previous.result or {}):
        return None
    return previous.result


def _retry_registry(task: Task, error: Exception) -> Exception:
    retries = task.request.retries
    countdown = config.backoff(retries)
    log.warning("registry fault (try %d): %s; retrying in %.0fs", retries + 1, error, countdown)
    fault = RegistryFault(f"{type(error).__name__}: {error}")
    return task.retry(exc=fault, countdown=countdown, max_retries=config.push_retries)


def _annotations(request: dict[str, Any], trace_id: str | None) -> dict[str, str]:
    return annotations_for(f"{request['namespace']}/{request['name']}", trace_id)


def _fetcher(task_id: str) -> Callable[[str], Path]:
    """Brings a source bundle into this task's scratch folder: an ``oci`` one pulled from
    its registry, a ``url`` one downloaded (the operator checked it against the allowlist)."""

    def fetch(ref: str) -> Path:
        from cuvil.frontend.sources import fetch_bundle

        folder = config.work_dir / "sources" / task_id
        shutil.rmtree(folder, ignore_errors=True)  # what a killed run of this task left
        return fetch_bundle(ref, folder)

    return fetch


def _cancelled(task: Task, error: Cancelled, target: str | None) -> dict[str, Any]:
    log.info("%s[%s]: %s", task.name, task.request.id, error)
    return {"target": target, "cancelled": str(error)}


@app.task(bind=True, name=TASK_COMPILE, acks_late=True)
def compile_target(self: Task, request: dict[str, Any], target: str) -> dict[str, Any]:
    check_request(request)
    guard, ledger = Guard(app, request), PushLedger(app, request)
    task_id = self.request.id or target_task_id(request, target)
    try:
        guard.check("before it started")
        done = _already_done(self)
        if done is not None:
            return dict(done)
        result = _compile_and_push(self, request, target, task_id, guard, ledger)
    except Retry:
        raise  # the packaged artifact stays in the work dir for the next try
    except Cancelled as error:
        _forget(task_id)
        # what an earlier try of this target pushed
        undo_recorded(ledger, target, registry_config_for(app, request, config.work_dir))
        return _cancelled(self, error, target)
    except BaseException:
        _forget(task_id)
        raise
    _forget(task_id)
    return result


CLAIM_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")  # DNS-1123, as the CRD says


def confine_source(spec: dict[str, Any]) -> None:
    """A PVC source names a volume folder under $CUVIL_VOLUMES_DIR: its claim must be a
    Kubernetes name (no ``/``, no ``..``), so it cannot point elsewhere on the worker; the
    path inside it is confined by the loader."""
    pvc = (spec.get("source") or {}).get("pvc")
    if isinstance(pvc, dict) and not CLAIM_NAME.match(str(pvc.get("claimName") or "")):
        raise InvalidSpec(f"spec.source.pvc.claimName {pvc.get('claimName')!r} is not a PVC name")


def _undo_unless_current(
    guard: Guard, ledger: PushLedger, target: str | None, credentials: Any, where: str
) -> None:
    """The re-check after a push, inside its shield: a cancel that came meanwhile has what
    was pushed deleted before a held terminate may end the process."""
    try:
        guard.check(where, push=True)
    except Cancelled:
        undo_recorded(ledger, target, credentials)
        raise


def benchmark_caveat(target: str, here: list[str]) -> str | None:
    """What the report must say when this worker's machine is not one the target is for
    (``here``: its own targets, best first): the figures were measured off-target."""
    if target in here:
        return None
    return (
        f"this worker is not a {target} machine (it is {', '.join(here) or 'unknown'}):"
        " the benchmark ran here, so its latency and speedup are not the target's"
    )


def _planned_ref(files: dict[str, bytes], repository: str, annotations: dict[str, str]) -> str:
    """The ref ``push_artifact`` will give these files (manifests are deterministic), known
    before the push so that the ledger records it first."""
    from cuvil.artifact.manifests import build_artifact_manifest, canonical_json, sha256_digest

    manifest, _ = build_artifact_manifest(files, annotations)
    return f"{repository}@{sha256_digest(canonical_json(manifest))}"


def _compile_and_push(
    task: Task,
    request: dict[str, Any],
    target: str,
    task_id: str,
    guard: Guard,
    ledger: PushLedger,
) -> dict[str, Any]:
    from cuvil.artifact import RegistryError

    with telemetry.continued(
        request.get("traceparent"), "cuvil.compile_target", target=target
    ) as span:
        on_stage = StageReporter(task, target, guard)
        spec = request["spec"]
        confine_source(spec)
        try:
            packaged = build_cached(spec, target, config, on_stage, task_id, _fetcher(task_id))
            from cuvil.artifact import probe_targets

            measured = packaged.report.get("benchmark", {}).get("measured", True)
            caveat = benchmark_caveat(target, probe_targets()) if measured else None
            if caveat:
                packaged.report.setdefault("notes", []).append(caveat)
            annotations = _annotations(request, telemetry.trace_id_of(span))
            repository = str((spec.get("output") or {}).get("repository") or "")
            with shielded():
                guard.check("before its push", push=True)
                if repository:
                    ledger.record(_planned_ref(packaged.files, repository, annotations), target)
                credentials = registry_config_for(app, request, config.work_dir)
                result = publish(
                    packaged, spec, target, on_stage, annotations, credentials, config.signer()
                )
                ledger.record(result["ref"], target)
                _undo_unless_current(guard, ledger, target, credentials, "after its push")
        except RegistryError as error:
            if not error.retryable:
                raise PushRefused(f"registry refused the push: {error}") from None
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
        if "cancelled" in found.result:
            raise Cancelled(found.result["cancelled"])
        results.append(dict(found.result))
    return results


@app.task(bind=True, name=TASK_INDEX, acks_late=True, max_retries=None)
def push_index_task(self: Task, request: dict[str, Any]) -> dict[str, Any]:
    check_request(request)
    guard, ledger = Guard(app, request), PushLedger(app, request)
    try:
        guard.check("before its index")
        done = _already_done(self)
        if done is not None:
            return dict(done)
        return _push_index(self, request, guard, ledger)
    except Cancelled as error:
        # every target's manifests, and the index if it was pushed
        undo_recorded(ledger, None, registry_config_for(app, request, config.work_dir))
        return _cancelled(self, error, None)


def _push_index(
    task: Task, request: dict[str, Any], guard: Guard, ledger: PushLedger
) -> dict[str, Any]:
    from cuvil.artifact import RegistryError

    try:
        results = _target_results(request)
    except IndexIncomplete as error:  # the chord fired early (a redelivered header task)
        raise task.retry(exc=error, countdown=1.0, max_retries=300) from None
    output = request["spec"].get("output") or {}
    repository, tag = str(output.get("repository") or ""), str(output.get("tag") or "latest")
    if not repository:
        raise InvalidSpec("spec.output.repository is empty")
    with telemetry.continued(request.get("traceparent"), "cuvil.push_index") as span:
        StageReporter(task, None, guard)("index")
        annotations = _annotations(request, telemetry.trace_id_of(span))
        try:
            with shielded():
                guard.check("before its index was tagged", push=True)
                credentials = registry_config_for(app, request, config.work_dir)
                index = push_compilation_index(
                    f"{repository}:{tag}", results, annotations, registry_config=credentials
                )
                ledger.record(index.ref, INDEX_LABEL)
                _undo_unless_current(guard, ledger, None, credentials, "after its index")
        except RegistryError as error:
            if not error.retryable:
                raise PushRefused(f"registry refused the index: {error}") from None
            raise _retry_registry(task, error) from None
    _delete_orphans(ledger, {index.ref} | {r["ref"] for r in results}, credentials)
    return {
        "compilation": chord_task_id(request),
        "index": {"ref": index.ref, "digest": index.digest, "tag": tag, "size": index.size},
        "artifacts": [_artifact_entry(r) for r in results],
        "report": {r["target"]: r["report"] for r in results},
        "traceId": telemetry.trace_id_of(span),
    }


def _artifact_entry(result: dict[str, Any]) -> dict[str, Any]:
    """One target in the index task's result: ``size`` is the artifact's (config and layers,
    what a pull downloads), ``manifestSize`` the manifest's own bytes."""
    entry = {k: result[k] for k in ("target", "ref", "digest", "reportReferrer")}
    entry["size"] = int(result["report"].get("size") or result["size"])
    entry["manifestSize"] = result["size"]
    return entry


def _delete_orphans(ledger: PushLedger, kept: set[str], registry_config: Any = None) -> None:
    """Manifests of killed attempts at a target (a redelivered compile pushes anew; its
    benchmark figures make another digest): nothing references them once the index is up."""
    from cuvil.artifact import RegistryError

    orphans = [ref for ref in ledger.refs() if ref not in kept]
    try:
        undo_push(orphans, registry_config)
    except RegistryError as error:  # left for the registry's garbage collection
        log.warning("could not delete orphaned manifests %s: %s", orphans, error)
        return
    ledger.drop(orphans)


@app.task(bind=True, name=TASK_CLEANUP, acks_late=True)
def cleanup_task(
    self: Task, request: dict[str, Any], labels: list[str] | None = None
) -> dict[str, Any]:
    """Sent by a cancel, one per queue the request used (``contract.cleanup_plan``): deletes
    what the cancelled request pushed under ``labels`` (its targets there, and the index;
    None: everything), for the case no task of it runs again to do so (a compile that
    finished its push before the cancel, whose index task the revoke then discards). A
    request that succeeded, or is current again, keeps everything."""
    check_request(request)
    if not_current(app, request) is None:
        return {"kept": "the request is current"}
    finished = AsyncResult(chord_task_id(request), app=app)
    if finished.state == "SUCCESS" and "cancelled" not in (finished.result or {}):
        return {"kept": "the compilation succeeded"}
    ledger = PushLedger(app, request)
    refs = ledger.refs(labels=labels)
    try:
        credentials = registry_config_for(app, request, config.work_dir)
    except CompileFailed:
        credentials = None
    deleted = undo_push(refs, credentials)
    ledger.drop(refs)
    log.info("%s: deleted %d of the %d manifest(s) recorded for cancelled %s", self.name,
             len(deleted), len(refs), chord_task_id(request))  # fmt: skip
    return {"deleted": deleted, "absent": [ref for ref in refs if ref not in deleted]}

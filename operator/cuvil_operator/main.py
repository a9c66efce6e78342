"""cuvil-operator: kopf handlers for ModelCompilation, and the entry point that runs them.

Only registration lives here; each handler hands over to a flow in ``reconcile_compilation``.
Settings come from the environment once (``OperatorConfig``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import kopf
from cuvil_worker.contract import RequestError
from kombu.exceptions import OperationalError
from redis.exceptions import RedisError

from cuvil_operator import push_secrets, serving, tracing, webhook
from cuvil_operator.compile_queue import CompileQueue, build_traceparent
from cuvil_operator.conditions import now_rfc3339
from cuvil_operator.config import OperatorConfig
from cuvil_operator.crd import GROUP, PLURAL, VERSION
from cuvil_operator.injection import MODEL_ANNOTATION
from cuvil_operator.promotion import MEASUREMENT_ANNOTATION, reconcile_measurement
from cuvil_operator.reconcile_compilation import (
    RETRY_ANNOTATION,
    Notify,
    ReadSecret,
    reconcile_delete,
    reconcile_progress,
    reconcile_retry,
    reconcile_submit,
)
from cuvil_operator.status import TERMINAL_PHASES, is_following

CONFIG = OperatorConfig.from_env()
RESOURCE = (GROUP, VERSION, PLURAL)
# kopf's own annotations live under this prefix; kopf leaves every annotation under it out of
# its diffs, so it must differ from the users' (cuvil.dev/retry is a user's).
KOPF_PREFIX = f"kopf.{GROUP}"


log = logging.getLogger("cuvil_operator")


def _notify(body: kopf.Body) -> Notify:
    """Post an Event and log the same line, naming the object and its generation: the
    operator's log says what changed and nothing else (``_QuietTimers``)."""
    meta = body.get("metadata", {})
    where = f"{meta.get('namespace')}/{meta.get('name')} generation {meta.get('generation')}"

    def notify(type_: str, reason: str, message: str) -> None:
        kopf.event(body, type=type_, reason=reason, message=message[:1024])
        level = logging.WARNING if type_ == "Warning" else logging.INFO
        log.log(level, "[%s] %s: %s", where, reason, message)

    return notify


class _QuietTimers(logging.Filter):
    """Drops kopf's line per successful progress poll or serving count (one per interval per
    object); what a poll changed is logged by ``_notify``."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith("Timer 'on_timer_") and message.endswith("succeeded."))


def _write_status(patch: kopf.Patch, status: dict[str, Any] | None) -> None:
    if status is not None:
        patch.setdefault("status", {}).update(status)


@contextlib.contextmanager
def _broker_errors() -> Iterator[None]:
    """Broker or result-backend trouble is temporary (retry soon); a request the contract
    refuses is permanent (retrying cannot help)."""
    try:
        yield
    except (OSError, OperationalError, RedisError) as e:
        raise kopf.TemporaryError(f"broker unavailable: {e}", delay=5) from e
    except RequestError as e:
        raise kopf.PermanentError(str(e)) from e


def _is_following(status: kopf.Status, **_: Any) -> bool:
    return is_following(status)


@kopf.on.startup()
def on_startup_operator(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # our own Events say what happened
    # A deletion waits for the progress timer to stop. Its sync handler may be mid-call in a
    # thread; kopf's default is to look again only after 60 s, which holds the finalizer (and
    # the object) that long. Timer calls take milliseconds: wait briefly, then re-check often.
    settings.background.instant_exit_timeout = 0.5
    settings.background.cancellation_polling = 1.0
    memo.queue = CompileQueue.from_config(CONFIG)
    memo.kube = push_secrets.connect(settings)
    if CONFIG.webhook is not None:
        settings.admission.server = webhook.build_server(CONFIG.webhook)
    tracing.setup()


def _trace_end(meta: kopf.Meta, status: Any, error: str | None) -> None:
    """The followed attempt ended: its trace's root span (``tracing``)."""
    if not status.get("taskId"):
        return
    generation, attempt = (
        int(status.get("observedGeneration") or 1),
        int(status.get("attempt") or 0),
    )
    now = now_rfc3339()
    attributes: dict[str, str | int] = {
        "k8s.namespace.name": str(meta.get("namespace") or ""),
        "cuvil.compilation": str(meta["name"]),
        "cuvil.generation": generation,
        "cuvil.task_id": str(status["taskId"]),
    }
    traceparent = build_traceparent(str(meta["uid"]), generation, attempt)
    tracing.export_root(traceparent, str(status.get("queuedAt") or now), now, attributes, error)


def _reader(memo: kopf.Memo) -> ReadSecret:
    return lambda namespace, name: push_secrets.read_docker_config(memo.kube, namespace, name)


@kopf.on.cleanup()
def on_cleanup_operator(memo: kopf.Memo, **_: Any) -> None:
    memo.queue.close()
    tracing.shutdown()


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
def on_create_modelcompilation(
    body: kopf.Body,
    meta: kopf.Meta,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    with _broker_errors():
        flow = reconcile_submit(
            meta, spec, status, memo.queue, _notify(body), now_rfc3339(),
            policy=CONFIG.push_policy, read_secret=_reader(memo),
        )  # fmt: skip
    _write_status(patch, flow)


@kopf.on.update(*RESOURCE, field="spec")
def on_update_modelcompilation(
    body: kopf.Body,
    meta: kopf.Meta,
    spec: kopf.Spec,
    status: kopf.Status,
    old: Any,
    patch: kopf.Patch,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    old_spec = old if isinstance(old, Mapping) else None  # field="spec": old is the old spec
    with _broker_errors():
        flow = reconcile_submit(
            meta, spec, status, memo.queue, _notify(body), now_rfc3339(), old_spec=old_spec,
            policy=CONFIG.push_policy, read_secret=_reader(memo),
        )  # fmt: skip
    if flow is not None and is_following(status):
        _trace_end(meta, status, "superseded by a newer generation")
    _write_status(patch, flow)


@kopf.on.update(*RESOURCE, field=("metadata", "annotations", RETRY_ANNOTATION))
def on_retry_modelcompilation(
    body: kopf.Body,
    meta: kopf.Meta,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    with _broker_errors():
        flow = reconcile_retry(
            meta, spec, status, memo.queue, _notify(body), now_rfc3339(), _reader(memo)
        )
    _write_status(patch, flow)


@kopf.on.update(*RESOURCE, field=("metadata", "annotations", MEASUREMENT_ANNOTATION))
def on_measurement_modelcompilation(
    body: kopf.Body, meta: kopf.Meta, status: kopf.Status, patch: kopf.Patch, **_: Any
) -> None:
    text = str((meta.get("annotations") or {}).get(MEASUREMENT_ANNOTATION) or "")
    if text:
        _write_status(patch, reconcile_measurement(status, text, _notify(body), now_rfc3339()))


@kopf.timer(*RESOURCE, interval=CONFIG.poll_interval, when=_is_following)
def on_timer_modelcompilation(
    body: kopf.Body,
    meta: kopf.Meta,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    with _broker_errors():
        flow = reconcile_progress(
            meta, spec, status, memo.queue, _notify(body), now_rfc3339(), CONFIG.stall_after,
            _reader(memo),
        )  # fmt: skip
    if flow is not None and flow.get("phase") in TERMINAL_PHASES:
        _trace_end(meta, {**status, **flow}, flow["message"] if flow["phase"] == "Failed" else None)
    _write_status(patch, flow)


@kopf.on.delete(*RESOURCE, retries=12)  # bounded: a dead broker must not pin objects
def on_delete_modelcompilation(
    body: kopf.Body,
    meta: kopf.Meta,
    spec: kopf.Spec,
    status: kopf.Status,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    with _broker_errors():
        reconcile_delete(meta, spec, status, memo.queue, _notify(body))
    if is_following(status):
        _trace_end(meta, status, "cancelled: the compilation was deleted")


def on_mutate_pod(
    body: kopf.Body, patch: kopf.Patch, warnings: list[str], memo: kopf.Memo, **_: Any
) -> None:
    webhook.mutate_pod(body, patch, warnings, CONFIG.injection, webhook.reader(memo.kube))


def served_pods(meta: kopf.Meta, status: kopf.Status, **_: Any) -> dict[Any, Any] | None:
    return serving.index_pod(meta, status)


def on_timer_serving(
    body: kopf.Body,
    meta: kopf.Meta,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    index: kopf.Index[Any, Any] = kwargs["served_pods"]  # kopf passes indices by name
    pods: list[Any] = list(index.get((meta.get("namespace"), meta["name"]), []))
    move = webhook.pod_mover(memo.kube)
    flow = serving.reconcile_serving(meta, status, pods, move, _notify(body), now_rfc3339())
    _write_status(patch, flow)


def register_webhook() -> None:
    """The pod webhook exists only where it is served: kopf refuses to start with admission
    handlers and no server. Pods naming no compilation (by label or annotation) pass as
    they are. With it, the labelled pods are indexed and counted into status.serving."""
    kopf.on.mutate("v1", "pods", id=webhook.WEBHOOK_ID, operations=["CREATE"])(on_mutate_pod)
    kopf.index("v1", "pods", labels={MODEL_ANNOTATION: kopf.PRESENT})(served_pods)
    kopf.timer(*RESOURCE, interval=max(1.0, CONFIG.poll_interval))(on_timer_serving)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``--help`` (the settings, from the environment) and ``--version``; nothing else runs."""
    from cuvil.entry_point import build_parser
    from cuvil_operator import config

    parser = build_parser(
        "cuvil-operator",
        "The Cuvil operator: turns ModelCompilations into Celery compile tasks and follows"
        " them (kopf; the cluster from KUBECONFIG or the in-cluster config).",
        config.__doc__,
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the operator (``cuvil-operator``); stops on SIGINT/SIGTERM."""
    parse_args(sys.argv[1:] if argv is None else argv)
    log_format = kopf.LogFormat.JSON if CONFIG.log_format == "json" else kopf.LogFormat.FULL
    kopf.configure(verbose=CONFIG.verbose, log_format=log_format, log_prefix=True)
    if not CONFIG.verbose:
        logging.getLogger("kopf.objects").addFilter(_QuietTimers())
    if CONFIG.webhook is not None:
        register_webhook()
    kopf.run(
        clusterwide=CONFIG.namespace is None,
        namespaces=[CONFIG.namespace] if CONFIG.namespace else [],
        standalone=CONFIG.peering is None,
        peering_name=CONFIG.peering,
        liveness_endpoint=CONFIG.health_endpoint,
    )


if __name__ == "__main__":
    main()

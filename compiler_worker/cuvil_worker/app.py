"""The worker's Celery app: the contract's app plus the worker's own settings, built once.

Importing this module reads the environment (``WorkerConfig.from_env``) and registers the tasks
(``cuvil_worker.tasks``). The operator never imports it; it uses ``cuvil_worker.contract``.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, signals

from cuvil_worker import telemetry
from cuvil_worker.config import WorkerConfig
from cuvil_worker.contract import create_app
from cuvil_worker.lease import BrokerLease, is_redis

log = logging.getLogger(__name__)
config = WorkerConfig.from_env()


def build_app(settings: WorkerConfig) -> Celery:
    celery_app = create_app(
        settings.broker_url,
        settings.result_backend,
        visibility_timeout=settings.visibility_timeout,
        restore_interval=settings.restore_interval,
    )
    celery_app.conf.update(
        task_time_limit=settings.task_time_limit,
        task_soft_time_limit=settings.soft_time_limit,
        worker_send_task_events=True,
        worker_hijack_root_logger=False,
    )
    return celery_app


app = build_app(config)


class _CancelIsNews(logging.Filter):
    """A chord whose header was cancelled (revoked) is a normal end, not an error: Celery's
    backend logs it with a traceback at ERROR; it is said once, at INFO, without one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and "TaskRevokedError" in record.getMessage():
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


for _name in ("celery.backends.redis", "celery.backends.base", "celery.app.trace"):
    logging.getLogger(_name).addFilter(_CancelIsNews())


@signals.worker_init.connect
def _on_worker_init(**_: Any) -> None:
    """Warm the compiler in the parent, before the pool forks, so that every task starts warm:
    the first ``torch.export`` in a process pays ~10 s of one-off set-up."""
    import cuvil.artifact.registry
    import cuvil.frontend.sources
    import cuvil.models.catalog
    import cuvil.pipeline  # noqa: F401

    if config.warm_up:
        import torch

        with torch.no_grad():
            torch.export.export(torch.nn.Linear(4, 4), (torch.zeros(2, 4),))


_lease: BrokerLease | None = None


@signals.worker_ready.connect
def _on_worker_ready(**_: Any) -> None:
    """Start keeping held messages fresh (main process, after the pool has forked)."""
    global _lease
    if is_redis(config.broker_url) and _lease is None:
        _lease = BrokerLease(config.broker_url, config.visibility_timeout)
        _lease.start()


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    if _lease is not None:
        _lease.stop()


@signals.worker_process_init.connect
def _on_process_init(**_: Any) -> None:
    """Per worker process (after the prefork fork): threads and tracing."""
    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
    telemetry.setup_tracing()


@signals.worker_process_shutdown.connect
def _on_process_shutdown(**_: Any) -> None:
    telemetry.shutdown()


import cuvil_worker.tasks  # noqa: E402,F401  (registers the tasks on ``app``)

"""The operator's side of the Celery contract (``cuvil_worker.contract``: celery/redis only).

Requests are built from the object by a pure function; one ``CompileQueue`` per operator
process holds the Celery app. Its calls block on Redis, so handlers calling them are sync
(kopf runs those in its thread pool).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping
from typing import Any

from celery import Celery
from cuvil_worker import contract

from cuvil_operator.config import OperatorConfig


def build_traceparent(uid: str, generation: int, attempt: int = 0) -> str:
    """A W3C traceparent derived from uid + generation (+ retry attempt): every task of one
    attempt (and any resubmit of it) lands in one trace, whose id the status records as
    ``traceId``."""
    key = f"{uid}/{generation}" + (f"/{attempt}" if attempt else "")
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f"00-{digest[:32]}-{digest[32:48]}-01"


def trace_id_of(traceparent: str) -> str:
    return traceparent.split("-")[1]


def build_request(
    meta: Mapping[str, Any],
    spec: Mapping[str, Any],
    generation: int | None = None,
    attempt: int = 0,
) -> dict[str, Any]:
    """The contract's request for one generation of the object (default: the current one);
    ``attempt`` counts ``cuvil.dev/retry`` resubmits of a failed generation."""
    uid = str(meta["uid"])
    number = int(generation if generation is not None else meta.get("generation", 1))
    request = {
        "uid": uid,
        "generation": number,
        "namespace": str(meta.get("namespace") or ""),
        "name": str(meta["name"]),
        "spec": dict(spec),
        "traceparent": build_traceparent(uid, number, attempt),
    }
    if attempt:
        request["attempt"] = attempt
    secret = ((spec.get("output") or {}).get("pushSecretRef") or {}).get("name")
    if secret:
        request["pushSecret"] = f"{request['namespace']}/{secret}"
    return request


def queue_for_target(target: str, override: str | None = None) -> str:
    return contract.queue_for_target(target, override)


def task_id_for(request: Mapping[str, Any]) -> str:
    return contract.chord_task_id(request)


class CompileQueue:
    """Submit, follow and cancel compilations through the contract. Which queues have a
    consumer is asked of the workers at most once per ``consumers_ttl`` seconds, for every
    compilation the operator follows."""

    def __init__(
        self,
        app: Celery,
        consumers_ttl: float = 10.0,
        current_ttl: float = contract.CURRENT_TTL_S,
    ) -> None:
        self.app = app
        self.consumers_ttl = consumers_ttl
        self.current_ttl = current_ttl
        self._consumed: tuple[float, set[str]] | None = None

    @classmethod
    def from_config(cls, config: OperatorConfig) -> CompileQueue:
        app = contract.create_app(config.broker_url, config.result_backend)
        return cls(
            app, consumers_ttl=min(10.0, config.stall_after / 2), current_ttl=config.current_ttl
        )

    def idle_queues(self, queues: Iterable[str]) -> set[str]:
        """Those of ``queues`` no live worker consumes."""
        now = time.monotonic()
        if self._consumed is None or now - self._consumed[0] > self.consumers_ttl:
            self._consumed = (now, contract.consumed_queues(self.app))
        return set(queues) - self._consumed[1]

    def submit(self, request: Mapping[str, Any]) -> str:
        return contract.submit_compilation(self.app, request, self.current_ttl)

    def keep_current(self, request: Mapping[str, Any]) -> None:
        """The followed request stays current for another ``current_ttl`` seconds."""
        contract.keep_current(self.app, request, self.current_ttl)

    def progress(self, request: Mapping[str, Any]) -> dict[str, Any]:
        return contract.read_progress(self.app, request).to_json()

    def store_push_config(self, request: Mapping[str, Any], docker_config: str) -> None:
        contract.store_push_config(self.app, request, docker_config)

    def is_submitted(self, request: Mapping[str, Any]) -> bool:
        return contract.is_submitted(self.app, request)

    def cancel(self, request: Mapping[str, Any]) -> None:
        contract.cancel_compilation(self.app, request)

    def close(self) -> None:
        self.app.close()

"""A compile runs and pushes only while its request is current (``contract.not_current``).

``Guard.check`` raises ``Cancelled`` once the operator has moved on (the object was deleted,
its spec edited, or a retry queued). Tasks call it when they start, at every pipeline stage,
before each push and before the index is tagged. A push is shielded from Celery's terminate
(``shielded``) and checked again after it lands: a cancel that arrived meanwhile has what was
pushed deleted (``undo_push``), so a cancelled or superseded request leaves no tag or manifest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from celery import Celery

from cuvil_worker.contract import chord_task_id, is_current_known, not_current

log = logging.getLogger(__name__)


class Cancelled(BaseException):
    """The request is no longer wanted. A BaseException, so that the pipeline's broad
    ``except Exception`` (which turns errors into permanent compile failures) lets it through."""


class Guard:
    """Checks one request against the current-key in the result backend.

    With no key at all (Redis lost its data) a compile goes on, but a push waits for the
    operator to queue the compile again (it rewrites the key within its poll interval); after
    ``wait_s`` without word the task ends as cancelled rather than push unasked."""

    def __init__(self, app: Celery, request: Mapping[str, Any], wait_s: float = 120.0) -> None:
        self.app, self.request, self.wait_s = app, request, wait_s

    def check(self, where: str, push: bool = False) -> None:
        reason = not_current(self.app, self.request)
        if reason is None and push and not is_current_known(self.app, self.request):
            reason = self._wait_for_word()
        if reason is not None:
            raise Cancelled(f"{chord_task_id(self.request)} cancelled {where}: {reason}")

    def _wait_for_word(self) -> str | None:
        deadline = time.monotonic() + self.wait_s
        log.warning("%s: Redis holds no record of it; waiting for the operator to re-drive it",
                    chord_task_id(self.request))  # fmt: skip
        while time.monotonic() < deadline:
            time.sleep(1.0)
            if is_current_known(self.app, self.request):
                return not_current(self.app, self.request)
        return f"no word from the operator for {self.wait_s:g}s after Redis lost its data"


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Hold a SIGTERM (Celery's revoke with terminate) until the block ends, so that a push
    and its re-check finish together; the signal is then re-raised with the previous handler.
    Only the main thread can install handlers; elsewhere the block runs unshielded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if held:
            os.kill(os.getpid(), signal.SIGTERM)


def undo_push(refs: list[str], registry_config: Any = None) -> list[str]:
    """Delete manifests pushed by digest (``host/repo@sha256:…``), each with its referrers
    and their referrers-tag index. Tags pointing at a deleted manifest go with it. Returns
    the refs that were in the registry: a ref is recorded before its push, so one whose push
    never happened (or was undone already) is absent, which is no error."""
    from cuvil.artifact import NotFoundError, RegistryConfig
    from cuvil.artifact.manifests import referrers_tag
    from cuvil.artifact.reference import parse_target_reference
    from cuvil.artifact.registry import RegistryStore
    from cuvil.artifact.store import open_store

    deleted = []
    for ref in refs:
        reference = parse_target_reference(ref)
        store = open_store(reference, RegistryConfig.coerce(registry_config))
        if not isinstance(store, RegistryStore):
            raise TypeError(f"{ref}: the worker pushes to registries only")
        digest = str(reference.digest)
        doomed = []
        with contextlib.suppress(NotFoundError):
            referrers_index = store.resolve(referrers_tag(digest))
            data, _ = store.get_manifest(referrers_index)
            doomed += [m["digest"] for m in json.loads(data).get("manifests", [])]
            doomed.append(referrers_index)
        for manifest in doomed:
            store.delete_manifest(manifest)
        if store.delete_manifest(digest):
            deleted.append(ref)
            log.info("deleted %s and %d referrer manifest(s)", ref, len(doomed))
        else:
            log.info("%s is not in the registry (never pushed, or deleted already)", ref)
    return deleted


class PushLedger:
    """Every manifest a request pushes, recorded before it is pushed (a Redis hash
    ``cuvil:pushed:<chord id>``: ref -> target). What a killed or cancelled attempt left in
    the registry is found here: the index task deletes what its index does not hold, and a
    cancelled task deletes what its target pushed."""

    TTL_S = 30 * 24 * 3600

    def __init__(self, app: Celery, request: Mapping[str, Any]) -> None:
        self.client = app.backend.client
        self.key = f"cuvil:pushed:{chord_task_id(request)}"

    def record(self, ref: str, target: str) -> None:
        self.client.hset(self.key, ref, target)
        self.client.expire(self.key, self.TTL_S)

    def refs(self, target: str | None = None, labels: list[str] | None = None) -> list[str]:
        """The recorded refs: all, those of one ``target``, or those under any of ``labels``."""
        wanted = None if target is None else {target}
        if labels is not None:
            wanted = set(labels) | (wanted or set())
        found = {_text(k): _text(v) for k, v in self.client.hgetall(self.key).items()}
        return sorted(ref for ref, t in found.items() if wanted is None or t in wanted)

    def drop(self, refs: list[str]) -> None:
        if refs:
            self.client.hdel(self.key, *refs)


def registry_config_for(app: Celery, request: Mapping[str, Any], work_dir: Any) -> Any:
    """The registry settings a request pushes with: the worker's own (None), or with the
    docker config of the request's ``pushSecret`` (written 0600 under the work dir, never
    logged). A request naming a secret whose config is gone is refused, never pushed with
    the worker's credential."""
    import dataclasses
    from pathlib import Path

    from cuvil.artifact import RegistryConfig
    from cuvil_worker.contract import push_config
    from cuvil_worker.errors import PushRefused

    secret = request.get("pushSecret")
    if not secret:
        return None
    text = push_config(app, request)
    if text is None:
        raise PushRefused(f"the docker config of Secret {secret} was not handed over")
    folder = Path(work_dir) / "credentials"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"{chord_task_id(request)}.json"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(text)
    return dataclasses.replace(RegistryConfig.from_env(), docker_config=path)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def undo_recorded(
    ledger: PushLedger, target: str | None = None, registry_config: Any = None
) -> None:
    """Delete what the ledger holds (for one target, or all) and forget it."""
    refs = ledger.refs(target)
    undo_push(refs, registry_config)
    ledger.drop(refs)

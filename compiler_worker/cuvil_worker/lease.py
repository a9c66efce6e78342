"""Keeps the broker messages a worker holds fresh, so a short visibility timeout is safe.

With ``acks_late`` the Redis transport keeps each delivered message in ``unacked`` until it is
acknowledged, indexed by delivery time in ``unacked_index``; any worker re-queues entries older
than the visibility timeout. That is what brings back the task of a worker killed with
``kill -9`` — and, left alone, it would also hand a compile that merely runs longer than the
timeout (or a retry waiting for its countdown) to a second worker.

``BrokerLease`` runs in the worker's main process (the Celery consumer, which holds the
messages and acks them): every quarter of the timeout it re-stamps the entry of every request
the worker holds — reserved, running or waiting for a countdown — from delivery to ack
(``ZADD XX``: an entry already acknowledged is never re-created). A dead worker stops stamping,
and its messages come back one visibility timeout later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import redis

log = logging.getLogger(__name__)
UNACKED_INDEX_KEY = "unacked_index"  # kombu.transport.redis.Channel.unacked_index_key


def held_delivery_tags() -> list[str]:
    """Delivery tags of every request this worker process holds (Celery's worker state)."""
    from celery.worker import state

    for _ in range(3):  # the consumer thread may change the dict while we copy it
        try:
            requests = list(state.requests.values())
            break
        except RuntimeError:
            continue
    else:
        return []
    tags = []
    for request in requests:
        message = getattr(request, "message", None)
        tag = getattr(message, "delivery_tag", None)
        if isinstance(tag, str) and tag:
            tags.append(tag)
    return tags


class BrokerLease:
    def __init__(
        self,
        broker_url: str,
        visibility_timeout: float,
        held: Callable[[], Iterable[str]] = held_delivery_tags,
    ) -> None:
        self.client = redis.Redis.from_url(broker_url, socket_timeout=5)
        self.interval = max(0.2, visibility_timeout / 4)
        self.held = held
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def renew(self) -> int:
        tags = list(self.held())
        if tags:
            now = time.time()
            self.client.zadd(UNACKED_INDEX_KEY, dict.fromkeys(tags, now), xx=True)
        return len(tags)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.renew()
            except redis.RedisError as error:  # the consumer's own reconnects handle outages
                log.warning("could not renew message leases: %s", error)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cuvil-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.client.close()


def is_redis(broker_url: str) -> bool:
    return broker_url.startswith(("redis://", "rediss://"))

"""Keeps a running task's broker message fresh, so a short visibility timeout is safe.

With ``acks_late`` the Redis transport keeps each delivered message in ``unacked`` until the task
ends, indexed by delivery time in ``unacked_index``; any worker re-queues entries older than the
visibility timeout. That is what brings back the task of a worker killed with ``kill -9`` — and,
left alone, it would also hand a compile that merely runs longer than the timeout to a second
worker. While a task runs, this lease re-stamps its entry every third of the timeout
(``ZADD XX``: an entry already acknowledged is never re-created). A dead worker stops stamping,
and its task comes back one visibility timeout later.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import redis

log = logging.getLogger(__name__)
UNACKED_INDEX_KEY = "unacked_index"  # kombu.transport.redis.Channel.unacked_index_key


@contextlib.contextmanager
def message_lease(
    broker_url: str, delivery_tag: str | None, visibility_timeout: float
) -> Iterator[None]:
    if not delivery_tag or not broker_url.startswith(("redis://", "rediss://")):
        yield
        return
    stop = threading.Event()
    client = redis.Redis.from_url(broker_url, socket_timeout=5)

    def renew() -> None:
        while not stop.wait(visibility_timeout / 3):
            try:
                client.zadd(UNACKED_INDEX_KEY, {delivery_tag: time.time()}, xx=True)
            except redis.RedisError as error:  # the broker's own reconnects handle outages
                log.warning("could not renew the lease of %s: %s", delivery_tag, error)

    thread = threading.Thread(target=renew, name=f"lease-{delivery_tag}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        client.close()

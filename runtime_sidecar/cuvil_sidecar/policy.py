"""Per-call policies: checks the sidecar runs before every gRPC call and REST request alike.

A policy is an object with ``check(call)`` that raises a ``SidecarError`` to refuse the call
(its status goes to the client: UNAUTHENTICATED / 401, PERMISSION_DENIED / 403, ...). It sees a
``Call``: the protocol, the method's name, the headers or metadata (names in lower case) and
the peer's host. ``Policies`` runs them in order; with none configured the servers skip the
check and read no metadata at all.

Built in: ``BearerTokens`` (``CUVIL_AUTH_TOKENS_FILE``), tokens from a mounted secret file,
one a line, re-read when the file changes so a rotated secret applies without a restart;
health and readiness checks are exempt unless ``CUVIL_AUTH_HEALTH=required`` (kubelet probes
carry no token). ``RateLimit`` (``CUVIL_RATE_LIMIT``): a token bucket per client (its bearer
token when it sends one, else its host), refusing past the rate RESOURCE_EXHAUSTED / 429 with
the seconds until the next call would pass. ``is_local_peer`` decides what counts as a client on
this host (for shared memory registration).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cuvil_sidecar.config import SidecarConfig
from cuvil_sidecar.errors import RateLimited, Unauthenticated

log = logging.getLogger("cuvil_sidecar.policy")

# The calls that only ask whether the server or a model is up: probes send no credentials.
HEALTH_METHODS = frozenset(
    {"ServerLive", "ServerReady", "ModelReady", "live", "ready", "model_ready"}
)


@dataclass(frozen=True)
class Call:
    protocol: str  # "grpc" or "http"
    method: str  # the RPC's name (ModelInfer), or the REST route's (infer)
    headers: Mapping[str, str]  # gRPC metadata or HTTP headers, names in lower case
    peer: str  # the client's host ("127.0.0.1", "::1"), "unix" for a Unix socket, "" unknown

    @property
    def is_health(self) -> bool:
        return self.method in HEALTH_METHODS


class Policy(Protocol):
    def check(self, call: Call) -> None:
        """Return to let the call through; raise a ``SidecarError`` to refuse it."""


class Policies:
    def __init__(self, policies: Sequence[Policy] = ()) -> None:
        self.policies = tuple(policies)

    @property
    def active(self) -> bool:
        return bool(self.policies)

    def check(self, call: Call) -> None:
        for policy in self.policies:
            policy.check(call)

    @property
    def authenticates(self) -> bool:
        return any(isinstance(policy, BearerTokens) for policy in self.policies)


class BearerTokens:
    def __init__(self, path: Path, *, health_exempt: bool = True) -> None:
        self.path = path
        self.health_exempt = health_exempt
        self._stamp: tuple[int, int] | None = None
        self._tokens: tuple[bytes, ...] = ()
        self._load()  # a file that does not load stops the start, not the first call

    def check(self, call: Call) -> None:
        if self.health_exempt and call.is_health:
            return
        scheme, _, token = call.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated(f"{call.method} needs an `authorization: Bearer <token>` header")
        given = token.strip().encode()
        # every token compared in full, so the time taken says nothing about which one is close
        matched = [hmac.compare_digest(given, known) for known in self._current()]
        if not any(matched):
            raise Unauthenticated(f"{call.method}: the bearer token is not valid here")

    def _current(self) -> tuple[bytes, ...]:
        try:
            status = os.stat(self.path)
        except OSError as error:
            log.error(
                "cannot read the tokens file %s (%s): keeping the tokens read before",
                self.path,
                error,
            )
            return self._tokens
        if (status.st_mtime_ns, status.st_size) != self._stamp:
            self._load()
        return self._tokens

    def _load(self) -> None:
        status = os.stat(self.path)
        lines = self.path.read_text().splitlines()
        self._tokens = tuple(line.strip().encode() for line in lines if line.strip())
        self._stamp = (status.st_mtime_ns, status.st_size)
        if not self._tokens:
            log.warning("the tokens file %s holds no token: every call will be refused", self.path)


class RateLimit:
    """At most ``rate`` calls a second per client, in bursts of up to ``burst``; health checks
    are not counted. At most ``MAX_CLIENTS`` clients are tracked (the least recently seen goes
    first), so that many clients cannot make the table grow without bound."""

    MAX_CLIENTS = 10_000

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = max(1, burst)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, when
        self._lock = threading.Lock()

    def check(self, call: Call) -> None:
        if call.is_health:
            return
        scheme, _, token = call.headers.get("authorization", "").partition(" ")
        client = f"token:{token.strip()}" if scheme.lower() == "bearer" else f"host:{call.peer}"
        now = time.monotonic()
        with self._lock:
            tokens, seen = self._buckets.pop(client, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - seen) * self.rate)
            allowed = tokens >= 1.0
            self._buckets[client] = (tokens - 1.0 if allowed else tokens, now)
            while len(self._buckets) > self.MAX_CLIENTS:
                self._buckets.popitem(last=False)
        if not allowed:
            retry_after_s = (1.0 - tokens) / self.rate
            raise RateLimited(
                f"{call.method}: more than {self.rate:g} calls a second from this client; "
                f"retry after {retry_after_s:.3f} s",
                retry_after_s,
            )


def policies_from_config(config: SidecarConfig) -> Policies:
    """Authentication first (an unauthenticated call costs no rate), then the rate limit."""
    policies: list[Policy] = []
    if config.auth_tokens_file is not None:
        policies.append(BearerTokens(config.auth_tokens_file, health_exempt=not config.auth_health))
    if config.rate_limit > 0:
        policies.append(RateLimit(config.rate_limit, config.rate_burst or int(config.rate_limit)))
    return Policies(policies)


def grpc_peer_host(peer: str) -> str:
    """grpc's peer name (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:/path``) -> the
    host (``127.0.0.1``, ``::1``, ``unix``)."""
    kind, _, address = peer.partition(":")
    if kind == "unix":
        return "unix"
    if kind == "ipv6":
        return address.rpartition("]")[0].lstrip("[")
    if kind == "ipv4":
        return address.rpartition(":")[0]
    return ""


def is_local_peer(host: str) -> bool:
    """A client on this host: a Unix socket or a loopback address (IPv4-mapped ones too)."""
    if host == "unix":
        return True
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback

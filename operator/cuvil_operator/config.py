"""Operator settings, read from the environment once at start-up (see docs and the chart).

| variable | default | meaning |
|---|---|---|
| ``CUVIL_BROKER_URL`` | ``redis://127.0.0.1:6379/0`` | Celery broker (shared with the workers) |
| ``CUVIL_RESULT_BACKEND`` | ``redis://127.0.0.1:6379/1`` | Celery results (progress is read here) |
| ``CUVIL_OPERATOR_POLL_INTERVAL`` | ``2`` | seconds between progress reads of a running compile |
| ``CUVIL_OPERATOR_NAMESPACE`` | (all) | watch one namespace instead of the whole cluster |
| ``CUVIL_OPERATOR_HEALTH`` | (off) | liveness endpoint, e.g. ``http://0.0.0.0:8080/healthz`` |
| ``CUVIL_OPERATOR_PEERING`` | (standalone) | a KopfPeering name, for several replicas |
| ``CUVIL_OPERATOR_VERBOSE`` | ``0`` | ``1``: log every handler call |
| ``CUVIL_OPERATOR_LOG_FORMAT`` | ``text`` | ``text`` (timestamp, level, object) or ``json`` |
| ``CUVIL_OPERATOR_PUSH_POLICY`` | (none) | JSON: repositories per namespace, shared credential |
| ``CUVIL_OPERATOR_STALL_SECONDS`` | ``120`` | a queue with no worker, a registry fault: Warning |
| ``CUVIL_OPERATOR_CURRENT_TTL`` | ``86400`` | how long a current-key outlives the last poll |
| ``CUVIL_WEBHOOK_LISTEN`` | (off) | serve the sidecar-injection webhook, e.g. ``0.0.0.0:9443`` |
| ``CUVIL_WEBHOOK_CERT_DIR`` | ``/etc/cuvil/webhook`` | its ``tls.crt`` and ``tls.key`` |
| ``CUVIL_INJECT_*`` | | what injected sidecars get (``injection.InjectionSettings``) |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from cuvil_operator.injection import InjectionSettings
from cuvil_operator.tenancy import PushPolicy
from cuvil_operator.webhook import WebhookSettings

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_RESULT_BACKEND = "redis://127.0.0.1:6379/1"


@dataclass(frozen=True)
class OperatorConfig:
    broker_url: str = DEFAULT_BROKER_URL
    result_backend: str = DEFAULT_RESULT_BACKEND
    poll_interval: float = 2.0
    namespace: str | None = None
    health_endpoint: str | None = None
    peering: str | None = None
    verbose: bool = False
    stall_after: float = 120.0
    log_format: str = "text"
    push_policy: PushPolicy = field(default_factory=PushPolicy)
    # The current-key of a followed compile is refreshed every poll; it outlives the last one
    # by this long (an operator outage must stay shorter, or in-flight pushes are given up).
    current_ttl: float = 86400.0
    webhook: WebhookSettings | None = None
    injection: InjectionSettings = field(default_factory=InjectionSettings)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        interval = float(env.get("CUVIL_OPERATOR_POLL_INTERVAL", "2"))
        if interval <= 0:
            raise ValueError("CUVIL_OPERATOR_POLL_INTERVAL must be positive")
        current_ttl = float(env.get("CUVIL_OPERATOR_CURRENT_TTL", "86400"))
        if current_ttl < 10 * interval:
            raise ValueError("CUVIL_OPERATOR_CURRENT_TTL must be at least 10 poll intervals")
        return cls(
            broker_url=env.get("CUVIL_BROKER_URL") or DEFAULT_BROKER_URL,
            result_backend=env.get("CUVIL_RESULT_BACKEND") or DEFAULT_RESULT_BACKEND,
            poll_interval=interval,
            namespace=env.get("CUVIL_OPERATOR_NAMESPACE") or None,
            health_endpoint=env.get("CUVIL_OPERATOR_HEALTH") or None,
            peering=env.get("CUVIL_OPERATOR_PEERING") or None,
            verbose=env.get("CUVIL_OPERATOR_VERBOSE", "0").lower() in ("1", "true", "yes"),
            stall_after=float(env.get("CUVIL_OPERATOR_STALL_SECONDS", "120")),
            log_format=env.get("CUVIL_OPERATOR_LOG_FORMAT", "text").lower(),
            push_policy=PushPolicy.from_json(env.get("CUVIL_OPERATOR_PUSH_POLICY")),
            current_ttl=current_ttl,
            webhook=WebhookSettings.from_env(env),
            injection=InjectionSettings.from_env(env),
        )

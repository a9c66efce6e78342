"""Which repositories a namespace may push to, and whether it may use the workers' shared
credential: the chart's ``operator.pushPolicy``, handed over as JSON in
``CUVIL_OPERATOR_PUSH_POLICY``::

    {"repositories": {"team-a": ["registry.example.com/team-a/"],
                      "*": ["registry.example.com/shared/"]},
     "sharedCredentials": ["team-a"]}

``repositories``: namespace (or ``*`` for every namespace) -> repository prefixes; a prefix
ending in ``/`` admits what lies under it, any other names one repository. No entry for a
namespace and none for ``*``: that namespace may push anywhere. ``sharedCredentials``: the
namespaces (``*``: all) whose compilations may push without ``spec.output.pushSecretRef``,
with the workers' own credential; absent, every namespace may.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Refusal:
    reason: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass(frozen=True)
class PushPolicy:
    repositories: Mapping[str, Sequence[str]] = field(default_factory=dict)
    shared_credentials: Sequence[str] | None = None

    @classmethod
    def from_json(cls, text: str | None) -> PushPolicy:
        if not text:
            return cls()
        data = json.loads(text)
        if not isinstance(data, Mapping):
            raise ValueError("CUVIL_OPERATOR_PUSH_POLICY must be a JSON object")
        repositories = {
            str(k): [str(p) for p in v] for k, v in (data.get("repositories") or {}).items()
        }
        shared = data.get("sharedCredentials")
        return cls(repositories, None if shared is None else [str(n) for n in shared])

    def allowed_prefixes(self, namespace: str) -> list[str] | None:
        """The prefixes ``namespace`` may push to; None: anywhere."""
        if namespace not in self.repositories and "*" not in self.repositories:
            return None
        return [*self.repositories.get(namespace, []), *self.repositories.get("*", [])]

    def may_use_shared_credential(self, namespace: str) -> bool:
        shared = self.shared_credentials
        return shared is None or "*" in shared or namespace in shared


def _admits(prefix: str, repository: str) -> bool:
    return repository.startswith(prefix) if prefix.endswith("/") else repository == prefix


def check_push(policy: PushPolicy, namespace: str, spec: Mapping[str, Any]) -> list[Refusal]:
    """What the policy refuses about this compilation's push (empty: nothing)."""
    output = spec.get("output") or {}
    repository = str(output.get("repository") or "")
    refusals = []
    prefixes = policy.allowed_prefixes(namespace)
    if prefixes is not None and not any(_admits(p, repository) for p in prefixes):
        allowed = ", ".join(prefixes) or "none"
        refusals.append(Refusal("RepositoryNotAllowed", "spec.output.repository",
                                f"namespace {namespace} may not push to {repository}"
                                f" (allowed: {allowed})"))  # fmt: skip
    if not output.get("pushSecretRef") and not policy.may_use_shared_credential(namespace):
        refusals.append(Refusal("PushSecretRequired", "spec.output.pushSecretRef",
                                f"namespace {namespace} must name its own push secret"
                                " (the shared credential is not allowed here)"))  # fmt: skip
    return refusals

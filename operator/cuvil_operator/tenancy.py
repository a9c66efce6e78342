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
with the workers' own credential; absent, every namespace may. ``sources``: namespace (or
``*``) -> the prefixes ``spec.source.oci.ref`` may start with (workers pull those with their
own credential); no entry: any. ``urls``: namespace (or ``*``) -> the URL prefixes
``spec.source.url`` may start with (``https://host[:port]/path/`` admits what lies under it,
any other names one URL; scheme, host and port must match exactly); no entry: no URL at all,
since a worker downloading what a compilation names reaches whatever its network does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


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
    sources: Mapping[str, Sequence[str]] = field(default_factory=dict)
    urls: Mapping[str, Sequence[str]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str | None) -> PushPolicy:
        if not text:
            return cls()
        data = json.loads(text)
        if not isinstance(data, Mapping):
            raise ValueError("CUVIL_OPERATOR_PUSH_POLICY must be a JSON object")
        shared = data.get("sharedCredentials")
        shared_list = None if shared is None else [str(n) for n in shared]
        return cls(
            _prefixes(data.get("repositories")),
            shared_list,
            _prefixes(data.get("sources")),
            _prefixes(data.get("urls")),
        )

    def allowed_prefixes(self, namespace: str) -> list[str] | None:
        """The prefixes ``namespace`` may push to; None: anywhere."""
        return _for(self.repositories, namespace)

    def allowed_sources(self, namespace: str) -> list[str] | None:
        """The prefixes ``namespace``'s OCI sources may come from; None: anywhere."""
        return _for(self.sources, namespace)

    def allowed_urls(self, namespace: str) -> list[str]:
        """The URL prefixes ``namespace``'s URL sources may start with (empty: none)."""
        return _for(self.urls, namespace) or []

    def may_use_shared_credential(self, namespace: str) -> bool:
        shared = self.shared_credentials
        return shared is None or "*" in shared or namespace in shared


def _prefixes(value: Any) -> dict[str, list[str]]:
    return {str(k): [str(p) for p in v] for k, v in (value or {}).items()}


def _for(table: Mapping[str, Sequence[str]], namespace: str) -> list[str] | None:
    if namespace not in table and "*" not in table:
        return None
    return [*table.get(namespace, []), *table.get("*", [])]


def _admits(prefix: str, repository: str) -> bool:
    return repository.startswith(prefix) if prefix.endswith("/") else repository == prefix


def _admits_url(prefix: str, url: str) -> bool:
    """Scheme, host and port equal; the path under a prefix ending in ``/``, else the same URL.
    (``spec_checks`` already refused URLs with credentials or ``.``/``..`` segments.)"""
    allowed, given = urlsplit(prefix), urlsplit(url)
    if (allowed.scheme.lower(), allowed.netloc.lower()) != (
        given.scheme.lower(),
        given.netloc.lower(),
    ):
        return False
    if allowed.path.endswith("/"):
        return given.path.startswith(allowed.path)
    return (given.path, given.query) == (allowed.path, allowed.query)


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
    source = str(((spec.get("source") or {}).get("oci") or {}).get("ref") or "")
    sources = policy.allowed_sources(namespace)
    if source and sources is not None and not any(source.startswith(p) for p in sources):
        refusals.append(Refusal("SourceNotAllowed", "spec.source.oci.ref",
                                f"namespace {namespace} may not compile from {source}"
                                f" (allowed: {', '.join(sources) or 'none'})"))  # fmt: skip
    url = str((spec.get("source") or {}).get("url") or "")
    urls = policy.allowed_urls(namespace)
    if url and not any(_admits_url(p, url) for p in urls):
        refusals.append(Refusal("SourceNotAllowed", "spec.source.url",
                                f"namespace {namespace} may not compile from {url}"
                                f" (allowed: {', '.join(urls) or 'no URL'})"))  # fmt: skip
    if not output.get("pushSecretRef") and not policy.may_use_shared_credential(namespace):
        refusals.append(Refusal("PushSecretRequired", "spec.output.pushSecretRef",
                                f"namespace {namespace} must name its own push secret"
                                " (the shared credential is not allowed here)"))  # fmt: skip
    return refusals

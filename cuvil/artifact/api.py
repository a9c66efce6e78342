"""Public OCI functions (signatures fixed; see the package docstring). Implementation follows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cuvil.artifact.oci_types import PushResult, Referrer
from cuvil.artifact.registry_config import RegistryConfig

ConfigArg = RegistryConfig | str | Path | None


def push_artifact(
    source: Any,
    ref: str,
    *,
    registry_config: ConfigArg = None,
    annotations: Mapping[str, str] | None = None,
) -> PushResult:
    raise NotImplementedError


def push_index(
    ref: str,
    entries: Sequence[PushResult],
    *,
    registry_config: ConfigArg = None,
    annotations: Mapping[str, str] | None = None,
) -> PushResult:
    raise NotImplementedError


def attach_referrer(
    subject: str,
    data: bytes,
    *,
    media_type: str,
    artifact_type: str,
    annotations: Mapping[str, str] | None = None,
    registry_config: ConfigArg = None,
) -> str:
    raise NotImplementedError


def list_referrers(
    subject: str, *, artifact_type: str | None = None, registry_config: ConfigArg = None
) -> list[Referrer]:
    raise NotImplementedError


def fetch_referrer(subject: str, digest: str, *, registry_config: ConfigArg = None) -> bytes:
    raise NotImplementedError


def resolve_model(
    reference: str,
    *,
    cache_dir: str | Path | None = None,
    registry_config: ConfigArg = None,
    target: str | None = None,
) -> Path:
    raise NotImplementedError


def resolve_digest(reference: str, *, registry_config: ConfigArg = None) -> str:
    raise NotImplementedError


def pull_artifact(
    reference: str,
    output: str | Path,
    *,
    registry_config: ConfigArg = None,
    target: str | None = None,
    cache_dir: str | Path | None = None,
) -> Path:
    raise NotImplementedError


def describe_reference(reference: str, *, registry_config: ConfigArg = None) -> dict[str, Any]:
    raise NotImplementedError

"""The storage interface that push, pull and referrers are written against.

Two implementations: ``RegistryStore`` (an OCI distribution registry, through oras-py) and
``LayoutStore`` (a local OCI image layout directory). ``open_store`` picks one for a reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from cuvil.artifact.manifests import Blob
from cuvil.artifact.reference import Reference
from cuvil.artifact.registry_config import RegistryConfig


class Store(Protocol):
    """One repository of a registry, or one layout directory."""

    location: Reference

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        """Bytes and media type of a manifest or index by tag or digest (digest verified)."""
        ...

    def resolve(self, reference: str) -> str:
        """The digest a tag (or digest) points to now."""
        ...

    def put_manifest(self, data: bytes, media_type: str, tag: str | None) -> str:
        """Store a manifest or index (tagged when ``tag``); returns its digest."""
        ...

    def has_blob(self, digest: str) -> bool: ...

    def put_blob(self, blob: Blob) -> None: ...

    def fetch_blob(self, digest: str, destination: Path) -> int:
        """Write the blob to ``destination``, verifying its digest; returns its size."""
        ...

    def referrers(self, digest: str) -> dict[str, Any] | None:
        """The referrers API's index, or None where the store has none (use the tag schema)."""
        ...


def open_store(reference: Reference, config: RegistryConfig, *, create: bool = False) -> Store:
    if reference.layout is not None:
        from cuvil.artifact.layout import LayoutStore

        return LayoutStore(reference.layout, create=create)
    from cuvil.artifact.registry import RegistryStore

    return RegistryStore(reference, config)

"""Signatures kept in the node cache, so a node that trusts only signed artifacts can restart
while its registry is down: every signature manifest and payload a verification reads online is
kept beside the artifact, and offline the same verification runs on those copies — each
signature checked against the trusted keys again, never a remembered verdict.

``RecordingSignatures`` wraps the registry's store for a verification and keeps what it reads;
``CachedSignatures`` answers the same two questions (a signature tag's manifest, a payload
blob) from the cache alone. Both cover only what trust.py's verification asks of a store.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from cuvil.artifact.cache import NodeCache
from cuvil.artifact.errors import NotFoundError
from cuvil.artifact.layout import atomic_write
from cuvil.artifact.manifests import sha256_digest
from cuvil.artifact.reference import Reference
from cuvil.artifact.store import Store

MAX_PAYLOAD_BYTES = 64 * 1024  # what trust.py reads of a payload at most


def _tag_key(reference: Reference, tag: str) -> str:
    return f"{reference.registry}/{reference.repository}:{tag} (signatures)"


def _blob_path(cache: NodeCache, digest: str) -> Path:
    return cache.root / "signatures" / digest.split(":", 1)[1]


class RecordingSignatures:
    """The registry's store, keeping every manifest and blob a verification reads."""

    def __init__(self, store: Store, cache: NodeCache, reference: Reference) -> None:
        self.store, self.cache, self.reference = store, cache, reference
        self.location = store.location

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        data, media_type = self.store.get_manifest(reference)
        digest = self.cache.put_manifest(data)
        self.cache.record_tag(_tag_key(self.reference, reference), digest)
        return data, media_type

    def fetch_blob(self, digest: str, destination: Path) -> int:
        size = self.store.fetch_blob(digest, destination)
        if size <= MAX_PAYLOAD_BYTES:
            atomic_write(_blob_path(self.cache, digest), destination.read_bytes())
        return size


class CachedSignatures:
    """What ``RecordingSignatures`` kept, for a verification while the registry is down."""

    def __init__(self, cache: NodeCache, reference: Reference) -> None:
        self.cache, self.reference = cache, reference
        self.location = reference

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        digest = self.cache.lookup_tag(_tag_key(self.reference, reference))
        data = self.cache.get_manifest(digest) if digest else None
        if data is None:
            raise NotFoundError(f"{reference}: not kept on this node")
        return data, str(json.loads(data).get("mediaType", ""))

    def fetch_blob(self, digest: str, destination: Path) -> int:
        path = _blob_path(self.cache, digest)
        if not path.exists() or sha256_digest(path.read_bytes()) != digest:
            raise NotFoundError(
                f"signature payload {digest}: not kept on this node, or changed since"
            )
        shutil.copyfile(path, destination)
        return path.stat().st_size

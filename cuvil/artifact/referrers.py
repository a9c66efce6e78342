"""Referrers: reports and signatures attached to an artifact through ``subject``.

Distribution 2.8 has no referrers API, so each attach also updates the referrers tag schema's
index (tag ``sha256-<hex>`` of the subject) — read back first through the API where a registry
has one. Concurrent attaches to one subject may race on that index (last writer wins); Cuvil
attaches from one task per artifact.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cuvil.artifact import media_types as mt
from cuvil.artifact.api import ConfigArg, parse_model_reference, upload_blobs
from cuvil.artifact.errors import NotFoundError, RegistryError
from cuvil.artifact.manifests import (
    build_descriptor,
    build_referrer_manifest,
    build_referrers_index,
    canonical_json,
    parse_manifest,
    referrer_descriptor,
    referrers_tag,
)
from cuvil.artifact.oci_types import Referrer
from cuvil.artifact.reference import Reference
from cuvil.artifact.registry_config import RegistryConfig
from cuvil.artifact.store import Store, open_store


def _subject(reference: Reference, store: Store) -> tuple[str, dict[str, Any]]:
    digest = store.resolve(reference.reference)
    data, media_type = store.get_manifest(digest)
    return digest, build_descriptor(media_type, data)


def _referrers_index(store: Store, digest: str) -> dict[str, Any] | None:
    found = store.referrers(digest)
    if found is not None:
        return found
    try:
        data, _ = store.get_manifest(referrers_tag(digest))
    except NotFoundError:
        return None
    return parse_manifest(data, f"referrers of {digest}")


def attach_referrer(
    subject: str,
    data: bytes,
    *,
    media_type: str,
    artifact_type: str,
    annotations: Mapping[str, str] | None = None,
    registry_config: ConfigArg = None,
) -> str:
    reference = parse_model_reference(subject)
    store = open_store(reference, RegistryConfig.coerce(registry_config))
    digest, descriptor = _subject(reference, store)
    manifest, blobs = build_referrer_manifest(
        descriptor, data, media_type, artifact_type, annotations
    )
    upload_blobs(store, blobs)
    manifest_data = canonical_json(manifest)
    referrer = store.put_manifest(manifest_data, mt.OCI_MANIFEST, None)
    index = build_referrers_index(
        _referrers_index(store, digest), referrer_descriptor(manifest, manifest_data)
    )
    store.put_manifest(canonical_json(index), mt.OCI_INDEX, referrers_tag(digest))
    return referrer


def list_referrers(
    subject: str, *, artifact_type: str | None = None, registry_config: ConfigArg = None
) -> list[Referrer]:
    reference = parse_model_reference(subject)
    store = open_store(reference, RegistryConfig.coerce(registry_config))
    digest = store.resolve(reference.reference)
    return list_referrers_in(store, digest, artifact_type)


def list_referrers_in(store: Store, digest: str, artifact_type: str | None) -> list[Referrer]:
    index = _referrers_index(store, digest) or {"manifests": []}
    return [
        Referrer(
            entry["digest"],
            entry.get("artifactType", ""),
            entry["size"],
            entry.get("annotations", {}),
        )
        for entry in index["manifests"]
        if artifact_type is None or entry.get("artifactType") == artifact_type
    ]


def fetch_referrer(subject: str, digest: str, *, registry_config: ConfigArg = None) -> bytes:
    reference = parse_model_reference(subject)
    store = open_store(reference, RegistryConfig.coerce(registry_config))
    manifest = parse_manifest(store.get_manifest(digest)[0], f"referrer {digest}")
    layers = manifest.get("layers", [])
    if not layers:
        raise RegistryError(f"referrer {digest} has no content layer")
    with tempfile.TemporaryDirectory(prefix="cuvil-referrer-") as folder:
        path = Path(folder) / "data"
        store.fetch_blob(layers[0]["digest"], path)
        return path.read_bytes()

"""Pure builders of OCI manifests and indexes for Cuvil artifacts, checked against JSON schemas.

Nothing here does I/O. A manifest is plain data, serialised canonically (sorted keys, no spaces)
so that the same artifact files always give the same manifest digest. Shapes follow the
image-spec (https://github.com/opencontainers/image-spec/blob/main/manifest.md,
https://github.com/opencontainers/image-spec/blob/main/image-index.md) and its artifact guidance.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from cuvil.artifact import media_types as mt

_DIGEST_PATTERN = "^sha256:[0-9a-f]{64}$"
_ANNOTATIONS = {"type": "object", "additionalProperties": {"type": "string"}}
DESCRIPTOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["mediaType", "digest", "size"],
    "properties": {
        "mediaType": {"type": "string", "minLength": 1},
        "digest": {"type": "string", "pattern": _DIGEST_PATTERN},
        "size": {"type": "integer", "minimum": 0},
        "artifactType": {"type": "string"},
        "annotations": _ANNOTATIONS,
    },
}
MANIFEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schemaVersion", "mediaType", "config", "layers"],
    "properties": {
        "schemaVersion": {"const": 2},
        "mediaType": {"const": mt.OCI_MANIFEST},
        "artifactType": {"type": "string"},
        "config": DESCRIPTOR_SCHEMA,
        "layers": {"type": "array", "items": DESCRIPTOR_SCHEMA},
        "subject": DESCRIPTOR_SCHEMA,
        "annotations": _ANNOTATIONS,
    },
}
INDEX_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schemaVersion", "mediaType", "manifests"],
    "properties": {
        "schemaVersion": {"const": 2},
        "mediaType": {"const": mt.OCI_INDEX},
        "artifactType": {"type": "string"},
        "manifests": {"type": "array", "items": DESCRIPTOR_SCHEMA},
        "subject": DESCRIPTOR_SCHEMA,
        "annotations": _ANNOTATIONS,
    },
}
# The image-spec's empty descriptor: config of a referrer whose content is all in its layer.
EMPTY_JSON = b"{}"


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical_json(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Blob:
    """Content to upload: its descriptor and its bytes."""

    media_type: str
    data: bytes
    annotations: Mapping[str, str] | None = None

    @property
    def digest(self) -> str:
        return sha256_digest(self.data)

    def descriptor(self) -> dict[str, Any]:
        return build_descriptor(self.media_type, self.data, self.annotations)


def build_descriptor(
    media_type: str, data: bytes, annotations: Mapping[str, str] | None = None
) -> dict[str, Any]:
    descriptor: dict[str, Any] = {
        "mediaType": media_type,
        "digest": sha256_digest(data),
        "size": len(data),
    }
    if annotations:
        descriptor["annotations"] = dict(annotations)
    return descriptor


def artifact_annotations(config: Mapping[str, Any]) -> dict[str, str]:
    """Target, precision and name of an artifact, from its config.json."""
    found = {
        mt.ANNOTATION_TARGET: config.get("target"),
        mt.ANNOTATION_PRECISION: config.get("precision"),
        mt.ANNOTATION_NAME: config.get("name"),
    }
    return {key: str(value) for key, value in found.items() if value is not None}


def build_artifact_manifest(
    files: Mapping[str, bytes], annotations: Mapping[str, str] | None = None
) -> tuple[dict[str, Any], list[Blob]]:
    """The manifest of one artifact (config.json as config, one titled layer per file), and the
    blobs it refers to (config first)."""
    if mt.CONFIG_FILE not in files:
        raise ValueError(f"an artifact needs {mt.CONFIG_FILE}")
    unknown = set(files) - {mt.CONFIG_FILE, *mt.FILE_MEDIA_TYPES}
    if unknown:
        raise ValueError(f"unknown artifact files {sorted(unknown)}")
    config = Blob(mt.CONFIG, files[mt.CONFIG_FILE])
    layers = [
        Blob(media_type, files[name], {mt.ANNOTATION_TITLE: name})
        for name, media_type in mt.FILE_MEDIA_TYPES.items()
        if name in files
    ]
    merged = artifact_annotations(json.loads(files[mt.CONFIG_FILE]))
    merged.update(annotations or {})
    manifest: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": mt.OCI_MANIFEST,
        "artifactType": mt.ARTIFACT_TYPE,
        "config": config.descriptor(),
        "layers": [layer.descriptor() for layer in layers],
    }
    if merged:
        manifest["annotations"] = merged
    validate_manifest(manifest)
    return manifest, [config, *layers]


def build_index(
    entries: Sequence[Mapping[str, Any]], annotations: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """An image index over per-target manifests. ``entries``: descriptors, each with a
    ``dev.cuvil.target`` annotation; one entry per target, sorted by target (deterministic)."""
    targets = [entry.get("annotations", {}).get(mt.ANNOTATION_TARGET) for entry in entries]
    if None in targets:
        raise ValueError("every index entry needs a dev.cuvil.target annotation")
    duplicates = sorted({t for t in targets if targets.count(t) > 1 and t is not None})
    if duplicates:
        raise ValueError(f"more than one index entry for target(s) {duplicates}")
    ordered = sorted(entries, key=lambda entry: entry["annotations"][mt.ANNOTATION_TARGET])
    index: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": mt.OCI_INDEX,
        "artifactType": mt.ARTIFACT_TYPE,
        "manifests": [dict(entry) for entry in ordered],
    }
    if annotations:
        index["annotations"] = dict(annotations)
    validate_index(index)
    return index


def build_referrer_manifest(
    subject: Mapping[str, Any],
    data: bytes,
    media_type: str,
    artifact_type: str,
    annotations: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], list[Blob]]:
    """A manifest whose ``subject`` is another manifest, holding ``data`` as its one layer."""
    config = Blob(mt.OCI_EMPTY, EMPTY_JSON)
    layer = Blob(media_type, data)
    manifest: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": mt.OCI_MANIFEST,
        "artifactType": artifact_type,
        "config": config.descriptor(),
        "layers": [layer.descriptor()],
        "subject": {key: subject[key] for key in ("mediaType", "digest", "size")},
    }
    if annotations:
        manifest["annotations"] = dict(annotations)
    validate_manifest(manifest)
    return manifest, [config, layer]


def build_referrers_index(
    existing: Mapping[str, Any] | None, referrer: Mapping[str, Any]
) -> dict[str, Any]:
    """The referrers tag schema's index with ``referrer`` added (once), for the ``sha256-<hex>``
    tag (https://github.com/opencontainers/distribution-spec/blob/main/spec.md#referrers-tag-schema)."""
    manifests = [dict(entry) for entry in (existing or {}).get("manifests", [])]
    if all(entry.get("digest") != referrer["digest"] for entry in manifests):
        manifests.append(dict(referrer))
    index = {"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": manifests}
    validate_index(index)
    return index


def referrer_descriptor(manifest: Mapping[str, Any], data: bytes) -> dict[str, Any]:
    """The descriptor a referrers listing holds for a referrer manifest."""
    descriptor = build_descriptor(mt.OCI_MANIFEST, data, manifest.get("annotations"))
    descriptor["artifactType"] = manifest.get("artifactType") or manifest["config"]["mediaType"]
    return descriptor


def referrers_tag(digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    return f"{algorithm}-{hexdigest}"


def validate_manifest(manifest: Mapping[str, Any]) -> None:
    _validate(manifest, MANIFEST_SCHEMA, "manifest")


def validate_index(index: Mapping[str, Any]) -> None:
    _validate(index, INDEX_SCHEMA, "index")


def _validate(document: Mapping[str, Any], schema: Mapping[str, Any], what: str) -> None:
    try:
        jsonschema.validate(document, schema)
    except jsonschema.ValidationError as error:
        path = "/".join(str(part) for part in error.absolute_path) or "<root>"
        raise ValueError(f"invalid OCI {what} at {path}: {error.message}") from None


def parse_manifest(data: bytes, origin: str) -> dict[str, Any]:
    """A manifest or index fetched from somewhere, validated by its media type."""
    try:
        document = json.loads(data)
    except json.JSONDecodeError as error:
        raise ValueError(f"{origin}: not JSON: {error}") from None
    if not isinstance(document, dict):
        raise ValueError(f"{origin}: not a JSON object")
    if document.get("mediaType") == mt.OCI_INDEX:
        validate_index(document)
    else:
        validate_manifest(document)
    return document

"""OCI "source bundles": a HuggingFace model as data — config.json, safetensors weights, a class.

    manifest  artifactType  application/vnd.cuvil.source.v1
              config        application/vnd.cuvil.source.config.v1+json   {"modelClass", "task"}
              layers        one per file, titled with its name (org.opencontainers.image.title)

Only data files travel (``*.json``, ``*.safetensors``, ``*.txt``): no pickles, no Python, so a
bundle can never run code; the model class must be one of ``transformers``' own. Pushed and
fetched through ``cuvil.artifact``'s stores (a registry or a local OCI layout), every blob
verified against its digest.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from cuvil.artifact import media_types as mt
from cuvil.artifact.manifests import Blob, canonical_json, parse_manifest
from cuvil.artifact.reference import parse_target_reference
from cuvil.artifact.registry_config import RegistryConfig
from cuvil.artifact.store import open_store

SOURCE_ARTIFACT_TYPE = "application/vnd.cuvil.source.v1"
SOURCE_CONFIG = "application/vnd.cuvil.source.config.v1+json"
SOURCE_FILE = "application/vnd.cuvil.source.file.v1"
SOURCE_META_FILE = "cuvil-source.json"  # written next to the fetched files: the config blob
ALLOWED_SUFFIXES = (".json", ".safetensors", ".txt")
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")  # a bundle file name: no paths

ConfigArg = RegistryConfig | str | Path | None


class SourceBundleError(ValueError):
    """A bundle that is not one (missing config.json, a file that is not plain data)."""


def bundle_files(directory: Path) -> list[Path]:
    """The files of a bundle folder, refused unless they are data only with a config.json
    and safetensors weights."""
    files = sorted(p for p in directory.iterdir() if p.is_file())
    refused = [p.name for p in files if not p.name.endswith(ALLOWED_SUFFIXES)]
    if refused:
        raise SourceBundleError(f"source bundles carry data only; refused: {refused}")
    if not any(p.name == "config.json" for p in files):
        raise SourceBundleError(f"{directory} has no config.json")
    if not any(p.name.endswith(".safetensors") for p in files):
        raise SourceBundleError(f"{directory} has no *.safetensors weights")
    return [p for p in files if p.name != SOURCE_META_FILE]


def push_source_bundle(
    directory: str | Path,
    ref: str,
    *,
    model_class: str | None = None,
    task: str = "feature-extraction",
    registry_config: ConfigArg = None,
) -> str:
    """Push the HF directory ``directory`` as a source bundle to ``ref``; returns its digest."""
    directory = Path(directory)
    files = bundle_files(directory)
    if model_class is None:
        architectures = json.loads((directory / "config.json").read_text()).get("architectures")
        model_class = (architectures or [None])[0]
    config = Blob(SOURCE_CONFIG, canonical_json({"modelClass": model_class, "task": task}))
    layers = [
        Blob(SOURCE_FILE, path.read_bytes(), {mt.ANNOTATION_TITLE: path.name}) for path in files
    ]
    manifest = {
        "schemaVersion": 2,
        "mediaType": mt.OCI_MANIFEST,
        "artifactType": SOURCE_ARTIFACT_TYPE,
        "config": config.descriptor(),
        "layers": [layer.descriptor() for layer in layers],
    }
    reference = parse_target_reference(ref)
    store = open_store(reference, RegistryConfig.coerce(registry_config), create=True)
    for blob in (config, *layers):
        if not store.has_blob(blob.digest):
            store.put_blob(blob)
    return store.put_manifest(canonical_json(manifest), mt.OCI_MANIFEST, reference.tag)


def fetch_source_bundle(
    ref: str, destination: str | Path, *, registry_config: ConfigArg = None
) -> Path:
    """Fetch the bundle at ``ref`` into ``destination`` (digests verified); returns it."""
    reference = parse_target_reference(ref)
    store = open_store(reference, RegistryConfig.coerce(registry_config))
    data, _ = store.get_manifest(reference.reference)
    manifest = parse_manifest(data, ref)
    if manifest.get("artifactType") != SOURCE_ARTIFACT_TYPE:
        raise SourceBundleError(
            f"{ref} is a {manifest.get('artifactType')!r}, not a source bundle "
            f"({SOURCE_ARTIFACT_TYPE})"
        )
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    store.fetch_blob(manifest["config"]["digest"], destination / SOURCE_META_FILE)
    for layer in manifest.get("layers", []):
        name = (layer.get("annotations") or {}).get(mt.ANNOTATION_TITLE, "")
        if not SAFE_NAME.match(name) or not name.endswith(ALLOWED_SUFFIXES):
            raise SourceBundleError(f"{ref}: layer file name {name!r} refused")
        store.fetch_blob(layer["digest"], destination / name)
    return destination


def bundle_model_class(directory: Path) -> str | None:
    meta = directory / SOURCE_META_FILE
    if not meta.is_file():
        return None
    value = json.loads(meta.read_text()).get("modelClass")
    return str(value) if value else None

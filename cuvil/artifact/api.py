"""Push, pull and resolve, written once against ``Store`` (registry or local layout).

The flow of a pull (``resolve``): reference -> digest (a HEAD for a tag; nothing for a digest)
-> manifest or index (node cache first) -> the index entry for this machine -> the node cache's
verified entry, downloaded under its lock when missing. With the registry unreachable, a pinned
digest (or the digest a tag last resolved to on this node) still loads from the cache.
"""

from __future__ import annotations

import logging
import shutil
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cuvil.artifact import media_types as mt
from cuvil.artifact.cache import NodeCache
from cuvil.artifact.errors import (
    DigestMismatchError,
    NoMatchingTargetError,
    RegistryError,
    RegistryUnavailableError,
)
from cuvil.artifact.manifests import (
    Blob,
    build_artifact_manifest,
    build_index,
    canonical_json,
    parse_manifest,
)
from cuvil.artifact.oci_types import PushResult
from cuvil.artifact.reference import (
    Reference,
    is_artifact_path,
    is_layout_reference,
    parse_layout_reference,
    parse_registry_reference,
    parse_target_reference,
)
from cuvil.artifact.registry_config import RegistryConfig
from cuvil.artifact.store import Store, open_store
from cuvil.artifact.targets import entry_target, select_entry

if TYPE_CHECKING:
    from cuvil.artifact.trust import TrustSettings

ConfigArg = RegistryConfig | str | Path | None
log = logging.getLogger(__name__)


def parse_model_reference(text: str) -> Reference:
    """A local OCI layout or a registry reference (artifact paths are handled before)."""
    if is_layout_reference(text):
        return parse_layout_reference(text)
    try:
        return parse_registry_reference(text)
    except ValueError as error:
        raise ValueError(
            f"{text!r} is neither an artifact path, an OCI layout (oci:PATH[:tag]) nor a "
            f"registry reference: {error}"
        ) from None


def _source_files(source: Any) -> dict[str, bytes]:
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, str | Path):
        from cuvil.artifact.files import read_files

        return read_files(source)
    from cuvil.artifact.files import encode_files

    return encode_files(source)


def upload_blobs(store: Store, blobs: Sequence[Blob]) -> None:
    for blob in blobs:
        if not store.has_blob(blob.digest):
            store.put_blob(blob)


def push_artifact(
    source: Any,
    ref: str,
    *,
    registry_config: ConfigArg = None,
    annotations: Mapping[str, str] | None = None,
) -> PushResult:
    reference = parse_target_reference(ref)
    if reference.digest:
        raise ValueError(f"push to a tag or a bare repository, not to a digest: {ref}")
    manifest, blobs = build_artifact_manifest(_source_files(source), annotations)
    store = open_store(reference, RegistryConfig.coerce(registry_config), create=True)
    upload_blobs(store, blobs)
    data = canonical_json(manifest)
    digest = store.put_manifest(data, mt.OCI_MANIFEST, reference.tag)
    labels = manifest.get("annotations", {})
    return PushResult(
        str(reference.with_digest(digest)),
        digest,
        len(data),
        mt.OCI_MANIFEST,
        labels.get(mt.ANNOTATION_TARGET),
        labels.get(mt.ANNOTATION_PRECISION),
        reference.tag,
    )


def push_index(
    ref: str,
    entries: Sequence[PushResult],
    *,
    registry_config: ConfigArg = None,
    annotations: Mapping[str, str] | None = None,
) -> PushResult:
    reference = parse_target_reference(ref)
    descriptors = []
    for entry in entries:
        where = parse_target_reference(entry.ref)
        if (where.registry, where.repository, where.layout) != (
            reference.registry,
            reference.repository,
            reference.layout,
        ):
            raise ValueError(f"index entry {entry.ref} is not in the index's repository {ref}")
        if entry.target is None:
            raise ValueError(f"index entry {entry.ref} has no target")
        labels = {mt.ANNOTATION_TARGET: entry.target}
        if entry.precision:
            labels[mt.ANNOTATION_PRECISION] = entry.precision
        descriptors.append(
            {
                "mediaType": entry.media_type,
                "digest": entry.digest,
                "size": entry.size,
                "artifactType": mt.ARTIFACT_TYPE,
                "annotations": labels,
            }
        )
    data = canonical_json(build_index(descriptors, annotations))
    store = open_store(reference, RegistryConfig.coerce(registry_config), create=True)
    digest = store.put_manifest(data, mt.OCI_INDEX, reference.tag)
    return PushResult(
        str(reference.with_digest(digest)), digest, len(data), mt.OCI_INDEX, tag=reference.tag
    )


@dataclass(frozen=True)
class Resolution:
    path: Path
    digest: str | None
    downloaded: bool = False
    offline: bool = False


def resolve_model(
    reference: str,
    *,
    cache_dir: str | Path | None = None,
    registry_config: ConfigArg = None,
    target: str | None = None,
    trust: TrustSettings | None = None,
) -> Path:
    return resolve(
        reference, cache_dir=cache_dir, registry_config=registry_config, target=target, trust=trust
    ).path


def _manifest(cache: NodeCache, store: Store, digest: str) -> bytes:
    data = cache.get_manifest(digest)
    if data is None:
        data, _ = store.get_manifest(digest)
        cache.put_manifest(data)
    return data


def resolve(
    reference: str,
    *,
    cache_dir: str | Path | None = None,
    registry_config: ConfigArg = None,
    target: str | None = None,
    trust: TrustSettings | None = None,
) -> Resolution:
    """``resolve_model`` with what happened (downloaded, offline). With ``trust``, the
    manifest's signatures are checked by its policy before anything is downloaded."""
    if not reference.startswith("oci:") and is_artifact_path(reference):
        if trust is not None:
            trust.check_path(reference)
        return Resolution(Path(reference), None)
    ref = parse_model_reference(reference)
    cache = NodeCache(cache_dir)
    store = open_store(ref, RegistryConfig.coerce(registry_config))
    offline = False
    try:
        top = store.resolve(ref.reference)
        if ref.digest is None:
            cache.record_tag(str(ref), top)
    except RegistryUnavailableError as error:
        remembered = cache.lookup_tag(str(ref))
        if remembered is None:
            raise RegistryUnavailableError(
                f"{error}; {ref} was never pulled on this node"
            ) from None
        log.warning("%s; using %s, the digest %s last resolved to", error, remembered, ref)
        top, offline = remembered, True
    document = parse_manifest(_manifest(cache, store, top), f"{ref}")
    digest = top
    if document.get("mediaType") == mt.OCI_INDEX:
        entry = select_entry(document["manifests"], [target] if target else None)
        digest = entry["digest"]
        document = parse_manifest(_manifest(cache, store, digest), f"{ref} entry {digest}")
    elif target and document.get("annotations", {}).get(mt.ANNOTATION_TARGET) != target:
        raise NoMatchingTargetError(
            f"{ref} is an artifact for {entry_target(document)}, not {target}"
        )
    if document.get("artifactType") != mt.ARTIFACT_TYPE:
        raise RegistryError(
            f"{ref} is not a Cuvil artifact (artifactType {document.get('artifactType')!r})"
        )
    if trust is not None:
        trust.check(store, ref, digest)
    try:
        hit = cache.lookup(digest)
    except DigestMismatchError as error:
        log.warning("%s; downloading it again", error)
        hit = None
    if hit is not None:
        return Resolution(hit, digest, downloaded=False, offline=offline)
    manifest_data = _manifest(cache, store, digest)
    path, downloaded = cache.install(digest, manifest_data, store.fetch_blob)
    return Resolution(path, digest, downloaded=downloaded, offline=offline)


def resolve_digest(reference: str, *, registry_config: ConfigArg = None) -> str:
    """The digest ``reference`` points to now (for an artifact path: its config.json's)."""
    if not reference.startswith("oci:") and is_artifact_path(reference):
        from cuvil.artifact.files import read_files
        from cuvil.artifact.manifests import sha256_digest

        return sha256_digest(read_files(reference)[mt.CONFIG_FILE])
    ref = parse_model_reference(reference)
    return open_store(ref, RegistryConfig.coerce(registry_config)).resolve(ref.reference)


def pull_artifact(
    reference: str,
    output: str | Path,
    *,
    registry_config: ConfigArg = None,
    target: str | None = None,
    cache_dir: str | Path | None = None,
    trust: TrustSettings | None = None,
) -> Path:
    """Resolve through the node cache (checking signatures by ``trust``), then copy: a
    directory, or a tar when ``output`` ends in ``.tar`` or ``.cuvil`` (``save``'s form)."""
    source = resolve_model(
        reference, cache_dir=cache_dir, registry_config=registry_config, target=target, trust=trust
    )
    names = [mt.CONFIG_FILE, *sorted(n for n in mt.FILE_MEDIA_TYPES if (source / n).is_file())]
    output = Path(output)
    if output.suffix in (".tar", ".cuvil"):
        output.parent.mkdir(parents=True, exist_ok=True)
        partial = output.with_name(output.name + ".partial")
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            for name in names:
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = (source / name).stat().st_size, 0, 0o644
                with (source / name).open("rb") as data:
                    tar.addfile(info, data)
        partial.replace(output)
        return output
    output.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(source / name, output / name)
    return output

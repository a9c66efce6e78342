"""Cuvil artifacts: files on disk, OCI push/pull, target selection and the node cache.

Import-light: nothing here imports torch or oras at import time; each function imports what it
needs when called. ``cuvil.artifact.files`` (the on-disk form) is unchanged.

Public API (``from cuvil.artifact import …``)::

    push_artifact(source, ref, *, registry_config=None, annotations=None) -> PushResult
        source: an artifact path (tar or directory), the dict of ``files.encode_files``, or an
        ``ArtifactContents``. One manifest (artifactType application/vnd.cuvil.artifact.v1,
        config = config.json, one layer per file) annotated with the artifact's target.
        ref: ``host[:port]/repo[:tag]`` (no tag: pushed by digest only, untagged) or a local OCI
        layout ``oci:PATH[:tag]``. Deterministic: the same files give the same digest.
    push_index(ref, entries, *, registry_config=None, annotations=None) -> PushResult
        An OCI image index over per-target manifests (PushResults of push_artifact, same
        repository), each entry annotated ``dev.cuvil.target``; tagged with ref's tag.
    attach_referrer(subject, data, *, media_type, artifact_type, annotations=None,
                    registry_config=None) -> str
        Push ``data`` as a referrer of ``subject`` (a ref pinned by ``@sha256:…``) and record it
        under the referrers tag schema (tag ``sha256-<hex>``); returns the referrer's digest.
    list_referrers(subject, *, artifact_type=None, registry_config=None) -> list[Referrer]
    fetch_referrer(subject, digest, *, registry_config=None) -> bytes   (the referrer's data)
    resolve_model(reference, *, cache_dir=None, registry_config=None, target=None,
                  trust=None) -> Path
        What ``CUVIL_MODEL`` holds -> a local artifact directory for ``cuvil.runtime.model.load``:
        an artifact path is returned as is; a layout or registry reference (tag or digest) is
        resolved, an index entry picked for this machine (or ``target``), every blob verified,
        stored in the node cache (``cache_dir``, default ``$CUVIL_CACHE_DIR`` or
        ``~/.cache/cuvil``); a cached digest loads with the registry unreachable. ``trust``
        (``trust.TrustSettings``: policy and trusted keys) checks the picked manifest's
        signatures before anything is downloaded.
    resolve_digest(reference, *, registry_config=None) -> str
        The manifest (or index) digest a tag points to now: poll it for hot reload.
    pull_artifact(reference, output, *, registry_config=None, target=None,
                  cache_dir=None) -> Path   (resolve_model, then a copy at ``output``)
    describe_reference(reference, *, registry_config=None, trusted_keys=()) -> dict
        Manifest or index, targets, annotations, referrers and signatures (checked against
        ``trusted_keys``), for ``cuvil inspect REF``.
    trust.sign_reference(reference, key, signer, *, registry_config=None) -> list[str]
        Sign a manifest (an index: it and its entries) in cosign's format (``signing.py``);
        ``trust.TrustSettings.from_env`` reads CUVIL_TRUST_POLICY and CUVIL_TRUSTED_KEYS.
    probe_targets() -> list[str]; select_entry(entries, candidates) -> dict
    RegistryConfig(docker_config=None, ca_bundle=None, plain_http=None, timeout_s=30.0,
                   attempts=2); RegistryConfig.from_env() reads CUVIL_REGISTRY_CONFIG
        (a docker config.json, e.g. a mounted ``kubernetes.io/dockerconfigjson`` secret),
        CUVIL_REGISTRY_CA_BUNDLE and CUVIL_REGISTRY_PLAIN_HTTP. ``registry_config`` arguments
        accept a RegistryConfig, a docker config path, or None (from the environment).
    PushResult(ref, digest, size, media_type, target, precision, tag)
        ``ref`` is pinned by digest (``host/repo@sha256:…``); ``str(result)`` gives it.
    Referrer(digest, artifact_type, size, annotations)

Errors (all ``OSError`` subclasses with ``.retryable``): RegistryError,
RegistryUnavailableError (retryable; also a ConnectionError), AuthenticationError,
NotFoundError (also a LookupError), DigestMismatchError, NoMatchingTargetError.
"""

from __future__ import annotations

from cuvil.artifact.api import (
    pull_artifact,
    push_artifact,
    push_index,
    resolve_digest,
    resolve_model,
)
from cuvil.artifact.describe import describe_reference
from cuvil.artifact.errors import (
    AuthenticationError,
    DigestMismatchError,
    NoMatchingTargetError,
    NotFoundError,
    RegistryError,
    RegistryUnavailableError,
)
from cuvil.artifact.oci_types import PushResult, Referrer
from cuvil.artifact.referrers import attach_referrer, fetch_referrer, list_referrers
from cuvil.artifact.registry_config import RegistryConfig
from cuvil.artifact.targets import probe_targets, select_entry

__all__ = [
    "AuthenticationError",
    "DigestMismatchError",
    "NoMatchingTargetError",
    "NotFoundError",
    "PushResult",
    "Referrer",
    "RegistryConfig",
    "RegistryError",
    "RegistryUnavailableError",
    "attach_referrer",
    "describe_reference",
    "fetch_referrer",
    "list_referrers",
    "probe_targets",
    "pull_artifact",
    "push_artifact",
    "push_index",
    "resolve_digest",
    "resolve_model",
    "select_entry",
]

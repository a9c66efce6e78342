"""Who made an artifact: signing manifests in a registry or layout, and verifying by policy.

The worker signs each manifest it pushes (and its verification report's referrer manifest) with
the key of a mounted secret, in cosign's signature-as-tag scheme (``cuvil.artifact.signing``):
the signatures of ``sha256:<hex>`` sit in an OCI manifest tagged ``sha256-<hex>.sig`` in the same
repository, one simple-signing layer per signature. Nodes verify against the public keys they
trust, by ``CUVIL_TRUST_POLICY``: ``off`` checks nothing, ``warn`` logs an unsigned or wrongly
signed artifact and loads it, ``require`` refuses it (``UntrustedArtifactError``). A signature
counts only if a trusted key verifies it and its payload names the manifest's digest and
repository.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from cuvil.artifact import media_types as mt
from cuvil.artifact.api import ConfigArg, parse_model_reference
from cuvil.artifact.errors import ArtifactError, NotFoundError, RegistryError
from cuvil.artifact.manifests import Blob, canonical_json, parse_manifest, sha256_digest
from cuvil.artifact.reference import Reference
from cuvil.artifact.registry_config import RegistryConfig
from cuvil.artifact.signing import (
    SIGNATURE_ANNOTATION,
    SIGNER_CLAIM,
    SIMPLE_SIGNING,
    TrustedKey,
    key_id,
    load_private_key,
    load_public_keys,
    parse_payload,
    sign,
    signature_tag,
    simple_signing_payload,
    verifies,
)
from cuvil.artifact.store import Store, open_store

log = logging.getLogger(__name__)
TRUST_POLICIES = ("off", "warn", "require")
OCI_IMAGE_CONFIG = "application/vnd.oci.image.config.v1+json"
MAX_SIGNATURES = 64  # signatures read per manifest: a forged .sig manifest cannot stall a node


class UntrustedArtifactError(ArtifactError):
    """``require`` policy: the artifact carries no signature a trusted key verifies."""


@dataclass(frozen=True)
class SignatureCheck:
    """One signature found for a manifest, and what verifying it showed."""

    digest: str  # the manifest it is for
    signer: str  # the signer the payload claims ("" if none); trustworthy only if verified
    trusted_key: str | None  # the trusted key that verified it (its file name), or None
    key_id: str | None  # that key's id
    problem: str | None  # why it does not count, or None

    @property
    def verified(self) -> bool:
        return self.problem is None


@dataclass(frozen=True)
class TrustSettings:
    """A node's policy and the keys it trusts (``CUVIL_TRUST_POLICY``, ``CUVIL_TRUSTED_KEYS``)."""

    policy: str = "off"
    keys: tuple[TrustedKey, ...] = ()

    @classmethod
    def load(cls, policy: str, key_paths: Sequence[str | Path]) -> TrustSettings:
        if policy not in TRUST_POLICIES:
            raise ValueError(f"trust policy {policy!r} is not one of {list(TRUST_POLICIES)}")
        keys = tuple(load_public_keys(key_paths)) if policy != "off" else ()
        return cls(policy, keys)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> TrustSettings:
        """``CUVIL_TRUST_POLICY`` (off) and ``CUVIL_TRUSTED_KEYS`` (comma-separated PEM files
        or folders of them)."""
        policy = environ.get("CUVIL_TRUST_POLICY", "").strip().lower() or "off"
        paths = [p.strip() for p in environ.get("CUVIL_TRUSTED_KEYS", "").split(",") if p.strip()]
        return cls.load(policy, paths)

    def check(self, store: Store, reference: Reference, digest: str) -> list[SignatureCheck]:
        return verify_by_policy(store, reference, digest, self.policy, self.keys)

    def check_path(self, path: str) -> None:
        refuse_unsigned_path(path, self.policy)


def repository_name(reference: Reference) -> str:
    """What a payload's ``docker-reference`` holds: ``registry/repository``, or ``oci:DIR``."""
    return reference.name


def sign_manifest(
    store: Store,
    reference: Reference,
    digest: str,
    key: ec.EllipticCurvePrivateKey,
    signer: str,
) -> str:
    """Add a signature of ``digest`` to its ``.sig`` manifest (kept: others' signatures);
    returns the digest of the signature manifest."""
    payload = simple_signing_payload(repository_name(reference), digest, {SIGNER_CLAIM: signer})
    layer = Blob(SIMPLE_SIGNING, payload, {SIGNATURE_ANNOTATION: sign(key, payload)})
    public = key.public_key()
    layers = [  # others' signatures stay; this key's earlier one of the same payload is replaced
        entry
        for entry in _signature_layers(store, digest)
        if entry["digest"] != layer.digest or not verifies(public, payload, _signature_of(entry))
    ]
    layers.append(layer.descriptor())
    config = Blob(OCI_IMAGE_CONFIG, _image_config([str(entry["digest"]) for entry in layers]))
    manifest = {
        "schemaVersion": 2,
        "mediaType": mt.OCI_MANIFEST,
        "config": config.descriptor(),
        "layers": layers,
    }
    for blob in (config, layer):
        if not store.has_blob(blob.digest):
            store.put_blob(blob)
    return store.put_manifest(canonical_json(manifest), mt.OCI_MANIFEST, signature_tag(digest))


def signature_checks(
    store: Store, reference: Reference, digest: str, keys: Sequence[TrustedKey]
) -> list[SignatureCheck]:
    """Every signature of ``digest``, each checked against ``keys`` (empty: none is there)."""
    checks = []
    for entry in _signature_layers(store, digest):
        checks.append(_check(store, reference, digest, entry, keys))
    return checks


def verify_by_policy(
    store: Store,
    reference: Reference,
    digest: str,
    policy: str,
    keys: Sequence[TrustedKey],
) -> list[SignatureCheck]:
    """Apply ``policy`` to ``digest``'s signatures: raise (require) or log (warn) if none counts."""
    if policy not in TRUST_POLICIES:
        raise ValueError(f"trust policy {policy!r} is not one of {list(TRUST_POLICIES)}")
    if policy == "off":
        return []
    if not keys and policy == "require":
        raise UntrustedArtifactError(
            f"{reference.name}@{digest}: trust policy require, but no trusted keys are configured"
        )
    checks = signature_checks(store, reference, digest, keys)
    if any(check.verified for check in checks):
        return checks
    why = describe_failures(checks)
    message = f"{reference.name}@{digest} is not signed by a trusted key: {why}"
    if policy == "require":
        raise UntrustedArtifactError(message)
    log.warning("%s (trust policy warn: loading it anyway)", message)
    return checks


def refuse_unsigned_path(path: str, policy: str) -> None:
    """A local artifact path has no manifest, so nothing can sign it."""
    message = f"{path} is a local artifact: it has no manifest and so no signature"
    if policy == "require":
        raise UntrustedArtifactError(message)
    if policy == "warn":
        log.warning("%s (trust policy warn: loading it anyway)", message)


def describe_failures(checks: Sequence[SignatureCheck]) -> str:
    if not checks:
        return "it has no signature"
    return "; ".join(f"signature by {c.signer or 'unnamed'}: {c.problem}" for c in checks)


def _check(
    store: Store,
    reference: Reference,
    digest: str,
    entry: Mapping[str, object],
    keys: Sequence[TrustedKey],
) -> SignatureCheck:
    payload = _payload(store, entry)
    try:
        parsed = parse_payload(payload)
    except ArtifactError as error:
        return SignatureCheck(digest, "", None, None, str(error))
    claims = parsed.get("optional") or {}
    signer = str(claims.get(SIGNER_CLAIM, "")) if isinstance(claims, dict) else ""
    critical = parsed["critical"]
    if critical["image"]["docker-manifest-digest"] != digest:
        problem = f"it signs {critical['image']['docker-manifest-digest']}, not {digest}"
        return SignatureCheck(digest, signer, None, None, problem)
    named = critical["identity"]["docker-reference"]
    if named != repository_name(reference):
        problem = f"it signs {digest} in {named}, not in {repository_name(reference)}"
        return SignatureCheck(digest, signer, None, None, problem)
    signature = _signature_of(entry)
    if not signature:
        return SignatureCheck(digest, signer, None, None, "its layer has no signature")
    for trusted in keys:
        if verifies(trusted.key, payload, signature):
            return SignatureCheck(digest, signer, trusted.name, key_id(trusted.key), None)
    return SignatureCheck(digest, signer, None, None, "no trusted key verifies it")


def _signature_of(entry: Mapping[str, object]) -> str:
    annotations = entry.get("annotations")
    signature = annotations.get(SIGNATURE_ANNOTATION) if isinstance(annotations, dict) else None
    return signature if isinstance(signature, str) else ""


def _signature_layers(store: Store, digest: str) -> list[dict[str, object]]:
    """The layers of ``digest``'s signature manifest (at most MAX_SIGNATURES are read)."""
    try:
        data, _ = store.get_manifest(signature_tag(digest))
    except NotFoundError:
        return []
    manifest = parse_manifest(data, f"signatures of {digest}")
    layers = manifest.get("layers", [])
    if len(layers) > MAX_SIGNATURES:
        raise RegistryError(f"{digest} has {len(layers)} signatures, more than {MAX_SIGNATURES}")
    return [dict(layer) for layer in layers]


def _payload(store: Store, entry: Mapping[str, object]) -> bytes:
    size = entry.get("size")
    if not isinstance(size, int) or size > 64 * 1024:
        raise RegistryError(f"signature payload {entry.get('digest')} is too large ({size})")
    with tempfile.TemporaryDirectory(prefix="cuvil-signature-") as folder:
        path = Path(folder) / "payload"
        store.fetch_blob(str(entry["digest"]), path)
        data = path.read_bytes()
    if sha256_digest(data) != entry["digest"]:
        raise RegistryError(f"signature payload does not match its digest {entry['digest']}")
    return data


def _image_config(layer_digests: Sequence[str]) -> bytes:
    """The image config cosign writes beside its signature layers (verifiers ignore it)."""
    return json.dumps(
        {
            "architecture": "",
            "os": "",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": list(layer_digests)},
        },
        sort_keys=True,
    ).encode()


def sign_reference(
    reference: str,
    key: ec.EllipticCurvePrivateKey,
    signer: str,
    *,
    registry_config: ConfigArg = None,
) -> list[str]:
    """Sign the manifest ``reference`` names — for an index, the index and every entry (nodes
    verify the entry they pick); returns the digests signed."""
    ref = parse_model_reference(reference)
    store = open_store(ref, RegistryConfig.coerce(registry_config))
    digest = store.resolve(ref.reference)
    document = parse_manifest(store.get_manifest(digest)[0], str(ref))
    digests = [digest]
    if document.get("mediaType") == mt.OCI_INDEX:
        digests += [str(entry["digest"]) for entry in document.get("manifests", [])]
    for signed in digests:
        sign_manifest(store, ref, signed, key, signer)
    return digests


def check_reference(
    reference: str, keys: Sequence[TrustedKey], *, registry_config: ConfigArg = None
) -> list[SignatureCheck]:
    """The signatures of the manifest ``reference`` names, checked against ``keys``."""
    ref = parse_model_reference(reference)
    store = open_store(ref, RegistryConfig.coerce(registry_config))
    return signature_checks(store, ref, store.resolve(ref.reference), keys)


@dataclass(frozen=True)
class Signer:
    """The key a worker signs with (a mounted secret) and the name its signatures claim."""

    key: ec.EllipticCurvePrivateKey
    name: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Signer | None:
        """``CUVIL_SIGNING_KEY`` (a PEM file; unset: no signing), its password in the file
        ``CUVIL_SIGNING_KEY_PASSWORD_FILE`` if it is encrypted, ``CUVIL_SIGNER`` (the name)."""
        path = environ.get("CUVIL_SIGNING_KEY", "").strip()
        if not path:
            return None
        password_file = environ.get("CUVIL_SIGNING_KEY_PASSWORD_FILE", "").strip()
        password = Path(password_file).read_text().strip() if password_file else None
        return cls(load_private_key(path, password), environ.get("CUVIL_SIGNER") or "cuvil")

    def sign(self, reference: str, *, registry_config: ConfigArg = None) -> list[str]:
        return sign_reference(reference, self.key, self.name, registry_config=registry_config)

"""Signatures of manifests in cosign's key-pair format: the payload, the keys, sign and verify.

Cosign (Sigstore) signs an image or artifact manifest by pushing, at the tag
``sha256-<hex>.sig`` of the same repository, an OCI manifest whose layers are "simple signing"
payloads (``application/vnd.dev.cosign.simplesigning.v1+json``: the repository and the manifest
digest signed), each with its base64 ECDSA signature in the ``dev.cosignproject.cosign/signature``
annotation (https://github.com/sigstore/cosign/blob/main/specs/SIGNATURE_SPEC.md). That is what
``cosign verify --key cosign.pub --insecure-ignore-tlog`` checks, with no transparency log or
internet. Keys here are ECDSA P-256 (cosign's default): a PEM PKCS#8 private key (a mounted
secret, encrypted with a password or not) and PEM public keys to trust. This module is the
cryptography and the documents; ``cuvil.artifact.trust`` moves them to and from registries.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from cuvil.artifact.errors import ArtifactError

SIMPLE_SIGNING = "application/vnd.dev.cosign.simplesigning.v1+json"
SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
PAYLOAD_TYPE = "cosign container image signature"
SIGNER_CLAIM = "dev.cuvil.signer"  # in the payload's "optional" part: who says they signed


class SigningKeyError(ArtifactError):
    """A signing or public key cannot be read, or is not ECDSA P-256."""


@dataclass(frozen=True)
class TrustedKey:
    """A public key signatures are checked against; ``name`` says where it came from."""

    name: str
    key: ec.EllipticCurvePublicKey

    @property
    def key_id(self) -> str:
        return key_id(self.key)


def key_id(public_key: ec.EllipticCurvePublicKey) -> str:
    """sha256 of the key's SubjectPublicKeyInfo: a short name for a key, shown by inspect."""
    der = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(der).hexdigest()


def signature_tag(digest: str) -> str:
    """Cosign's tag for the signatures of ``digest``: ``sha256-<hex>.sig``."""
    algorithm, _, hexdigest = digest.partition(":")
    return f"{algorithm}-{hexdigest}.sig"


def simple_signing_payload(
    repository: str, digest: str, claims: Mapping[str, str] | None = None
) -> bytes:
    """The document a signature covers: this manifest digest, in this repository."""
    payload = {
        "critical": {
            "identity": {"docker-reference": repository},
            "image": {"docker-manifest-digest": digest},
            "type": PAYLOAD_TYPE,
        },
        "optional": dict(claims) if claims else None,
    }
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def parse_payload(data: bytes) -> dict[str, Any]:
    """A simple-signing payload, checked for the fields a verifier reads."""
    try:
        payload = json.loads(data)
        critical = payload["critical"]
        if critical["type"] != PAYLOAD_TYPE:
            raise ValueError(f"type {critical['type']!r}")
        str(critical["identity"]["docker-reference"])
        str(critical["image"]["docker-manifest-digest"])
    except (ValueError, KeyError, TypeError) as error:
        raise ArtifactError(f"not a cosign simple-signing payload: {error}") from None
    return dict(payload)


def load_private_key(path: str | Path, password: str | None = None) -> ec.EllipticCurvePrivateKey:
    """An ECDSA P-256 private key from a PEM file (PKCS#8 or SEC1, encrypted with a password
    or not), e.g. ``openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256``."""
    try:
        key = serialization.load_pem_private_key(
            Path(path).read_bytes(), password.encode() if password else None
        )
    except (OSError, ValueError, TypeError) as error:
        raise SigningKeyError(f"cannot read the signing key {path}: {error}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise SigningKeyError(f"the signing key {path} is not an ECDSA P-256 key")
    return key


def load_public_keys(paths: Sequence[str | Path]) -> list[TrustedKey]:
    """The PEM public keys in ``paths`` (files, or folders whose ``*.pub``/``*.pem`` files are
    read): the keys a node trusts."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix in (".pub", ".pem"))
        else:
            files.append(path)
    keys = []
    for file in files:
        try:
            key = serialization.load_pem_public_key(file.read_bytes())
        except (OSError, ValueError) as error:
            raise SigningKeyError(f"cannot read the trusted key {file}: {error}") from None
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
            raise SigningKeyError(f"the trusted key {file} is not an ECDSA P-256 public key")
        keys.append(TrustedKey(file.name, key))
    return keys


def sign(key: ec.EllipticCurvePrivateKey, payload: bytes) -> str:
    """The base64 ASN.1 DER ECDSA-SHA256 signature of ``payload`` (cosign's annotation value)."""
    return base64.b64encode(key.sign(payload, ec.ECDSA(hashes.SHA256()))).decode()


def verifies(key: ec.EllipticCurvePublicKey, payload: bytes, signature: str) -> bool:
    try:
        key.verify(base64.b64decode(signature, validate=True), payload, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        return False
    return True


def public_pem(key: ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey) -> bytes:
    public = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    return public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )

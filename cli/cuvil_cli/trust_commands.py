"""``cuvil sign REF --key KEY``, and the trust options ``pull`` and ``inspect`` share.

Signatures are cosign's key-pair format (``cuvil/artifact/signing.py``): what the worker writes
with ``CUVIL_SIGNING_KEY``, and what a node checks by ``CUVIL_TRUST_POLICY`` against
``CUVIL_TRUSTED_KEYS``. The options default to those variables.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from cuvil.artifact.trust import TRUST_POLICIES, TrustSettings
from cuvil_cli.oci_commands import add_registry_arguments, registry_config_from


def add_trust_arguments(parser: argparse.ArgumentParser, *, policy: bool = True) -> None:
    if policy:
        parser.add_argument(
            "--trust-policy",
            choices=TRUST_POLICIES,
            default=os.environ.get("CUVIL_TRUST_POLICY", "").strip().lower() or "off",
            help="check signatures first: warn, or require one by a trusted key "
            "(default $CUVIL_TRUST_POLICY or off)",
        )
    parser.add_argument(
        "--trusted-key",
        action="append",
        default=None,
        metavar="PEM",
        help="public key (or folder of *.pub/*.pem) to trust; repeatable "
        "(default: $CUVIL_TRUSTED_KEYS, comma-separated)",
    )


def trust_from(args: argparse.Namespace, policy: str | None = None) -> TrustSettings:
    paths = args.trusted_key
    if paths is None:
        paths = [p for p in os.environ.get("CUVIL_TRUSTED_KEYS", "").split(",") if p.strip()]
    return TrustSettings.load(policy or args.trust_policy, paths)


def register(subparsers: argparse._SubParsersAction) -> None:
    sign = subparsers.add_parser("sign", help="sign an artifact's manifest (cosign's format)")
    sign.add_argument("ref", help="registry reference or OCI layout; an index signs its entries")
    sign.add_argument("--key", type=Path, required=True, help="ECDSA P-256 private key (PEM)")
    sign.add_argument("--password-file", type=Path, help="file holding the key's password")
    sign.add_argument("--signer", default="cuvil", help="the name the signature claims")
    add_registry_arguments(sign)
    sign.set_defaults(handler=run_sign)


def run_sign(args: argparse.Namespace) -> int:
    from cuvil.artifact.signing import load_private_key
    from cuvil.artifact.trust import sign_reference

    password = args.password_file.read_text().strip() if args.password_file else None
    key = load_private_key(args.key, password)
    signed = sign_reference(args.ref, key, args.signer, registry_config=registry_config_from(args))
    for digest in signed:
        print(f"signed {digest} as {args.signer}")
    return 0

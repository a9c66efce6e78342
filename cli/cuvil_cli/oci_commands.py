"""``cuvil push PATH REF`` and ``cuvil pull REF -o PATH``: artifacts to and from OCI registries.

REF is ``host[:port]/repo[:tag]`` (loopback registries speak plain HTTP; others need
``--plain-http`` for HTTP) or a local OCI layout ``oci:DIR[:tag]``. Credentials come from a docker
config file (``--registry-config``, default ``$CUVIL_REGISTRY_CONFIG`` or ~/.docker/config.json).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from cuvil.artifact.registry_config import RegistryConfig
from cuvil_cli.pairs import key_values


def add_registry_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--registry-config",
        type=Path,
        help="docker config.json with credentials (default: $CUVIL_REGISTRY_CONFIG, "
        "~/.docker/config.json)",
    )
    parser.add_argument("--ca-bundle", type=Path, help="CA bundle to trust for the registry's TLS")
    parser.add_argument(
        "--plain-http", action="store_true", help="speak HTTP to a non-loopback registry"
    )


def registry_config_from(args: argparse.Namespace) -> RegistryConfig:
    config = RegistryConfig.from_env()
    if getattr(args, "registry_config", None):
        config = replace(config, docker_config=args.registry_config)
    if getattr(args, "ca_bundle", None):
        config = replace(config, ca_bundle=args.ca_bundle)
    if getattr(args, "plain_http", False):
        config = replace(config, plain_http=True)
    return config


def register(subparsers: argparse._SubParsersAction) -> None:
    from cuvil_cli.trust_commands import add_trust_arguments  # it imports this module

    push = subparsers.add_parser("push", help="push an artifact (or several targets) to a registry")
    push.add_argument("paths", nargs="+", metavar="PATH", help="artifact file(s) or directories")
    push.add_argument("ref", help="host[:port]/repo[:tag] or oci:DIR[:tag]")
    push.add_argument("--annotation", action="append", default=[], metavar="KEY=VALUE")
    push.add_argument("--json", action="store_true", help="print the result as JSON")
    add_registry_arguments(push)
    push.set_defaults(handler=run_push)

    pull = subparsers.add_parser("pull", help="pull an artifact for this machine's target")
    pull.add_argument("ref", help="registry reference or OCI layout, by tag or digest")
    pull.add_argument("-o", "--output", required=True, help="directory, or a .cuvil/.tar file")
    pull.add_argument("--target", help="pick this index entry instead of probing the machine")
    pull.add_argument("--cache-dir", type=Path, help="node cache (default $CUVIL_CACHE_DIR)")
    add_registry_arguments(pull)
    add_trust_arguments(pull)
    pull.set_defaults(handler=run_pull)


def run_push(args: argparse.Namespace) -> int:
    from cuvil.artifact import push_artifact, push_index
    from cuvil.artifact.reference import parse_target_reference

    config = registry_config_from(args)
    annotations = key_values(args.annotation, "--annotation")
    if len(args.paths) == 1:
        results = [
            push_artifact(args.paths[0], args.ref, registry_config=config, annotations=annotations)
        ]
    else:  # several targets: untagged manifests, then an index carrying the tag
        untagged = parse_target_reference(args.ref).name
        entries = [
            push_artifact(path, untagged, registry_config=config, annotations=annotations)
            for path in args.paths
        ]
        results = [*entries, push_index(args.ref, entries, registry_config=config)]
    if args.json:
        print(json.dumps([result.to_json() for result in results], indent=2))
        return 0
    for result in results:
        what = result.target or "index"
        print(f"pushed {what}: {result.ref} ({result.size} bytes manifest)")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from cuvil.artifact import pull_artifact
    from cuvil.artifact.api import resolve
    from cuvil_cli.trust_commands import trust_from

    config = registry_config_from(args)
    trust = trust_from(args)
    found = resolve(
        args.ref, cache_dir=args.cache_dir, registry_config=config, target=args.target, trust=trust
    )
    path = pull_artifact(
        args.ref,
        args.output,
        registry_config=config,
        target=args.target,
        cache_dir=args.cache_dir,
        trust=trust,
    )
    how = "downloaded" if found.downloaded else "from the node cache"
    print(f"pulled {args.ref} ({found.digest}, {how}) -> {path}")
    return 0


def print_description(described: dict[str, Any]) -> None:
    """``cuvil inspect REF``: what the registry holds, without downloading the weights."""
    print(f"{described['reference']}  {described['digest']}")
    print(f"  {described['mediaType']}  artifactType={described.get('artifactType')}")
    for key, value in sorted(described.get("annotations", {}).items()):
        print(f"  {key}: {value}")
    for entry in described.get("targets", []):
        mark = "*" if entry["digest"] == described.get("selected") else " "
        print(f" {mark}target {entry['target']}  precision={entry['precision']}  {entry['digest']}")
        for referrer in entry["referrers"]:
            print(f"      referrer {referrer['artifact_type']}  {referrer['digest']}")
        for signature in entry.get("signatures", []):
            print(f"      {describe_signature(signature)}")
    if "targets" in described:
        print(f"  (* = picked for this machine: {', '.join(described['machine_targets'])})")
    config = described.get("config")
    if config:
        print(
            f"  {config.get('name')}  target={config.get('target')}  "
            f"precision={config.get('precision')}  cuvil {config.get('cuvil_version')}"
        )
    for name, entry in sorted(described.get("files", {}).items()):
        print(f"  {name}: {entry['size']} bytes {entry['digest']}")
    for referrer in described.get("referrers", []):
        print(f"  referrer {referrer['artifact_type']}  {referrer['digest']}")
    for signature in described.get("signatures", []):
        print(f"  {describe_signature(signature)}")
    if not described.get("signatures") and "targets" not in described:
        print("  signed: no")


def describe_signature(check: dict[str, Any]) -> str:
    """One signature as inspect shows it: who it claims, and whether a trusted key verified it."""
    signer = check["signer"] or "(no signer named)"
    if check["problem"] is None:
        return f"signed by {signer}: verified with {check['trusted_key']} ({check['key_id']})"
    return f"signed by {signer}: NOT verified: {check['problem']}"

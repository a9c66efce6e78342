"""``describe_reference``: what ``cuvil inspect REF`` shows, without downloading the weights."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cuvil.artifact import media_types as mt
from cuvil.artifact.api import ConfigArg, parse_model_reference
from cuvil.artifact.cache import artifact_files
from cuvil.artifact.errors import NoMatchingTargetError
from cuvil.artifact.manifests import parse_manifest
from cuvil.artifact.referrers import list_referrers_in
from cuvil.artifact.registry_config import RegistryConfig
from cuvil.artifact.store import open_store
from cuvil.artifact.targets import entry_target, probe_targets, select_entry


def describe_reference(
    reference: str, *, registry_config: ConfigArg = None, trusted_keys: Sequence[Any] = ()
) -> dict[str, Any]:
    """Manifest or index, targets, annotations, referrers and signatures of a reference (each
    signature checked against ``trusted_keys``, ``cuvil.artifact.signing.TrustedKey``s)."""
    from cuvil.artifact.trust import signature_checks

    ref = parse_model_reference(reference)
    store = open_store(ref, RegistryConfig.coerce(registry_config))

    def signatures(digest: str) -> list[dict[str, Any]]:
        return [vars(check) for check in signature_checks(store, ref, digest, trusted_keys)]

    digest = store.resolve(ref.reference)
    data, _ = store.get_manifest(digest)
    document = parse_manifest(data, str(ref))
    described: dict[str, Any] = {
        "reference": str(ref),
        "digest": digest,
        "mediaType": document.get("mediaType"),
        "artifactType": document.get("artifactType"),
        "annotations": document.get("annotations", {}),
        "referrers": [vars(r) for r in list_referrers_in(store, digest, None)],
        "signatures": signatures(digest),
    }
    children = document.get("manifests") if document.get("mediaType") == mt.OCI_INDEX else None
    if children is None:
        described["files"] = {
            name: {"digest": d["digest"], "size": d["size"], "mediaType": d["mediaType"]}
            for name, d in artifact_files(document).items()
        }
        with tempfile.TemporaryDirectory(prefix="cuvil-inspect-") as folder:
            store.fetch_blob(document["config"]["digest"], Path(folder) / "config.json")
            described["config"] = json.loads((Path(folder) / "config.json").read_text())
        return described
    described["targets"] = [
        {
            "target": entry_target(entry),
            "precision": entry.get("annotations", {}).get(mt.ANNOTATION_PRECISION),
            "digest": entry["digest"],
            "size": entry["size"],
            "referrers": [vars(r) for r in list_referrers_in(store, entry["digest"], None)],
            "signatures": signatures(entry["digest"]),
        }
        for entry in children
    ]
    try:
        described["selected"] = select_entry(children)["digest"]
    except NoMatchingTargetError:
        described["selected"] = None
    described["machine_targets"] = probe_targets()
    return described

"""Referrers through the tag schema (the registry has no referrers API), and the local layout."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cuvil.artifact import (
    NotFoundError,
    attach_referrer,
    fetch_referrer,
    list_referrers,
    push_artifact,
    push_index,
    resolve_digest,
)
from cuvil.artifact import media_types as mt
from cuvil.artifact.api import resolve
from cuvil.artifact.describe import describe_reference
from cuvil.artifact.files import ArtifactContents
from cuvil.artifact.manifests import referrers_tag
from cuvil.artifact.registry_config import RegistryConfig
from tests.cuvil.artifact.conftest import artifact_files
from tests.fixtures.registry import RunningRegistry

NO_CREDENTIALS = RegistryConfig(docker_config=None)
SIGNATURE = "application/vnd.cuvil.signature.v1"


def test_registry_has_no_referrers_api(registry: RunningRegistry) -> None:
    """Why the tag schema: Distribution 2.8 answers 404 on the referrers endpoint."""
    url = f"{registry.url}/v2/models/mlp/referrers/sha256:{'0' * 64}"
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(url, timeout=5)
    assert caught.value.code == 404


def test_attach_and_list_referrers(
    registry: RunningRegistry, tiny_contents: ArtifactContents
) -> None:
    files = artifact_files(tiny_contents, "cpu-x86_64", name="referred")
    pushed = push_artifact(files, f"{registry.host}/ref/mlp:v1", registry_config=NO_CREDENTIALS)
    report = json.dumps({"max_abs_error": 1e-6}).encode()
    first = attach_referrer(
        pushed.ref,
        report,
        media_type=mt.REPORT,
        artifact_type=mt.REPORT,
        annotations={"dev.cuvil.stage": "verify"},
        registry_config=NO_CREDENTIALS,
    )
    second = attach_referrer(
        f"{registry.host}/ref/mlp:v1",  # by tag: resolved to the same subject
        b"signature-bytes",
        media_type="application/octet-stream",
        artifact_type=SIGNATURE,
        registry_config=NO_CREDENTIALS,
    )
    again = attach_referrer(
        pushed.ref,
        report,
        media_type=mt.REPORT,
        artifact_type=mt.REPORT,
        annotations={"dev.cuvil.stage": "verify"},
        registry_config=NO_CREDENTIALS,
    )
    assert again == first  # deterministic, listed once
    listed = list_referrers(pushed.ref, registry_config=NO_CREDENTIALS)
    assert [(r.digest, r.artifact_type) for r in listed] == [
        (first, mt.REPORT),
        (second, SIGNATURE),
    ]
    assert listed[0].annotations == {"dev.cuvil.stage": "verify"}
    only = list_referrers(pushed.ref, artifact_type=SIGNATURE, registry_config=NO_CREDENTIALS)
    assert [r.digest for r in only] == [second]
    assert fetch_referrer(pushed.ref, first, registry_config=NO_CREDENTIALS) == report
    # The fallback tag holds an index of the referrers; each names the subject.
    tag = referrers_tag(pushed.digest)
    assert resolve_digest(f"{registry.host}/ref/mlp:{tag}", registry_config=NO_CREDENTIALS)
    described = describe_reference(pushed.ref, registry_config=NO_CREDENTIALS)
    assert {r["digest"] for r in described["referrers"]} == {first, second}


def test_local_layout_has_the_same_api(tiny_contents: ArtifactContents, tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    files = {t: artifact_files(tiny_contents, t) for t in ("cpu-x86_64", "cuda-sm_80")}
    pushed = [push_artifact(f, f"oci:{layout}") for f in files.values()]
    index = push_index(f"oci:{layout}:v1", pushed)
    assert (layout / "oci-layout").is_file()
    entries = json.loads((layout / "index.json").read_text())["manifests"]
    assert [e["annotations"][mt.ANNOTATION_REF_NAME] for e in entries] == ["v1"]
    assert entries[0]["digest"] == index.digest

    # Without the oci: prefix an existing layout directory is recognised, with :tag or @digest.
    pulled = resolve(f"{layout}:v1", cache_dir=tmp_path / "cache")
    assert pulled.digest == pushed[0].digest
    assert (pulled.path / mt.CONFIG_FILE).read_bytes() == files["cpu-x86_64"][mt.CONFIG_FILE]
    by_digest = resolve(f"{layout}@{pushed[1].digest}", cache_dir=tmp_path / "cache")
    assert (by_digest.path / mt.WEIGHTS_FILE).read_bytes() == files["cuda-sm_80"][mt.WEIGHTS_FILE]
    assert resolve_digest(f"oci:{layout}:v1") == index.digest

    attach_referrer(
        f"oci:{layout}@{pushed[0].digest}", b"{}", media_type=mt.REPORT, artifact_type=mt.REPORT
    )
    assert len(list_referrers(f"oci:{layout}@{pushed[0].digest}")) == 1
    with pytest.raises(NotFoundError):
        resolve(f"oci:{layout}:nope", cache_dir=tmp_path / "cache")

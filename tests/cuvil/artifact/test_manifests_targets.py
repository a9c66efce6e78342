"""Pure parts: manifest and index builders, references, target probing and selection."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuvil.artifact import NoMatchingTargetError, select_entry
from cuvil.artifact import media_types as mt
from cuvil.artifact.manifests import (
    build_artifact_manifest,
    build_index,
    canonical_json,
    parse_manifest,
    validate_manifest,
)
from cuvil.artifact.reference import (
    is_layout_reference,
    looks_like_registry_reference,
    parse_registry_reference,
)
from cuvil.artifact.targets import cpu_flags, cpu_targets, cuda_targets

FILES = {
    mt.CONFIG_FILE: json.dumps({"target": "cpu-x86_64", "precision": "fp32", "name": "m"}).encode(),
    mt.GRAPH_FILE: b'{"nodes": []}',
    mt.WEIGHTS_FILE: b"weights",
}


def _entry(target: str, digest_char: str = "a") -> dict:
    return {
        "mediaType": mt.OCI_MANIFEST,
        "digest": "sha256:" + digest_char * 64,
        "size": 10,
        "annotations": {mt.ANNOTATION_TARGET: target},
    }


def test_artifact_manifest_shape_and_determinism() -> None:
    manifest, blobs = build_artifact_manifest(FILES)
    assert manifest["artifactType"] == mt.ARTIFACT_TYPE
    assert manifest["config"]["mediaType"] == mt.CONFIG
    assert [layer["annotations"][mt.ANNOTATION_TITLE] for layer in manifest["layers"]] == [
        mt.GRAPH_FILE,
        mt.WEIGHTS_FILE,
    ]
    assert manifest["annotations"][mt.ANNOTATION_TARGET] == "cpu-x86_64"
    assert [b.digest for b in blobs] == [manifest["config"]["digest"]] + [
        layer["digest"] for layer in manifest["layers"]
    ]
    again, _ = build_artifact_manifest(dict(reversed(list(FILES.items()))))
    assert canonical_json(again) == canonical_json(manifest)


def test_builders_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        build_artifact_manifest({mt.GRAPH_FILE: b"{}"})
    with pytest.raises(ValueError, match="unknown artifact files"):
        build_artifact_manifest({**FILES, "model.pt": b"pickle"})
    with pytest.raises(ValueError, match="more than one"):
        build_index([_entry("cpu"), _entry("cpu", "b")])
    with pytest.raises(ValueError, match="target annotation"):
        build_index([{"mediaType": mt.OCI_MANIFEST, "digest": "sha256:" + "a" * 64, "size": 1}])
    with pytest.raises(ValueError, match="invalid OCI manifest at config/digest"):
        validate_manifest(
            {
                "schemaVersion": 2,
                "mediaType": mt.OCI_MANIFEST,
                "layers": [],
                "config": {"mediaType": mt.CONFIG, "digest": "md5:x", "size": 1},
            }
        )
    with pytest.raises(ValueError, match="not JSON"):
        parse_manifest(b"<html>", "somewhere")


def test_index_is_sorted_by_target() -> None:
    index = build_index([_entry("cuda-sm_90", "b"), _entry("cpu-x86_64")])
    assert [e["annotations"][mt.ANNOTATION_TARGET] for e in index["manifests"]] == [
        "cpu-x86_64",
        "cuda-sm_90",
    ]


def test_probe_ranks_isa_and_gpu_architectures() -> None:
    sapphire = "processor : 0\nflags : fpu sse avx2 avx512f amx_tile amx_bf16 amx_int8\n"
    assert cpu_targets("x86_64", cpu_flags(sapphire)) == [
        "cpu-x86_64-amx",
        "cpu-x86_64-avx512",
        "cpu-x86_64",
        "cpu",
    ]
    assert cpu_targets("x86_64", cpu_flags("flags : avx2\n")) == ["cpu-x86_64", "cpu"]
    assert cpu_targets("aarch64", []) == ["cpu-aarch64", "cpu"]
    orin = cuda_targets([(8, 7)])
    assert orin[:3] == ["cuda-sm_87a", "cuda-sm_87", "cuda-sm_86"] and "cuda-sm_80" in orin
    assert "cuda-sm_80" not in cuda_targets([(9, 0)])  # an sm_80 cubin does not run on sm_90


def test_selection_picks_the_machines_best_entry() -> None:
    entries = [_entry("cpu-x86_64"), _entry("cpu-x86_64-amx", "b"), _entry("cuda-sm_80", "c")]
    amx_machine = cpu_targets("x86_64", {"amx_tile", "amx_bf16", "avx512f"})
    assert select_entry(entries, amx_machine)["digest"].endswith("b")
    assert select_entry(entries, cpu_targets("x86_64", {"avx2"}))["digest"].endswith("a")
    orin = cuda_targets([(8, 7)]) + cpu_targets("aarch64", [])
    assert select_entry(entries, orin)["digest"].endswith("c")
    with pytest.raises(NoMatchingTargetError, match=r"offers targets \['cpu-x86_64'"):
        select_entry(entries, cpu_targets("aarch64", []))


def test_a_node_with_a_gpu_serves_its_cuda_entry_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from cuvil.artifact import targets

    entries = [_entry("cpu-x86_64"), _entry("cuda-sm_90", "b"), _entry("cuda-sm_87", "c")]
    cpu = tuple(cpu_targets("x86_64", {"avx2"}))
    monkeypatch.setattr(targets, "machine_targets", lambda: (cpu, tuple(cuda_targets([(9, 0)]))))
    monkeypatch.delenv("CUVIL_CUDA_EXECUTOR", raising=False)
    assert targets.probe_targets()[0] == "cuda-sm_90a"
    assert select_entry(entries)["digest"].endswith("b")
    monkeypatch.setenv("CUVIL_CUDA_EXECUTOR", "interpreter")  # CUDA plans on the CPU: CPU first
    assert select_entry(entries)["digest"].endswith("a")
    monkeypatch.setattr(targets, "machine_targets", lambda: (cpu, ()))
    monkeypatch.delenv("CUVIL_CUDA_EXECUTOR")
    assert select_entry(entries)["digest"].endswith("a")


def test_references() -> None:
    ref = parse_registry_reference("127.0.0.1:5000/models/mlp:v1")
    assert (ref.registry, ref.repository, ref.tag, ref.is_loopback) == (
        "127.0.0.1:5000",
        "models/mlp",
        "v1",
        True,
    )
    assert not parse_registry_reference("ghcr.io/org/mlp@sha256:" + "a" * 64).is_loopback
    assert looks_like_registry_reference("localhost:5000/m")
    assert not looks_like_registry_reference("models/mlp:v1")  # no host: never sent anywhere
    assert is_layout_reference("oci:some/dir:v1")
    with pytest.raises(ValueError, match="digest"):
        parse_registry_reference("r.io/m@sha256:short")


@settings(deadline=None, max_examples=50)
@given(st.dictionaries(st.sampled_from(["a", "b", "c"]), st.text(max_size=5), max_size=3))
def test_annotations_never_change_the_layers(annotations: dict[str, str]) -> None:
    plain, _ = build_artifact_manifest(FILES)
    annotated, _ = build_artifact_manifest(FILES, annotations)
    assert annotated["layers"] == plain["layers"] and annotated["config"] == plain["config"]
    assert all(annotated["annotations"][k] == v for k, v in annotations.items())

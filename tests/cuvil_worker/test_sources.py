"""Model sources of a spec: builtin, HF directory, PVC, bundled hub id, OCI source bundle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from cuvil_cli.main import main as cuvil_main
from cuvil_cli.spec import load_factory_spec

from cuvil.frontend.source_bundle import (
    SourceBundleError,
    fetch_source_bundle,
    push_source_bundle,
)
from cuvil.frontend.sources import SourceError, load_source
from tests.fixtures.registry import RunningRegistry

TEXT_INPUTS = {
    "inputs": [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]},
        {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"]},
    ],
    "dynamicDims": {"batch": {"min": 1, "max": 8}, "seq": {"min": 4, "max": 64}},
}


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer BERT with random weights, saved as a HF directory (safetensors)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("tiny-bert")
    BertModel(config).eval().save_pretrained(directory, safe_serialization=True)
    return directory


def test_builtin_with_spec_inputs_keeps_dims_symbolic() -> None:
    spec = {
        "source": {"builtin": {"name": "mlp"}},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 784]}],
        "dynamicDims": {"batch": {"min": 1, "max": 64}},
    }
    loaded = load_source(spec)
    assert loaded.example_inputs["x"].shape == (2, 784)  # >= 2: export keeps batch symbolic
    dim = loaded.dynamic_shapes["x"][0]
    assert (dim.min, dim.max) == (1, 64)
    samples = loaded.sample_inputs(4)
    assert len(samples) == 4 and all(1 <= s["x"].shape[0] <= 64 for s in samples)
    assert max(s["x"].shape[0] for s in loaded.sample_inputs(20)) > 16


def test_samples_can_keep_every_dynamic_dim_small() -> None:
    """What a CUDA target verified by interpretation draws: dims at most the limit, never under
    their minimum."""
    spec = {
        "source": {"builtin": {"name": "mlp"}},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 784]}],
        "dynamicDims": {"batch": {"min": 1, "max": 64}},
    }
    small = load_source(spec).sample_inputs(20, largest=16)
    assert all(s["x"].shape[0] <= 16 for s in small[1:])
    spec["dynamicDims"] = {"batch": {"min": 32, "max": 64}}
    assert all(s["x"].shape[0] == 32 for s in load_source(spec).sample_inputs(5, largest=16)[1:])


def test_builtin_without_inputs_uses_the_factory_examples() -> None:
    loaded = load_source({"source": {"builtin": {"name": "mlp"}}})
    assert isinstance(loaded.example_inputs, tuple) and loaded.example_inputs[0].shape[0] == 2


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"source": {"builtin": {"name": "nope"}}}, "no bundled model"),
        ({"source": {"url": "https://example.com/m"}}, "need a fetcher"),
        ({"source": {}}, "exactly one"),
        ({"source": {"builtin": {"name": "mlp"}, "url": "x"}}, "exactly one"),
        (
            {"source": {"builtin": {"name": "mlp"}},
             "inputs": [{"name": "x", "dtype": "float32", "shape": ["rows", 784]}]},
            "not in dynamicDims",
        ),
        (
            {"source": {"builtin": {"name": "mlp"}},
             "inputs": [{"name": "x", "dtype": "complex64", "shape": [2, 784]}]},
            "unknown",
        ),
        ({"source": {"huggingface": {"model": "no-such/model-here"}}, **TEXT_INPUTS}, "locally"),
        (
            {"source": {"builtin": {"name": "mlp"}},
             "inputs": [{"name": "pixels", "dtype": "float32", "shape": [2, 784]}]},
            r"spec\.inputs\[0\]\.name: MLP\.forward takes no input 'pixels'; its inputs are"
            r" \['x'\]",
        ),
    ],
)  # fmt: skip
def test_bad_sources_say_what_is_wrong(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_source(spec)


def test_a_transformers_model_is_held_to_its_named_inputs(tiny_bert: Path) -> None:
    spec = {
        "source": {"huggingface": {"model": str(tiny_bert)}},
        "inputs": [{"name": "token_ids", "dtype": "int64", "shape": [2, 8]}],
    }
    with pytest.raises(ValueError, match=r"spec\.inputs\[0\]\.name: BertModel\.forward"):
        load_source(spec)


def test_huggingface_directory_and_pvc(tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_source({"source": {"huggingface": {"model": str(tiny_bert)}}, **TEXT_INPUTS})
    assert type(loaded.model).__name__ == "BertModel"
    ids = loaded.example_inputs["input_ids"]
    assert ids.shape == (2, 4) and int(ids.max()) < 100  # token ids inside the vocabulary

    monkeypatch.setenv("CUVIL_VOLUMES_DIR", str(tiny_bert.parent))
    pvc = {"pvc": {"claimName": tiny_bert.name, "path": "."}}
    assert type(load_source({"source": pvc, **TEXT_INPUTS}).model).__name__ == "BertModel"
    escape = {"pvc": {"claimName": tiny_bert.name, "path": "../../etc"}}
    with pytest.raises(SourceError, match="leaves the volume"):
        load_source({"source": escape, **TEXT_INPUTS})


def test_minilm_hub_id_maps_to_the_bundled_weights() -> None:
    source = {"huggingface": {"model": "sentence-transformers/all-MiniLM-L6-v2"}}
    loaded = load_source({"source": source, **TEXT_INPUTS})
    assert loaded.vocab_size == 30522
    assert loaded.example_inputs["input_ids"].shape == (2, 4)


def test_oci_source_bundle_round_trip(
    tiny_bert: Path, registry: RunningRegistry, tmp_path: Path
) -> None:
    ref = f"{registry.host}/sources/tiny-bert:v1"
    digest = push_source_bundle(tiny_bert, ref)
    assert digest.startswith("sha256:")
    fetched = fetch_source_bundle(ref, tmp_path / "fetched")
    assert (fetched / "model.safetensors").read_bytes() == (
        tiny_bert / "model.safetensors"
    ).read_bytes()

    def fetcher(requested: str) -> Path:
        assert requested == ref
        return fetch_source_bundle(requested, tmp_path / "by-worker")

    loaded = load_source({"source": {"oci": {"ref": ref}}, **TEXT_INPUTS}, bundle_fetcher=fetcher)
    assert type(loaded.model).__name__ == "BertModel"
    with pytest.raises(SourceError, match="registry client"):
        load_source({"source": {"oci": {"ref": ref}}, **TEXT_INPUTS})

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    (pickled / "pytorch_model.bin").write_bytes(b"not data")
    with pytest.raises(SourceBundleError, match="data only"):
        push_source_bundle(pickled, f"{registry.host}/sources/bad:v1")


MLP_YAML = """\
apiVersion: cuvil.dev/v1alpha1
kind: ModelCompilation
metadata: {name: mlp-yaml, namespace: default}
spec:
  source: {builtin: {name: mlp}}
  inputs: [{name: x, dtype: float32, shape: [batch, 784]}]
  dynamicDims: {batch: {min: 1, max: 16}}
  targets: [cpu-x86_64]
  precision: fp32
  output: {repository: 127.0.0.1:5000/models/mlp, tag: v1}
"""


def test_cuvil_compile_takes_the_kubectl_yaml(tmp_path: Path) -> None:
    manifest = tmp_path / "mlp.yaml"
    manifest.write_text(MLP_YAML)
    spec = load_factory_spec(str(manifest))
    assert spec.name == "mlp-yaml" and spec.metadata["targets"] == ["cpu-x86_64"]
    assert cuvil_main(["compile", str(manifest), "-o", str(tmp_path / "mlp.cuvil")]) == 0
    import cuvil

    compiled = cuvil.load(tmp_path / "mlp.cuvil")
    x = torch.randn(5, 784)
    torch.testing.assert_close(compiled(x), spec.model(x))

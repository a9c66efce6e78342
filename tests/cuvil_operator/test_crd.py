"""The CRD: one source (crd.py), the chart file generated from it, a schema that bites."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from cuvil_operator import crd

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _spec(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((REPO / "examples" / name).read_text())["spec"])


def test_chart_crd_file_is_generated_from_crd_py() -> None:
    path = REPO / crd.CHART_CRD_PATH
    assert path.read_text() == crd.render_crd(), "run: python -m cuvil_operator.crd --write"
    assert yaml.safe_load(path.read_text()) == crd.build_crd()
    check = [sys.executable, "-m", "cuvil_operator.crd", "--check", "--root", str(REPO)]
    assert subprocess.run(check, capture_output=True).returncode == 0


def test_crd_names_subresource_and_printer_columns() -> None:
    spec = crd.build_crd()["spec"]
    assert spec["names"]["shortNames"] == ["mc"] and spec["scope"] == "Namespaced"
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Ready", "Phase", "Targets", "Speedup", "Served", "Age"]
    wide = [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority")]
    assert wide == ["Promoted", "Digest", "Message"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_passes_the_crd_schema(path: Path) -> None:
    manifest = yaml.safe_load(path.read_text())
    assert manifest["apiVersion"] == crd.API_VERSION and manifest["kind"] == crd.KIND
    jsonschema.validate(manifest["spec"], crd.spec_schema())


def _bad(path: str, value: Any) -> dict[str, Any]:
    spec = _spec("minilm-cpu.yaml")
    node = spec
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is KeyError:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return spec


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("targets", ["tpu-v5"]),
        ("targets", []),
        ("precision", "int4"),
        ("inputs", []),
        ("output", KeyError),
        ("source", {}),
        ("validation", {"samples": 0}),
        ("gates", {"minCosine": 1.5}),
        ("dynamicDims", {"batch": {"min": 0, "max": 4}}),
    ],
)
def test_schema_rejects(path: str, value: Any) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(_bad(path, value), crd.spec_schema())


def test_schema_rejects_two_sources_and_bad_dtype() -> None:
    spec = _spec("minilm-cpu.yaml")
    two = copy.deepcopy(spec)
    two["source"]["builtin"] = {"name": "resnet50"}
    bad_dtype = copy.deepcopy(spec)
    bad_dtype["inputs"][0]["dtype"] = "float64"
    for candidate in (two, bad_dtype):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(candidate, crd.spec_schema())


def test_operator_never_imports_the_compiler() -> None:
    """It reads the target and precision vocabulary (cuvil.targets, cuvil.precisions), no more."""
    compiler = ("torch", "cuvil.api", "cuvil.pipeline", "cuvil.runtime", "cuvil.artifact")
    code = (
        "import sys, cuvil_operator.main\n"
        f"bad = [m for m in {compiler!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert 'cuvil.targets' in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_field_is_described() -> None:
    """kubectl explain has something to say at every level."""
    from cuvil_operator.crd import build_crd

    missing: list[str] = []

    def walk(node: Any, path: str) -> None:
        if path and "description" not in node:
            missing.append(path)
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{key}" if path else key)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], f"{path}[]" if key == "items" else f"{path}.*")

    walk(build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "")
    assert missing == []

"""CUVIL_MODEL_FILE: the reference is read from a file on every question, CUVIL_MODEL when the
file is missing or empty."""

from __future__ import annotations

from pathlib import Path

from cuvil_sidecar.config import SidecarConfig
from cuvil_sidecar.source import ModelSource


def test_the_file_wins_when_it_names_a_reference(tmp_path: Path) -> None:
    named = tmp_path / "ref"
    source = ModelSource("registry.example.com/m@sha256:" + "a" * 64, None, named)
    assert source.reference == source.default_reference  # no file yet
    named.write_text("  \n")
    assert source.reference == source.default_reference  # empty
    named.write_text("registry.example.com/m@sha256:" + "b" * 64 + "\n")
    assert source.reference.endswith("b" * 64) and str(source) == source.reference


def test_config_reads_the_file_setting() -> None:
    config = SidecarConfig.from_env({"CUVIL_MODEL": "m", "CUVIL_MODEL_FILE": "/etc/cuvil/ref"})
    assert config.model_file == Path("/etc/cuvil/ref")
    assert SidecarConfig.from_env({"CUVIL_MODEL": "m"}).model_file is None

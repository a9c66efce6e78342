"""Warm-up covers what will be served: the operator's extra shapes (CUVIL_WARMUP_SHAPES) swept over
the batch sizes and settled, the batch sizes between powers of two built once; a request at any of
them then meets no kernel choice still being timed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from cuvil_sidecar.config import ConfigError, SidecarConfig
from cuvil_sidecar.source import ModelSource
from cuvil_sidecar.startup import (
    StartupError,
    bucket_inputs,
    load_checked,
    primed_buckets,
    shape_buckets,
)

import cuvil
from cuvil.runtime.model import CompiledModel


def test_warmup_shapes_from_the_environment() -> None:
    config = SidecarConfig.from_env(
        {"CUVIL_MODEL": "m", "CUVIL_WARMUP_SHAPES": " seq=128 ; seq=64, batch=2 ;"}
    )
    assert config.warmup_shapes == ({"seq": 128}, {"seq": 64, "batch": 2})
    assert SidecarConfig.from_env({"CUVIL_MODEL": "m"}).warmup_shapes == ()
    for bad in ("seq", "seq=0", "seq=x", "1x=3", "seq=128;batch"):
        with pytest.raises(ConfigError, match=r"CUVIL_WARMUP_SHAPES: .* is not symbol=size"):
            SidecarConfig.from_env({"CUVIL_MODEL": "m", "CUVIL_WARMUP_SHAPES": bad})


def test_batch_sizes_between_powers_of_two_are_primed(mlp_artifact: Path) -> None:
    model = cuvil.load(mlp_artifact)
    settled = shape_buckets(model, "batch", 8)
    assert [bucket["batch"] for bucket in settled] == [2, 1, 4, 8]  # golden batch first
    assert [bucket["batch"] for bucket in primed_buckets(model, "batch", settled)] == [3, 5, 6, 7]
    settled = shape_buckets(model, "batch", 6)
    assert [bucket["batch"] for bucket in primed_buckets(model, "batch", settled)] == [3, 5]
    assert primed_buckets(model, None, settled) == []
    with pytest.raises(StartupError, match=r"names \['seq'\]; the model has \['batch'\]"):
        shape_buckets(model, "batch", 8, ({"seq": 128},))


def test_served_shapes_meet_no_open_kernel_choice(minilm_artifact: Path) -> None:
    loaded = load_checked(
        ModelSource(str(minilm_artifact)),
        source_digest="sha256:test",
        max_rows=4,
        warmup_runs=1,
        golden_tolerance=1e-3,
        warmup_shapes=({"seq": 40},),
    )
    model = loaded.model
    assert {"batch": 4, "seq": 40} in loaded.buckets and {"batch": 2, "seq": 40} in loaded.buckets
    for batch in (1, 2, 3, 4):  # 3 was only primed: its choices are 4's
        inputs = bucket_inputs(model, {"batch": batch, "seq": 40})
        with torch.inference_mode():
            model.run(inputs)
        assert model.plan.kernel_trials() == {}, (batch, model.plan.kernel_trials())
    unwarmed = bucket_inputs(model, {"batch": 1, "seq": 300})  # 300 rows: a new bucket
    model.run(unwarmed)
    assert model.plan.kernel_trials() != {}  # the check can fail: this size was never warmed


def test_tactics_cache_setting() -> None:
    default = SidecarConfig.from_env({"CUVIL_MODEL": "m", "CUVIL_CACHE_DIR": "/var/cache/cuvil"})
    assert default.tactics_cache == Path("/var/cache/cuvil/tactics")
    off = SidecarConfig.from_env({"CUVIL_MODEL": "m", "CUVIL_TACTICS_CACHE": "off"})
    assert off.tactics_cache is None
    elsewhere = SidecarConfig.from_env({"CUVIL_MODEL": "m", "CUVIL_TACTICS_CACHE": "/t"})
    assert elsewhere.tactics_cache == Path("/t")


def test_a_reload_runs_the_kernels_the_first_load_chose(
    minilm_artifact: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def loaded() -> CompiledModel:
        return load_checked(
            ModelSource(str(minilm_artifact)),
            source_digest="sha256:test",
            max_rows=2,
            warmup_runs=1,
            golden_tolerance=1e-3,
            tactics_cache_dir=tmp_path,
        ).model

    first = loaded().execution()["tactics"]
    assert first and [path.suffix for path in tmp_path.iterdir()] == [".json"]
    with caplog.at_level(logging.INFO, "cuvil.backends.cpu.tactics_cache"):
        second = loaded()
    # the artifact carries the compile-time choices for this CPU family; the cache the rest
    carried = sum(map(len, second.execution()["tactics_from_artifact"].values()))
    total = sum(map(len, first.values()))
    assert f"took {total - carried} kernel choices" in caplog.text
    assert second.execution()["tactics"] == first

"""A CUDA artifact at the sidecar of a node without a GPU: refused with a reason that names the
target and the way to check it on the CPU anyway; with ``CUVIL_CUDA_EXECUTOR=interpreter`` it
loads, warms up and passes its golden check by Triton's interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cuvil_sidecar.source import ModelSource
from cuvil_sidecar.startup import LoadedModel, StartupError, load_checked

import cuvil
from tests.cuvil.backends.cuda.models import NormMLP


@pytest.fixture(scope="module")
def cuda_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    compiled = cuvil.jit(NormMLP().eval(), (torch.randn(2, 32),), target="cuda-sm_90")
    return compiled.save(tmp_path_factory.mktemp("cuda") / "mlp.cuvil")


def _load(path: Path) -> LoadedModel:
    return load_checked(
        ModelSource(str(path)),
        source_digest="sha256:test",
        max_rows=2,
        warmup_runs=1,
        golden_tolerance=1e-4,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the node has a GPU")
def test_a_cuda_artifact_on_a_node_without_a_gpu_is_refused(
    cuda_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUVIL_CUDA_EXECUTOR", raising=False)
    with pytest.raises(
        StartupError,
        match=r"targets cuda-sm_90: it is served from a CUDA GPU and none is visible "
        r"\(CUVIL_CUDA_EXECUTOR=interpreter",
    ):
        _load(cuda_artifact)
    monkeypatch.setenv("CUVIL_CUDA_EXECUTOR", "interpreter")
    loaded = _load(cuda_artifact)
    assert loaded.model.execution()["executor"].startswith("interpreter")

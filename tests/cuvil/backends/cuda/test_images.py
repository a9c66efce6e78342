"""Which image of a kernel a GPU loads: the cubin where the GPU runs its architecture (an
arch-specific sm_90a cubin only on 9.0, an sm_86 cubin on any 8.x from 8.6), else the PTX where
the GPU is as new as the PTX's architecture, else a refusal naming both architectures. Loading
through a stand-in driver: the chosen image is what ``cuModuleLoadData`` receives."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest
import torch

from cuvil.backends.cuda.backend import FALLBACKS
from cuvil.backends.cuda.codegen import generate_layer
from cuvil.backends.cuda.driver import Driver
from cuvil.backends.cuda.gpu import load_images
from cuvil.backends.cuda.images import ArchitectureError, choose_image, cubin_runs_on
from cuvil.fused_ops import RMS_NORM
from tests.cuvil.backends.cuda.nodes import one_node

SM90 = {
    "name": "k",
    "arch": "sm_90a",
    "cubin": "k.sm_90a.cubin",
    "symbol": "k_cubin",
    "shared": 1024,
    "ptx_arch": "sm_89",
    "ptx": "k.sm_89.ptx",
    "ptx_symbol": "k_ptx",
    "ptx_shared": 2048,
}


@pytest.mark.parametrize(
    ("arch", "capability", "runs"),
    [
        ("sm_90a", 90, True),
        ("sm_90a", 100, False),  # arch-specific: 9.0 only
        ("sm_86", 86, True),
        ("sm_86", 89, True),  # same major, newer minor
        ("sm_86", 80, False),
        ("sm_80", 90, False),  # another major
    ],
)
def test_a_cubin_runs_where_its_architecture_does(arch: str, capability: int, runs: bool) -> None:
    assert cubin_runs_on(arch, capability) is runs


def test_the_cubin_first_then_the_ptx_then_a_refusal_naming_both() -> None:
    assert choose_image(SM90, 90).file == "k.sm_90a.cubin"
    ptx = choose_image(SM90, 120)  # a newer GPU: the driver JIT-compiles the sm_89 PTX
    assert (ptx.kind, ptx.file, ptx.symbol, ptx.shared) == ("ptx", "k.sm_89.ptx", "k_ptx", 2048)
    with pytest.raises(ArchitectureError, match=r"built for sm_90a \(PTX for sm_89\); this GPU is "
                       r"sm_80 \(NVIDIA A100\): compile the model for cuda-sm_80"):  # fmt: skip
        choose_image(SM90, 80, "NVIDIA A100")


def _layer(capability: int) -> dict[str, bytes]:
    constants = {"weight": torch.zeros(64), "eps": 1e-5}
    graph, weights, _ = one_node(RMS_NORM, {"input": torch.zeros(4, 64)}, constants, (4, 64))
    files, _ = generate_layer(graph, weights, capability, FALLBACKS, f"cuda-sm_{capability}")
    return files


def _manifests(files: dict[str, bytes]) -> dict[str, dict]:
    names = json.loads(files["manifest.json"])["kernels"]
    return {name: json.loads(files[f"{name}.json"]) for name in names}


def test_a_newer_gpu_loads_the_ptx_and_an_older_one_is_refused(
    mock_driver: Path,
) -> None:
    files = _layer(90)
    manifests = _manifests(files)
    driver = Driver(str(mock_driver))
    mock = driver.lib
    kernels = load_images(manifests, files, 120, "a newer GPU", 0, driver)
    assert len(kernels) == 2  # the kernel and its generic variant
    kernel = kernels[max(kernels)]  # the last loaded: the generic variant
    assert all(k.image.kind == "ptx" for k in kernels.values()) and mock.mock_loaded_ptx() == 1
    mock.mock_symbol.restype = ctypes.c_char_p
    assert mock.mock_symbol() == kernel.image.symbol.encode()
    assert mock.mock_context_retains() >= 1  # the primary context made current first
    load_images(manifests, files, 90, "NVIDIA H200", 0, driver)
    assert mock.mock_loaded_ptx() == 0  # the sm_90a cubin
    with pytest.raises(ArchitectureError, match=r"this GPU is sm_86 \(NVIDIA A10\)"):
        load_images(manifests, files, 86, "NVIDIA A10", 0, driver)

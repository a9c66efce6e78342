"""The driver-API launcher: arguments packed from a kernel's manifest land where the cubin's own
parameter table says, with fp32 scalars as 4-byte floats and the scratch pointers null; a
stand-in ``libcuda.so.1`` records a whole load-and-launch on the CPU. On a machine with a CUDA
device, the ``gpu`` test launches a compiled RMSNorm there and compares it with torch."""

from __future__ import annotations

import ctypes
import json
import struct
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cuvil.backends.cuda.backend import FALLBACKS
from cuvil.backends.cuda.codegen import generate_layer
from cuvil.backends.cuda.cubin import read_cubin
from cuvil.backends.cuda.driver import (
    Driver,
    DriverError,
    DriverKernel,
    pack_arguments,
    parameter_bytes,
)
from cuvil.fused_ops import RMS_NORM
from tests.cuvil.backends.cuda.nodes import one_node


def _layer(compute_capability: int) -> tuple[dict, bytes]:
    """The manifest and cubin of an RMSNorm over rows of 64."""
    constants = {"weight": torch.zeros(64), "eps": 1e-5}
    graph, weights, _ = one_node(RMS_NORM, {"input": torch.zeros(4, 64)}, constants, (4, 64))
    files, _ = generate_layer(
        graph, weights, compute_capability, FALLBACKS, f"cuda-sm_{compute_capability}"
    )
    name = min(json.loads(files["manifest.json"])["kernels"])  # the specialised one
    manifest = json.loads(files[f"{name}.json"])
    return manifest, files[manifest["cubin"]]


@pytest.fixture(scope="module")
def rms_norm() -> tuple[dict, bytes]:
    return _layer(90)


ARGS = {"x_ptr": 0x7F0000001000, "w_ptr": 0x7F0000002000, "out_ptr": 0x7F0000003000}
ARGS |= {"stride_x": 64, "stride_out": 64, "n_rows": 4, "eps": 1e-5}


def _expected_area() -> bytes:
    return struct.pack("<QQQiiifQQ", *ARGS.values(), 0, 0)


def test_arguments_land_at_the_cubins_offsets(rms_norm: tuple[dict, bytes]) -> None:
    manifest, cubin = rms_norm
    params = read_cubin(cubin).kernels[manifest["symbol"]]
    assert [parameter_bytes(p["type"]) for p in manifest["params"]] == [p.size for p in params]
    packed = pack_arguments(manifest, ARGS)
    area = packed.image([p.offset for p in params], params[-1].offset + params[-1].size)
    assert area == _expected_area()
    assert area[36:40] == struct.pack("<f", 1e-5)  # 0x3727c5ac: an fp32, not a double


def test_a_kernel_that_needs_scratch_memory_is_not_launched(rms_norm: tuple[dict, bytes]) -> None:
    manifest, _ = rms_norm
    scratch = manifest | {"launch": manifest["launch"] | {"global_scratch_size": 256}}
    with pytest.raises(DriverError, match="scratch memory"):
        pack_arguments(scratch, ARGS)


def test_a_launch_through_a_stand_in_driver(
    rms_norm: tuple[dict, bytes], mock_driver: Path
) -> None:
    manifest, cubin = rms_norm
    driver = Driver(str(mock_driver))
    assert driver.version() == 13000
    mock = driver.lib
    params = read_cubin(cubin).kernels[manifest["symbol"]]
    count = len(params)
    mock.mock_layout(
        count,
        (ctypes.c_int * count)(*(p.size for p in params)),
        (ctypes.c_int * count)(*(p.offset for p in params)),
        params[-1].offset + params[-1].size,
    )
    kernel = DriverKernel(driver, manifest, cubin)
    mock.mock_symbol.restype = ctypes.c_char_p
    assert mock.mock_symbol() == manifest["symbol"].encode()
    kernel.launch((4, 1, 1), ARGS, {}, stream=0x1234)
    assert mock.mock_launch_count() == 1
    mock.mock_dims.restype = ctypes.POINTER(ctypes.c_uint * 7)
    assert list(mock.mock_dims().contents) == [4, 1, 1, 32 * manifest["num_warps"], 1, 1, 0]
    mock.mock_stream.restype = ctypes.c_void_p
    assert mock.mock_stream() == 0x1234
    mock.mock_area.restype = ctypes.POINTER(ctypes.c_ubyte * len(_expected_area()))
    assert bytes(mock.mock_area().contents) == _expected_area()
    large = manifest | {"shared": 64 * 1024}  # above 48 KB: the limit is raised first
    DriverKernel(driver, large, cubin)
    assert mock.mock_shared_attribute() == 64 * 1024
    with pytest.raises(DriverError, match="cuModuleLoadData failed with 200"):
        DriverKernel(driver, manifest, b"not a cubin")


def test_a_machine_without_a_driver_says_so() -> None:
    with pytest.raises(DriverError, match="no CUDA driver"):
        Driver("libcuda-that-is-not-here.so.1")


@pytest.mark.gpu  # skipped where no CUDA device exists (tests/conftest.py)
def test_a_compiled_rms_norm_runs_on_the_gpu() -> None:
    major, minor = torch.cuda.get_device_capability()
    manifest, cubin = _layer(10 * major + minor)
    torch.cuda.init()
    driver = Driver()
    kernel = DriverKernel(driver, manifest, cubin)
    x, weight = torch.randn(4, 64, device="cuda"), torch.randn(64, device="cuda")
    out = torch.empty_like(x)
    args = {"x_ptr": x, "w_ptr": weight, "out_ptr": out, "stride_x": 64, "stride_out": 64}
    args |= {"n_rows": 4, "eps": 1e-5}
    kernel.launch((1, 1, 1), args, {}, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, F.rms_norm(x, [64], weight, 1e-5))

"""Convolutions on kept oneDNN primitives (backends/cpu/direct_conv.py, dnnl.py) compute
what ``F.conv2d`` does, for every geometry and epilogue, across shapes, thread counts and
threads; and the ATen path still serves where they cannot."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cuvil.backends.cpu import dnnl as dnnl_module
from cuvil.backends.cpu import kept_primitives, linear_kernels
from cuvil.backends.cpu.direct_conv import DirectConv
from cuvil.backends.cpu.kernels import conv2d_kernel
from cuvil.runtime.kernels import FusedCall
from tests.cuvil.backends.cpu.calls import kept_of, prepare

ACTIVATIONS = {
    "none": lambda y: y,
    "relu": F.relu,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "hardswish": F.hardswish,
    "relu6": F.relu6,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}
# in, out, kernel, stride, padding, dilation, groups
GEOMETRIES = [
    (16, 32, 3, 1, 1, 1, 1),
    (16, 32, 3, 2, 1, 1, 1),  # odd sizes: the output rounds down
    (32, 32, 3, 1, 1, 1, 32),  # depthwise
    (12, 24, 5, 2, 2, 1, 4),  # grouped
    (8, 16, 3, 1, 2, 2, 1),  # dilated
    (3, 8, 7, 2, 3, 1, 1),  # a stem
]


@pytest.fixture(scope="module")
def dnnl() -> dnnl_module.Dnnl:
    library = dnnl_module.load()
    assert library is not None, "libdnnl.so.3 (the onednn-cpu-gomp wheel) is a dependency"
    return library


def _args(weight: torch.Tensor, geometry: tuple[int, ...], activation: str) -> dict[str, Any]:
    _, _, _, stride, padding, dilation, groups = geometry
    return {
        "weight": weight,
        "bias": torch.randn(weight.shape[0]),
        "stride": [stride] * 2,
        "padding": [padding] * 2,
        "dilation": [dilation] * 2,
        "groups": groups,
        "activation": activation,
    }


def _convolved(x: torch.Tensor, args: dict[str, Any]) -> torch.Tensor:
    return F.conv2d(
        x,
        args["weight"],
        args["bias"],
        args["stride"],
        args["padding"],
        args["dilation"],
        args["groups"],
    )


def _expected(x: torch.Tensor, args: dict[str, Any], residual: torch.Tensor | None) -> torch.Tensor:
    y = _convolved(x, args)
    return ACTIVATIONS[str(args["activation"])](y if residual is None else y + residual)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    error = (actual - expected).abs().max().item()
    assert error <= 1e-5 * max(expected.abs().max().item(), 1.0), error


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("residual", [False, True])
def test_direct_convolution_matches_torch(
    dnnl: dnnl_module.Dnnl,
    geometry: tuple[int, ...],
    activation: str,
    residual: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUVIL_TACTICS", "first")  # the direct path, never Winograd's (own test)
    torch.manual_seed(0)
    inputs, outputs, kernel, *_, groups = geometry
    args = _args(torch.randn(outputs, inputs // groups, kernel, kernel), geometry, activation)
    kernel = prepare(conv2d_kernel, args, ["input", "residual"] if residual else ["input"])
    assert kept_of(kernel) is not None or kernel.choices is not None
    conv = kernel.run
    for batch, height, width in [(1, 11, 12), (3, 9, 9), (1, 11, 12)]:
        x = torch.randn(batch, inputs, height, width)  # plain NCHW in: taken channels-last
        extra = (
            torch.randn_like(_convolved(x, args)) if residual else None
        )  # NCHW too: must be re-laid
        y = conv(x, extra) if residual else conv(x)
        _close(y, _expected(x, args, extra))
        assert y.is_contiguous(memory_format=torch.channels_last)


def test_one_primitive_per_shape_and_thread_count_and_one_packed_weight(
    dnnl: dnnl_module.Dnnl,
) -> None:
    torch.manual_seed(1)
    weight, bias = torch.randn(16, 8, 3, 3), torch.randn(16)
    conv = DirectConv(dnnl, weight, bias, ([1, 1], [1, 1], [1, 1], 1), "relu", False)
    threads = torch.get_num_threads()
    try:
        for count, size in [(1, 10), (1, 12), (2, 10), (1, 10)]:
            torch.set_num_threads(count)
            x = torch.randn(1, 8, size, size)
            _close(conv(x), F.relu(F.conv2d(x, weight, bias, padding=1)))  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(threads)
    assert sorted(conv.primitives) == [(1, 8, 10, 10, 1), (1, 8, 10, 10, 2), (1, 8, 12, 12, 1)]
    copies = conv.packs.copies
    assert len(copies) == 1 and copies[0][1].dim() == 1 and conv.plain is None  # packed only
    assert all(name for name in conv.implementations.values())


def test_threads_share_a_kernel_without_mixing_their_tensors(dnnl: dnnl_module.Dnnl) -> None:
    torch.manual_seed(2)
    weight = torch.randn(24, 16, 3, 3)
    conv = DirectConv(dnnl, weight, None, ([1, 1], [1, 1], [1, 1], 1), "none", True)
    failures: list[str] = []

    def loop(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(40):
            x = torch.randn(2, 16, 7, 7, generator=generator)
            residual = torch.randn(2, 24, 7, 7, generator=generator)
            y = conv(x, residual)
            expected = F.conv2d(x, weight, padding=1) + residual
            if y is None or not torch.allclose(y, expected, atol=1e-4, rtol=1e-4):
                failures.append(f"thread {seed}")

    workers = [threading.Thread(target=loop, args=(seed,)) for seed in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert failures == []


def test_shapes_past_the_cache_and_broadcast_residuals_take_aten(
    dnnl: dnnl_module.Dnnl, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kept_primitives, "MAX_SHAPES", 1)
    torch.manual_seed(3)
    # 5x5: no Winograd tactic in front of the kept primitives
    args = _args(torch.randn(8, 4, 5, 5), (4, 8, 5, 1, 2, 1, 1), "none")
    kernel = prepare(conv2d_kernel, args, ["input", "residual"])
    conv, kept = kernel.run, kept_of(kernel)
    for size in (6, 9):
        x = torch.randn(1, 4, size, size)
        residual = torch.randn(1, 8, size, size)
        _close(conv(x, residual), _expected(x, args, residual))
    assert kept is not None and len(kept.primitives) == 1
    x, bias_like = torch.randn(1, 4, 6, 6), torch.randn(1, 8, 1, 1)
    assert kept(x, bias_like) is None


def test_an_impossible_convolution_names_oneDNN_and_its_status(dnnl: dnnl_module.Dnnl) -> None:
    weight = torch.randn(4, 4, 5, 5)
    conv = DirectConv(dnnl, weight, None, ([1, 1], [0, 0], [1, 1], 1), "none", False)
    with pytest.raises(dnnl_module.DnnlError, match=r"oneDNN .* failed with status"):
        conv(torch.randn(1, 4, 3, 3))  # a 5x5 kernel on 3x3 pixels, unpadded


def test_switched_off_the_kernels_use_aten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUVIL_DNNL", "off")
    dnnl_module.load.cache_clear()
    try:
        assert dnnl_module.load() is None
        assert dnnl_module.describe().startswith("ATen's")
        args = _args(torch.randn(8, 4, 3, 3), (4, 8, 3, 1, 1, 1, 1), "relu")
        kernel = prepare(conv2d_kernel, args, ["input"])
        assert kept_of(kernel) is None
        conv = kernel.run
        x = torch.randn(2, 4, 7, 7)
        _close(conv(x), _expected(x, args, None))
    finally:
        monkeypatch.delenv("CUVIL_DNNL")
        dnnl_module.load.cache_clear()
    assert dnnl_module.load() is not None


def test_the_library_says_its_version(dnnl: dnnl_module.Dnnl) -> None:
    major, minor, patch = (int(part) for part in dnnl.version().split("."))
    assert major == 3 and minor >= 2  # enum values above are 3.x's
    expected = f"oneDNN {major}.{minor}.{patch} kept primitives (libdnnl.so.3)"
    assert dnnl_module.describe() == expected


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bf16 instructions here"
)
@pytest.mark.parametrize("residual", [False, True])
def test_bf16_primitives_read_and_write_bf16_within_its_rounding(
    dnnl: dnnl_module.Dnnl, residual: bool
) -> None:
    torch.manual_seed(0)
    geometry = (16, 32, 3, 2, 1, 1, 1)
    weight = torch.randn(32, 16, 3, 3)
    args = _args(weight, geometry, "relu")
    low = torch.bfloat16
    kept = DirectConv(
        dnnl, weight.to(low), args["bias"], (args["stride"], args["padding"], args["dilation"], 1),
        "relu", residual, dtypes=(low, low),
    )  # fmt: skip
    x = torch.randn(2, 16, 9, 9).to(low).contiguous(memory_format=torch.channels_last)
    conv = F.conv2d(x.float(), weight.to(low).float(), args["bias"], 2, 1)
    extra = torch.randn(conv.shape).to(low) if residual else None
    got = kept(x, extra)
    assert got is not None and got.dtype == low
    assert got.is_contiguous(memory_format=torch.channels_last)
    expected = F.relu(conv + extra.float()) if extra is not None else F.relu(conv)
    torch.testing.assert_close(got.float(), expected, atol=0.05, rtol=0.02)


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bf16 instructions here"
)
def test_a_bf16_conv_given_bf16_runs_kept_primitives_and_aten_past_their_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kept_primitives, "MAX_SHAPES", 1)
    # where oneDNN only emulates bf16 the kernel widens to fp32; its bf16 path runs here anyway
    monkeypatch.setattr(linear_kernels, "has_onednn_bf16", lambda: True)
    torch.manual_seed(4)
    low = torch.bfloat16
    weight = torch.randn(8, 4, 3, 3)
    args = {**_args(weight.to(low), (4, 8, 3, 1, 1, 1, 1), "relu"), "residual": None}
    call = FusedCall(
        "cuvil.conv2d", "node", args, ("input",), dtypes={"input": "bf16"}, output_dtype="bf16"
    )
    kernel = conv2d_kernel(call)
    kept = kept_of(kernel)
    assert kept is not None and kept.out_dtype == low
    for size in (6, 9):  # the second size is past the cache: ATen's bf16 call
        x = torch.randn(1, 4, size, size).to(low).contiguous(memory_format=torch.channels_last)
        got = kernel.run(x)
        expected = F.relu(F.conv2d(x.float(), weight.to(low).float(), args["bias"], 1, 1))
        assert got.dtype == low
        torch.testing.assert_close(got.float(), expected, atol=0.05, rtol=0.02)
    assert len(kept.primitives) == 1

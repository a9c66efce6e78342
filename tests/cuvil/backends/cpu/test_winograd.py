"""Winograd F(4x4, 3x3) convolutions (backends/cpu/winograd.py, native/winograd.c)
compute what ``F.conv2d`` does for every epilogue, shape and thread; the tactic frees the
transformed weight when the direct path wins; the native build is cached and fails clearly."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cuvil.backends.cpu import native
from cuvil.backends.cpu.kernels import conv2d_kernel
from cuvil.backends.cpu.tactics import Tactics, trial_length
from cuvil.backends.cpu.winograd import WinogradConv, winograd_conv, with_winograd_tactic
from tests.cuvil.backends.cpu.calls import prepare

TOLERANCE = 2e-5  # relative to the output's scale; measured 1e-6 to 8e-6
ACTIVATIONS = {"none": lambda y: y, "relu": F.relu, "relu6": F.relu6, "silu": F.silu}
# in channels, out channels, height, width, padding, batch
SHAPES = [
    (16, 32, 16, 16, 1, 1),
    (3, 8, 17, 13, 1, 2),  # sizes no multiple of the tile, few channels
    (70, 130, 9, 11, 1, 1),  # channels past one 64-wide block, unaligned
    (8, 8, 10, 10, 0, 3),  # no padding: the output shrinks
    (8, 8, 6, 7, 2, 1),  # wide padding: border tiles see only zeros
]


def _kernel(weight: torch.Tensor, bias: torch.Tensor | None, padding: int, activation: str,
            donated: bool = False) -> WinogradConv:  # fmt: skip
    kernel = winograd_conv(weight, bias, [padding] * 2, activation, donated)
    assert kernel is not None, f"native build failed: {native.reason('winograd')}"
    return kernel


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


def _channels_last(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_matches_conv2d_with_every_epilogue(shape: tuple[int, ...], activation: str) -> None:
    cin, cout, height, width, padding, batch = shape
    weight, bias = torch.randn(cout, cin, 3, 3) / (3 * cin**0.5), torch.randn(cout)
    x = _channels_last(batch, cin, height, width)
    plain = F.conv2d(x, weight, bias, padding=padding)
    residual = torch.randn_like(plain).contiguous(memory_format=torch.channels_last)
    act = ACTIVATIONS[activation]

    got = _kernel(weight, bias, padding, activation)(x)
    assert got.shape == plain.shape
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert _relative(got, act(plain)) < TOLERANCE

    got = _kernel(weight, None, padding, activation)(x, residual)
    assert _relative(got, act(plain - bias.view(1, -1, 1, 1) + residual)) < TOLERANCE

    donated = residual.clone(memory_format=torch.channels_last)
    got = _kernel(weight, bias, padding, activation, donated=True)(x, donated)
    assert got.data_ptr() == donated.data_ptr()  # written over the dead residual
    assert _relative(got, act(plain + residual)) < TOLERANCE


def test_broadcast_residual_is_added_unfused() -> None:
    weight, bias = torch.randn(8, 4, 3, 3), torch.randn(8)
    x = _channels_last(2, 4, 12, 12)
    residual = torch.randn(1, 8, 1, 1)
    want = F.relu(F.conv2d(x, weight, bias, padding=1) + residual)
    assert _relative(_kernel(weight, bias, 1, "relu")(x, residual), want) < TOLERANCE


def test_tiles_in_chunks_give_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past CHUNK_FLOATS the tiles go through in chunks (bounded workspaces), here 7 tiles at a
    time over two images of 4x5 tiles, chunks straddling the images, a residual written over."""
    from cuvil.backends.cpu import winograd

    weight, bias = torch.randn(12, 10, 3, 3) / 9, torch.randn(12)
    x = _channels_last(2, 10, 15, 19)
    residual = _channels_last(2, 12, 15, 19)
    want = F.relu(F.conv2d(x, weight, bias, padding=1) + residual)
    monkeypatch.setattr(winograd, "CHUNK_FLOATS", 36 * 12 * 7)
    got = _kernel(weight, bias, 1, "relu", donated=True)(x, residual)
    assert got.data_ptr() == residual.data_ptr()
    assert _relative(got, want) < TOLERANCE


def test_calls_in_and_out_of_inference_mode_share_the_workspaces() -> None:
    """A thread's workspaces made under inference mode (CompiledModel.run) still serve a call
    outside it (a kernel called directly), and the other way round."""
    weight = torch.randn(8, 8, 3, 3) / 9
    kernel = _kernel(weight, None, 1, "relu")
    for size in (40, 44):  # each call grows the workspaces: the first one made in that mode
        x = _channels_last(1, 8, size, size)
        want = F.relu(F.conv2d(x, weight, padding=1))
        with torch.inference_mode():
            assert _relative(kernel(x), want) < TOLERANCE
        assert _relative(kernel(x), want) < TOLERANCE


def test_threads_share_one_kernel() -> None:
    """Each thread has its own workspace: concurrent calls of differently sized inputs agree."""
    weight = torch.randn(24, 16, 3, 3) / 12
    kernel = _kernel(weight, None, 1, "relu")
    inputs = [_channels_last(1, 16, 8 + 4 * i, 20 - 2 * i) for i in range(4)]
    errors: list[float] = []

    def work(x: torch.Tensor) -> None:
        want = F.relu(F.conv2d(x, weight, padding=1))
        for _ in range(20):
            errors.append(_relative(kernel(x), want))

    threads = [threading.Thread(target=work, args=(x,)) for x in inputs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 80 and max(errors) < TOLERANCE


def test_tactic_frees_the_transformed_weight_when_direct_wins() -> None:
    weight, bias = torch.randn(8, 8, 3, 3), torch.randn(8)
    x = _channels_last(1, 8, 16, 16)
    want = F.conv2d(x, weight, bias, padding=1)
    calls: list[int] = []

    def instant(x: torch.Tensor) -> torch.Tensor:  # the "direct" path: the answer, at once
        calls.append(1)
        return want

    conv = with_winograd_tactic(instant, weight, bias, [1, 1], "none")
    tactics = conv.choices
    assert isinstance(tactics, Tactics)
    winograd = dict(tactics.candidates)["winograd"]
    for _ in range(trial_length(2) + 2):
        assert _relative(conv.run(x), want) < TOLERANCE
    assert tactics.describe() == {1: "onednn"}
    assert winograd._transformed is None  # released once the other path was chosen
    assert len(calls) == trial_length(2) // 2 + 2  # and the direct path serves from then on


def test_conv2d_kernel_offers_winograd_only_where_it_can_win() -> None:
    def kernel(size: int, stride: int = 1, kernel_size: int = 3) -> object:
        args = {
            "weight": torch.randn(16, 16, kernel_size, kernel_size),
            "bias": None,
            "stride": [stride] * 2,
            "padding": [kernel_size // 2] * 2,
            "dilation": [1, 1],
            "groups": 1,
            "activation": "relu",
        }
        found = prepare(conv2d_kernel, args, input_sizes=(None, 16, size, size)).choices
        assert found is None or isinstance(found, Tactics)
        return sorted(dict(found.candidates)) if found is not None else None

    assert kernel(16) == ["onednn", "winograd"]
    assert kernel(8) is None  # 4 tiles per image: the GEMMs are too thin
    assert kernel(16, stride=2) is None
    assert kernel(16, kernel_size=5) is None


def test_native_build_is_cached_and_reports_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUVIL_NATIVE_CACHE", str(tmp_path / "cache"))
    first = native.build("winograd")
    stamp = first.stat().st_mtime_ns
    assert native.build("winograd") == first and first.stat().st_mtime_ns == stamp

    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "broken.c").write_text("int f(void) { return undeclared; }\n")
    monkeypatch.setattr(native, "SOURCES", sources)
    with pytest.raises(native.NativeError, match=r"(?s)compiling broken\.c failed.*undeclared"):
        native.build("broken")
    assert native.load("broken") is None
    assert "undeclared" in (native.reason("broken") or "")


def test_switched_off_native_kernels_fall_back_to_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUVIL_NATIVE", "off")
    native.load.cache_clear()
    try:
        assert winograd_conv(torch.randn(4, 4, 3, 3), None, [1, 1], "relu") is None
        assert native.reason("winograd") == "switched off (CUVIL_NATIVE=off)"
        assert native.describe("winograd") == "not offered: switched off (CUVIL_NATIVE=off)"
    finally:
        native.load.cache_clear()


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.norm = torch.nn.BatchNorm2d(16)
        self.second = torch.nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.norm(self.first(x)))
        return torch.relu(self.second(hidden) + hidden)


def test_compiled_model_matches_eager_while_the_tactic_times_both_paths() -> None:
    """Every call during the timing runs one path or the other; each result matches eager."""
    from torch.export import Dim

    import cuvil

    torch.manual_seed(0)
    model = _Block().eval()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-0.5, 0.5)
        model.norm.running_var.uniform_(0.5, 2.0)
    example = torch.randn(2, 8, 20, 20)
    compiled = cuvil.jit(model, (example,), dynamic_shapes=({0: Dim("batch", min=1, max=8)},))
    for batch in (1, 3):
        x = torch.randn(batch, 8, 20, 20)
        with torch.no_grad():
            want = model(x)
        for _ in range(trial_length(2) + 2):  # the calls that decide the bucket, and two more
            assert _relative(compiled(x), want) < TOLERANCE
    assert compiled.execution()["winograd"].startswith("native (")
    choices = compiled.execution()["tactics"]
    assert len(choices) == 2 and all(  # bucket 2 met only verification's few calls
        by_bucket[1] in ("onednn", "winograd") and by_bucket[4] in ("onednn", "winograd")
        for by_bucket in choices.values()
    ), choices


def test_a_portable_build_serves_any_cpu_with_its_instructions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an image build leaves (CUVIL_NATIVE_MARCH=x86-64-v3) is found on another CPU, and
    refused, with the reason, on a CPU without AVX2."""
    monkeypatch.setenv("CUVIL_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CUVIL_NATIVE_MARCH", "x86-64-v3")
    if not native.LEVEL_FLAGS["x86-64-v3"] <= native._cpu_flags():
        with pytest.raises(native.NativeError, match="this CPU lacks"):
            native.build("winograd")
        return  # this CPU cannot run the level at all
    built = native.build("winograd")
    monkeypatch.setattr(native, "_cpuinfo", lambda: ["model name : another", "flags : avx2"])
    monkeypatch.setattr(native, "_cpu_flags", lambda: set(native.LEVEL_FLAGS["x86-64-v3"]))
    monkeypatch.setattr(native, "_compiler", lambda: None)  # as in the image: no compiler
    assert native.build("winograd") == built
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"sse4_2", "popcnt"})
    with pytest.raises(native.NativeError, match=r"x86-64-v3, which needs .*'avx2'"):
        native.build("winograd")
    assert native.build("winograd", for_this_cpu=False) == built  # an image builder's CPU
    monkeypatch.setenv("CUVIL_NATIVE_MARCH", "pentium-pro-max")
    with pytest.raises(native.NativeError, match="use one of native, x86-64"):
        native.build("winograd")

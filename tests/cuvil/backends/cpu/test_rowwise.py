"""RMSNorm and RoPE on the native row-wise kernels (cuvil/backends/cpu/rowwise.py,
runtime/native/rowwise.c) compute what the torch ops do, on random inputs of every layout the
kernels take, at one thread and at two; calls they do not take go to torch and still agree."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cuvil.backends.cpu import native, rowwise
from cuvil.backends.cpu.kernels import rms_norm_kernel, rope_kernel
from tests.cuvil.backends.cpu.calls import prepare

TOLERANCE = 1e-5  # relative to the output's scale; measured 1e-7 to 4e-7


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_the_native_library_is_built() -> None:
    assert rowwise.is_native_available(), native.reason("rowwise")


def _rms_inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 3

    return [
        randn(1, 128, 256),  # the tiny Llama's activations
        randn(4, 300, 96),  # above the parallel threshold
        randn(7, 100),  # an odd row count, a width no multiple of 8
        randn(5),  # one row
        randn(0, 64),  # no rows
        randn(64, 3, 48).transpose(0, 1),  # rows not evenly spaced: copied, then one pass
        randn(1, 1, 64).expand(2, 5, 64),  # rows sharing memory
    ]


@pytest.mark.parametrize("index", range(len(_rms_inputs())))
def test_rms_norm_matches_torch(index: int, threads: int) -> None:
    x = _rms_inputs()[index]
    weight = torch.randn(x.shape[-1]) + 1
    got = rowwise.rms_norm(weight, 1e-6)(x)
    want = F.rms_norm(x, [x.shape[-1]], weight, 1e-6)
    assert got.shape == want.shape
    if x.numel():
        assert _relative(got, want) < TOLERANCE


def test_rms_norm_calls_it_does_not_take_go_to_torch() -> None:
    weight = torch.randn(32) + 1
    kernel = rowwise.rms_norm(weight, 1e-5)
    strided = torch.randn(32, 4).t()  # last dim not contiguous
    assert _relative(kernel(strided), F.rms_norm(strided, [32], weight, 1e-5)) < TOLERANCE
    doubles = torch.randn(3, 32, dtype=torch.float64)
    assert kernel(doubles).dtype == torch.float64
    with pytest.raises(RuntimeError):
        kernel(torch.randn(3, 31))  # torch's own error for a wrong width
    bf16 = rowwise.rms_norm(weight.bfloat16(), 1e-5)  # not fp32: torch's op, same result
    x = torch.randn(2, 32).bfloat16()
    assert torch.equal(bf16(x), F.rms_norm(x, [32], weight.bfloat16(), 1e-5))


def _rope_inputs() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return [
        # q of the tiny Llama: [1, seq, heads, dim] viewed as [1, heads, seq, dim]
        (randn(1, 128, 8, 32).transpose(1, 2), randn(1, 1, 128, 32), randn(1, 1, 128, 32)),
        (randn(2, 2, 40, 64), randn(40, 64), randn(40, 64)),  # cos/sin without leading dims
        (randn(3, 4, 9, 16), randn(3, 1, 9, 16), randn(1, 1, 9, 16)),  # cos and sin differ
        (randn(2, 4, 300, 64), randn(1, 1, 300, 64), randn(1, 1, 300, 64)),  # parallel
        (randn(1, 2, 5, 64)[..., ::1], randn(5, 128)[:, :64], randn(5, 128)[:, 64:]),  # strided
    ]


@pytest.mark.parametrize("index", range(len(_rope_inputs())))
def test_rope_matches_torch(index: int, threads: int) -> None:
    x, cos, sin = _rope_inputs()[index]
    got = rowwise.rope()(x, cos, sin)
    half = x.shape[-1] // 2
    want = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    assert got.shape == want.shape and got.is_contiguous()
    assert _relative(got, want) < TOLERANCE


def test_rope_calls_it_does_not_take_go_to_torch() -> None:
    kernel = rowwise.rope()
    cases = [
        (torch.randn(6, 32), torch.randn(6, 32), torch.randn(6, 32)),  # 2-D
        (torch.randn(1, 2, 3, 4, 8), torch.randn(3, 4, 8), torch.randn(3, 4, 8)),  # 5-D
        (torch.randn(1, 2, 3, 8).double(), torch.randn(3, 8).double(), torch.randn(3, 8).double()),
        (torch.randn(1, 2, 3, 8), torch.randn(3, 1), torch.randn(3, 1)),  # cos over the width
    ]
    for x, cos, sin in cases:
        assert torch.allclose(kernel(x, cos, sin), rowwise.rope_with_torch(x, cos, sin))
    with pytest.raises(RuntimeError):
        kernel(torch.randn(1, 2, 3, 8), torch.randn(4, 8), torch.randn(4, 8))  # seq 4 vs 3


def test_the_kernel_factories_use_them() -> None:
    weight = torch.randn(64) + 1
    x = torch.randn(3, 64)
    norm = prepare(rms_norm_kernel, {"weight": weight, "eps": 1e-6}).run
    assert _relative(norm(x), F.rms_norm(x, [64], weight, 1e-6)) < TOLERANCE
    q, cos, sin = _rope_inputs()[0]
    rope = prepare(rope_kernel, {}, ["input", "cos", "sin"]).run
    assert _relative(rope(q, cos, sin), rowwise.rope_with_torch(q, cos, sin)) < TOLERANCE


def test_a_compiled_llama_runs_them_and_matches_eager() -> None:
    import cuvil
    from cuvil.models import tiny_llama

    spec = tiny_llama()
    compiled = cuvil.jit(
        spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes, name=spec.name
    )
    assert compiled.execution()["rowwise"].startswith("native (")
    steps = {step.name: step.kernel for step in compiled.plan.steps}
    natives = [name for name, kernel in steps.items() if kernel.__qualname__.endswith("native")]
    assert sum(name.startswith("rms_norm") for name in natives) == 5  # 2 layers x 2 + final
    assert sum(name.startswith("rope") for name in natives) == 4  # q and k per layer
    ids = torch.randint(0, 2048, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = spec.model(input_ids=ids).logits
    got = compiled.run({"input_ids": ids})
    logits = next(iter(got.values()))
    assert _relative(logits, want) < 1e-4

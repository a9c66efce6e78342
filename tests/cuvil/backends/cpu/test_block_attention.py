"""Cuvil's block attention (native/block_attention.cc): ATen's attention semantics, computed by
its own kernel on AVX-512 and AVX2 CPUs and handed to ATen's elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cuvil.backends.cpu import plan_loop

AVX512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # x86-64-v4's
AVX2 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}  # x86-64-v3's


def _has_a_build() -> bool:
    """Whether the CPU runs one of the kernel's builds (AVX-512 or AVX2 with FMA)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    return set(flags) >= AVX2 or set(flags) >= AVX512


@pytest.fixture(scope="module")
def native() -> object:
    assert plan_loop.load(), plan_loop.reason()
    return torch.ops.cuvil_native


def _reference(q, k, v, mask, causal, scale, gqa):  # type: ignore[no-untyped-def]
    if mask is not None and mask.is_floating_point():
        mask = mask.double()
    out = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=gqa,
    )  # fmt: skip
    return out.float()


SHAPES = [  # batch, heads, kv heads, queries, keys, head dim
    (2, 4, 4, 7, 7, 32),
    (1, 12, 12, 128, 128, 32),
    (3, 8, 2, 37, 37, 64),
    (2, 2, 2, 5, 50, 16),
    (1, 4, 4, 130, 130, 48),
    (2, 3, 3, 33, 20, 128),
]


def _masks(batch: int, heads: int, queries: int, keys: int) -> list[torch.Tensor | None]:
    return [
        None,
        torch.randn(batch, 1, 1, keys),
        torch.randn(batch, 1, queries, keys),
        torch.randn(1, heads, queries, keys),
        torch.rand(batch, 1, queries, keys) > 0.3,
        torch.randn(queries, keys),
    ]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_block_attention_matches_aten_in_double(native, shape) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(sum(shape))
    batch, heads, kv_heads, queries, keys, dim = shape
    q = torch.randn(batch, heads, queries, dim)
    k, v = torch.randn(batch, kv_heads, keys, dim), torch.randn(batch, kv_heads, keys, dim)
    gqa = kv_heads != heads
    for mask in _masks(batch, heads, queries, keys):
        for causal in (False, True) if mask is None else (False,):
            for scale in (None, 0.3):
                out = native.block_attention(q, k, v, mask, causal, scale, gqa)
                expected = _reference(q, k, v, mask, causal, scale, gqa)
                assert float((out - expected).abs().max()) < 1e-4


def test_it_runs_the_calls_it_takes_itself_on_avx2_and_avx512_only(native) -> None:  # type: ignore[no-untyped-def]
    q, k, v = (torch.randn(2, 12, 128, 32) for _ in range(3))
    mask = torch.zeros(2, 1, 128, 128)
    assert native.block_attention_takes(q, k, v, mask, False, False) is _has_a_build()
    assert native.block_attention_takes(q, k, v, None, True, False) is _has_a_build()
    # what it leaves to ATen's kernel everywhere, with the same answers
    odd = torch.randn(2, 12, 128, 24)  # a head dim not a multiple of 16
    assert not native.block_attention_takes(odd, odd, odd, None, False, False)
    assert not native.block_attention_takes(q, k, v, mask, True, False)  # ATen refuses both
    low = q.to(torch.bfloat16)
    assert not native.block_attention_takes(low, low, low, None, False, False)
    long = torch.randn(1, 2, 2049, 32)
    assert not native.block_attention_takes(long, long, long, None, False, False)
    out = native.block_attention(odd, odd, odd, None, False, None, False)
    assert float((out - _reference(odd, odd, odd, None, False, None, False)).abs().max()) < 1e-4


def test_rows_that_see_nothing_are_zero_as_atens(native) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 2, 6, 32), torch.randn(1, 2, 9, 32), torch.randn(1, 2, 9, 32)
    mask = torch.zeros(1, 1, 6, 9)
    mask[..., 2, :] = float("-inf")
    out = native.block_attention(q, k, v, mask, False, None, False)
    assert torch.equal(out[:, :, 2], torch.zeros(1, 2, 32))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert float((out - expected).abs().max()) < 1e-5


def test_heads_lie_side_by_side_underneath_so_their_merge_is_a_view(native) -> None:  # type: ignore[no-untyped-def]
    qkv = torch.randn(4, 128, 3, 12, 32)  # a fused QKV projection's output, split into heads
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    out = native.block_attention(q, k, v, None, False, None, False)
    merged = out.transpose(1, 2)
    assert merged.is_contiguous()
    assert float((out - _reference(q, k, v, None, False, None, False)).abs().max()) < 1e-4

"""The KV-cache ops: the write lands in place at each row's slot and positions, the attention
equals attention over the gathered prefix with a causal mask, and the IR holds in-place writes
to graph inputs no one else reads (verifier), allocating nothing for them (memory plan)."""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn.functional as F

from cuvil.analysis.memory import lifetimes, plan_memory
from cuvil.backends import kv_cache
from cuvil.backends.cpu import plan_loop
from cuvil.fused_ops import CACHED_ATTENTION, KV_CACHE_WRITE, fused_node, in_place_ops
from cuvil.ir import Graph, Node, TensorType, Value
from cuvil.ir_verify import IRVerificationError, verify_graph

SLOTS, KV_HEADS, MAX_SEQ, HEAD = 4, 2, 16, 8


def _cache() -> torch.Tensor:
    return torch.randn(SLOTS, KV_HEADS, MAX_SEQ, HEAD, generator=torch.Generator().manual_seed(0))


def _native_write(
    cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The CPU native plan's write (cpu/native/kernel_ops.cc)."""
    assert plan_loop.load(), plan_loop.reason()
    return torch.ops.cuvil_native.kv_cache_write.default(cache, new, slots, positions)


WRITES = {"aten": kv_cache.write, "native": _native_write}


@pytest.mark.parametrize("form", sorted(WRITES))
@pytest.mark.parametrize(
    ("tokens", "layout"),
    [(1, "contiguous"), (5, "contiguous"), (1, "transposed"), (3, "transposed")],
)
def test_the_write_goes_in_place_at_each_rows_slot_and_positions(
    tokens: int, layout: str, form: str
) -> None:
    """``transposed``: the new keys as a projection's output viewed [batch, heads, tokens,
    head] (token-major in memory), as a decode step's reshape and transpose give them."""
    cache = _cache()
    before = cache.clone()
    pointer = cache.data_ptr()
    new = torch.randn(2, KV_HEADS, tokens, HEAD)
    if layout == "transposed":
        new = new.transpose(1, 2).contiguous().transpose(1, 2)
    slots, positions = torch.tensor([3, 1]), torch.tensor([2, 16 - tokens])
    result = WRITES[form](cache, new, slots, positions)
    assert result is cache and cache.data_ptr() == pointer
    expected = before.clone()
    for row, (slot, start) in enumerate(zip(slots.tolist(), positions.tolist(), strict=True)):
        expected[slot, :, start : start + tokens] = new[row]
    assert torch.equal(cache, expected)  # the rest of the cache is untouched


@pytest.mark.parametrize("form", sorted(WRITES))
def test_a_bf16_cache_holds_the_written_rows_rounded_to_bf16(form: str) -> None:
    """fp32 keys into a bf16 model's cache: rounded as ``Tensor.to`` rounds them, in place."""
    cache = _cache().bfloat16()
    pointer = cache.data_ptr()
    new = torch.randn(2, KV_HEADS, 3, HEAD)
    result = WRITES[form](cache, new, torch.tensor([0, 2]), torch.tensor([1, 5]))
    assert result is cache and cache.data_ptr() == pointer
    assert torch.equal(cache[0, :, 1:4], new[0].bfloat16())
    assert torch.equal(cache[2, :, 5:8], new[1].bfloat16())


@pytest.mark.parametrize("form", sorted(WRITES))
def test_the_write_of_rows_sharing_a_slot_and_of_a_wrapped_slot(form: str) -> None:
    """A packed prefill's rows (one token each, one slot, consecutive positions) and a
    negative slot, which ATen's indexing wraps: both forms write as ``index_put_`` does."""
    cache, expected = _cache(), _cache()
    new = torch.randn(4, KV_HEADS, 1, HEAD)
    slots, positions = torch.tensor([2, 2, 2, -1]), torch.tensor([5, 6, 7, 0])
    WRITES[form](cache, new, slots, positions)
    for row, (slot, start) in enumerate([(2, 5), (2, 6), (2, 7), (SLOTS - 1, 0)]):
        expected[slot, :, start] = new[row, :, 0]
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("form", sorted(WRITES))
def test_the_write_refuses_a_position_past_the_cache(form: str) -> None:
    new = torch.randn(2, KV_HEADS, 2, HEAD)
    with pytest.raises(IndexError):
        WRITES[form](_cache(), new, torch.tensor([0, 1]), torch.tensor([3, MAX_SEQ - 1]))


def _reference_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: list[int],
    starts: list[int],
    scale: float,
) -> torch.Tensor:
    """Attention over a gathered copy of each slot, heads repeated, an explicit causal mask."""
    out = []
    groups = query.shape[1] // keys.shape[1]
    tokens = query.shape[2]
    for row, (slot, start) in enumerate(zip(slots, starts, strict=True)):
        k = keys[slot, :, : start + tokens].repeat_interleave(groups, 0)
        v = values[slot, :, : start + tokens].repeat_interleave(groups, 0)
        scores = query[row] @ k.transpose(-1, -2) * scale
        allowed = torch.arange(start + tokens)[None, :] <= start + torch.arange(tokens)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(F.softmax(scores, -1) @ v)
    return torch.stack(out)


@pytest.mark.parametrize(
    ("tokens", "starts", "slots"),
    [
        (1, [0, 5, 11], [2, 0, 3]),  # slots out of order
        (1, [4, 0, 12], [1, 2, 3]),  # consecutive slots: one masked call
        (4, [0, 3, 9], [2, 0, 3]),  # chunks of a prompt, from 0 and from later positions
        # a packed prefill: tokens of three prompts as rows, several rows a slot
        (1, [0, 1, 2, 5, 6, 0, 9], [2, 2, 2, 0, 0, 3, 1]),
        # a run long enough to attend as a chunk, beside a short run and a lone row
        (1, [*range(16), 7, *range(3, 13)], [2] * 16 + [0] + [3] * 10),
    ],
)
@pytest.mark.parametrize("form", ["aten", "native"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_cached_attention_equals_attention_over_the_gathered_prefix(
    tokens: int, starts: list[int], slots: list[int], form: str, cache_dtype: torch.dtype
) -> None:
    """A bf16 cache (a bf16 model's) is read widened to fp32: the same attention as over an
    fp32 copy of it."""
    keys, values = _cache().to(cache_dtype), _cache().flip(0).to(cache_dtype)
    query = torch.randn(len(slots), 2 * KV_HEADS, tokens, HEAD)  # 2 query heads per KV head
    rows, positions = torch.tensor(slots), torch.tensor(starts)
    if form == "native":  # the CPU native plan's op (cpu/native/kernel_ops.cc)
        assert plan_loop.load(), plan_loop.reason()
        attend = torch.ops.cuvil_native.cached_attention.default
        got = attend(query.transpose(1, 2).contiguous().transpose(1, 2), keys, values, rows,
                     positions, 0.3)  # fmt: skip
    else:
        got = kv_cache.attend(query, keys, values, rows, positions, 0.3)
    expected = _reference_attention(query, keys.float(), values.float(), slots, starts, 0.3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_native_packed_prefill_runs_from_later_positions_attend_as_chunks() -> None:
    """A prompt's second chunk packed beside another prompt: runs of 20 and 17 rows, each
    attending over its slot's earlier positions too (a bottom-right causal mask)."""
    assert plan_loop.load(), plan_loop.reason()
    generator = torch.Generator().manual_seed(2)
    keys = torch.randn(3, 2, 48, 32, generator=generator)
    values = torch.randn(3, 2, 48, 32, generator=generator)
    slots, starts = [1] * 20 + [2] + [0] * 17, [*range(9, 29), 40, *range(0, 17)]
    query = torch.randn(len(slots), 6, 1, 32, generator=generator)
    attend = torch.ops.cuvil_native.cached_attention.default
    got = attend(query, keys, values, torch.tensor(slots), torch.tensor(starts), None)
    expected = _reference_attention(query, keys, values, slots, starts, 32**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_native_decode_attention_over_long_prefixes_splits_across_threads() -> None:
    """Prefixes long enough that the rows and heads are shared out among threads."""
    assert plan_loop.load(), plan_loop.reason()
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(3, 2, 640, 64, generator=generator)
    values = torch.randn(3, 2, 640, 64, generator=generator)
    query = torch.randn(3, 4, 1, 64, generator=generator)
    slots, starts = [2, 0, 1], [639, 300, 17]
    attend = torch.ops.cuvil_native.cached_attention.default
    got = attend(query, keys, values, torch.tensor(slots), torch.tensor(starts), None)
    expected = _reference_attention(query, keys, values, slots, starts, 64**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [4, 20, 40, 64, 96, 128])
def test_native_decode_attention_takes_any_head_dim(dim: int, cache_dtype: torch.dtype) -> None:
    """Eight lanes at a time, the rest one by one: head dims below, across and at a multiple of
    eight, and value columns summed 64, 32 and 8 at a time, from fp32 or bf16 caches."""
    assert plan_loop.load(), plan_loop.reason()
    generator = torch.Generator().manual_seed(2)
    keys = torch.randn(4, 2, 40, dim, generator=generator).to(cache_dtype).float()
    values = torch.randn(4, 2, 40, dim, generator=generator).to(cache_dtype).float()
    query = torch.randn(3, 6, 1, dim, generator=generator)
    slots, starts = [3, 1, 2], [39, 0, 21]
    attend = torch.ops.cuvil_native.cached_attention.default
    cached = keys.to(cache_dtype), values.to(cache_dtype)
    got = attend(query, *cached, torch.tensor(slots), torch.tensor(starts), None)
    expected = _reference_attention(query, keys, values, slots, starts, dim**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sharpness", [30.0, 1e3])
def test_native_decode_attention_of_peaked_scores(sharpness: float) -> None:
    """Scores far apart: most weights' exponents fall below fp32's range (the vector exp's
    clamp), and the softmax still matches ATen's; lengths past a value tile (128 rows)."""
    assert plan_loop.load(), plan_loop.reason()
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 1, 300, 32, generator=generator)
    values = torch.randn(2, 1, 300, 32, generator=generator)
    query = sharpness * torch.randn(2, 3, 1, 32, generator=generator)
    slots, starts = [1, 0], [299, 140]
    attend = torch.ops.cuvil_native.cached_attention.default
    got = attend(query, keys, values, torch.tensor(slots), torch.tensor(starts), None)
    expected = _reference_attention(query, keys, values, slots, starts, 32**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_attention_refuses_a_row_past_the_cache() -> None:
    query = torch.randn(1, KV_HEADS, 2, HEAD)
    with pytest.raises(IndexError, match="reaches position"):
        kv_cache.attend(query, _cache(), _cache(), torch.tensor([0]), torch.tensor([15]), None)


def _step_graph(write_const: bool = False, extra_reader: bool = False) -> Graph:
    cache_type = TensorType(
        "f32", tuple(sympy.Integer(d) for d in (SLOTS, KV_HEADS, MAX_SEQ, HEAD))
    )
    new_type = TensorType(
        "f32", (sympy.Integer(1), sympy.Integer(KV_HEADS), sympy.Integer(1), sympy.Integer(HEAD))
    )
    rows = TensorType("i64", (sympy.Integer(1),))
    nodes = [
        Node("query", "input", (), (new_type,)),
        Node("new", "input", (), (new_type,)),
        Node("slots", "input", (), (rows,)),
        Node("positions", "input", (), (rows,)),
        Node(
            "cache",
            "const" if write_const else "input",
            (("key", "c"),) if write_const else (),
            (cache_type,),
        ),
        fused_node(
            KV_CACHE_WRITE,
            "written",
            {
                "cache": Value("cache"),
                "new": Value("new"),
                "slots": Value("slots"),
                "positions": Value("positions"),
            },
            (cache_type,),
        ),
        fused_node(
            CACHED_ATTENTION,
            "attention",
            {
                "query": Value("query"),
                "key_cache": Value("written"),
                "value_cache": Value("written"),
                "slots": Value("slots"),
                "positions": Value("positions"),
                "scale": None,
            },
            (new_type,),
        ),
    ]
    outputs: tuple[tuple[str, Value], ...] = (("output", Value("attention")),)
    if extra_reader:
        outputs += (("stale", Value("cache")),)
    inputs = tuple(node.name for node in nodes if node.op == "input")
    return Graph("step", tuple(nodes), inputs, outputs)


def test_the_verifier_takes_a_write_into_an_input_and_refuses_others() -> None:
    assert in_place_ops() == {KV_CACHE_WRITE: "cache"}
    verify_graph(_step_graph())
    with pytest.raises(IRVerificationError, match="not a graph input"):
        verify_graph(_step_graph(write_const=True))
    with pytest.raises(IRVerificationError, match="another node also reads"):
        verify_graph(_step_graph(extra_reader=True))


def test_the_memory_plan_allocates_nothing_for_the_write() -> None:
    graph = _step_graph()
    assert Value("written") not in lifetimes(graph)  # the cache input's own memory
    plan = plan_memory(graph, {})
    assert set(plan.sizes) == {Value("attention")}

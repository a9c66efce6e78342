"""The KV-cache ops of decoder generation, in ATen calls that run on any device.

``cuvil.kv_cache_write(cache, new, slots, positions)`` writes ``new`` ([batch, kv_heads, tokens,
head_dim]) into ``cache`` ([slots, kv_heads, max_seq, head_dim]) in place: token ``t`` of row
``b`` lands in slot ``slots[b]`` at position ``positions[b] + t``. It returns the cache itself
(the same tensor, not a copy), so that in the functional IR the attention that reads the cache
depends on the write and runs after it. One ``index_put_`` per call: no copy of the cache.

``cuvil.cached_attention(query, key_cache, value_cache, slots, positions, scale)`` is causal
attention of ``query`` ([batch, heads, tokens, head_dim]) over each row's own slot: query token
``t`` of row ``b`` sees cache positions ``0 .. positions[b] + t``. Keys and values are read as
views of the slot's prefix (``cache[slot, :, :length]``), so the work follows each sequence's
length, not ``max_seq``, and nothing is gathered; a decode step over consecutive slots is one
call over a view of those slots up to the longest row, each row masked to its own length (slots
in another order, as a continuous-batching scheduler's, are gathered for that one call).
Grouped-query attention (fewer KV heads than query heads) is ATen's ``enable_gqa``. A cache may
hold a lower precision than the queries (a bf16 model's cache under fp32 attention): the write
rounds to it and the attention reads it widened to the queries' dtype. The CPU's
native form runs a decode step (one token per row, fp32) as its own loop over rows and heads,
reading each slot's prefix in place in any slot order. Rows that share a slot (a packed
prefill's tokens) attend in runs of consecutive positions, each as one chunk (the native form:
runs of 16 rows or more, the rest through its decode loop).

The CPU and CUDA backends both take these factories (``KV_CACHE_KERNELS``; the CPU adds native
forms, the same computation in C++ for its native plan loop: cpu/native/kernel_ops.cc and
cached_attention.cc); the
frontend's tracing ops (cuvil/frontend/kv_cache_ops.py) call the same functions for eager runs. The
attention reads each row's slot and length on the host (``tolist``), so on a GPU a step with
these ops synchronises once per layer and is not captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cuvil import fused_ops as fused
from cuvil.runtime.kernels import FusedCall, KernelFactory, PreparedKernel


def write(
    cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Write ``new`` into ``cache`` at each row's slot and positions, rounded to the cache's
    dtype (a bf16 cache of fp32 keys); returns ``cache``."""
    new = new.to(cache.dtype)
    by_position = cache.transpose(1, 2)  # a view: [slots, max_seq, kv_heads, head_dim]
    tokens = new.shape[2]
    if tokens == 1:
        by_position.index_put_((slots, positions), new[:, :, 0])
        return cache
    where = positions[:, None] + torch.arange(tokens, device=positions.device)  # [batch, tokens]
    by_position.index_put_((slots[:, None], where), new.transpose(1, 2))
    return cache


def attend(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """Causal attention of each row's queries over its slot's cache prefix."""
    tokens = query.shape[2]
    gqa = query.shape[1] != key_cache.shape[1]
    rows, starts = slots.tolist(), positions.tolist()
    longest = max(starts) + tokens
    if longest > key_cache.shape[2]:
        raise IndexError(f"a row reaches position {longest} of a cache of {key_cache.shape[2]}")
    first = rows[0]
    if tokens == 1 and len(set(rows)) < len(rows):
        return _attend_runs(query, key_cache, value_cache, rows, starts, scale)
    if tokens == 1 and len(rows) > 1:
        # one token per row: one call over the rows' slots up to the longest, each row masked to
        # its own length; consecutive slots (generate's batches) are a view, others a gather
        if rows == list(range(first, first + len(rows))):
            keys = key_cache[first : first + len(rows), :, :longest].to(query.dtype)
            values = value_cache[first : first + len(rows), :, :longest].to(query.dtype)
        else:
            keys = key_cache[:, :, :longest].index_select(0, slots).to(query.dtype)
            values = value_cache[:, :, :longest].index_select(0, slots).to(query.dtype)
        seen = torch.arange(longest, device=query.device)[None, :] <= positions[:, None]
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=seen[:, None, None, :], scale=scale, enable_gqa=gqa
        )
    out = []
    for row, (slot, start) in enumerate(zip(rows, starts, strict=True)):
        length = start + tokens
        keys = key_cache[slot : slot + 1, :, :length].to(query.dtype)
        values = value_cache[slot : slot + 1, :, :length].to(query.dtype)
        mask: torch.Tensor | None = None
        if tokens > 1 and start > 0:  # bottom-right causal: token t sees up to start + t
            seen = torch.arange(length, device=query.device)
            mask = seen[None, :] <= (start + torch.arange(tokens, device=query.device))[:, None]
        out.append(
            F.scaled_dot_product_attention(
                query[row : row + 1],
                keys,
                values,
                attn_mask=mask,
                is_causal=tokens > 1 and start == 0,  # from position 0 the two agree
                scale=scale,
                enable_gqa=gqa,
            )
        )
    return out[0] if len(out) == 1 else torch.cat(out)


def _attend_runs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    rows: list[int],
    starts: list[int],
    scale: float | None,
) -> torch.Tensor:
    """One token per row where rows share slots (a packed prefill: a prompt's tokens are rows
    of one slot at consecutive positions): each run of such rows attends as one chunk of
    tokens, over its slot's prefix without a gather."""
    out, begin = [], 0
    while begin < len(rows):
        end = begin + 1
        while end < len(rows) and rows[end] == rows[begin] and starts[end] == starts[end - 1] + 1:
            end += 1
        chunk = query[begin:end].transpose(0, 2)  # [1, heads, tokens, head]
        where = torch.tensor([rows[begin]]), torch.tensor([starts[begin]])
        out.append(attend(chunk, key_cache, value_cache, *where, scale).transpose(0, 2))
        begin = end
    return torch.cat(out)


def kv_cache_write_kernel(call: FusedCall) -> PreparedKernel:
    """``cuvil.kv_cache_write``: every argument arrives at run time (the cache is an input)."""
    call.check_runtime(("cache", "new", "slots", "positions"))
    return PreparedKernel(write)


def cached_attention_kernel(call: FusedCall) -> PreparedKernel:
    """``cuvil.cached_attention`` with its scale fixed when the plan is built."""
    scale = call.arg("scale")
    scale = float(scale) if scale is not None else None

    def run(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        return attend(query, key_cache, value_cache, slots, positions, scale)

    return PreparedKernel(run)


KV_CACHE_KERNELS: dict[str, KernelFactory] = {
    fused.KV_CACHE_WRITE: kv_cache_write_kernel,
    fused.CACHED_ATTENTION: cached_attention_kernel,
}

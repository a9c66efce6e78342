"""Decode-step attention over a KV cache: Cuvil's native kernel against ATen's
``scaled_dot_product_attention`` over the same prefixes. Prints one JSON document.

    .venv/bin/python -m benchmarks.decode_attention --threads 1,2

Each case is a decode step's attention (one query token per row) for ``rows`` sequences whose
keys and values sit at positions ``0..position`` of their slots in a static cache of
``--max-seq`` positions, with grouped-query heads (``heads`` query heads over ``kv_heads``):
the tiny Llama's shape (8 / 2 heads of 32) and the ~100M Llama's (12 / 4 heads of 64).
``cuvil``: ``torch.ops.cuvil_native.cached_attention`` on the cache in place, as a compiled
decode step calls it. ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with
``enable_gqa`` on the prefix already sliced out (every row at the same position, so no mask:
its best case). Median of ``--runs`` calls after three; ``max_abs_diff`` between the two.

``--cache-dtypes fp32,bf16`` repeats each case over a bf16 cache (a bf16 artifact's), which the
kernel widens as it reads; ``sdpa`` then runs on fp32 copies of its prefix. ``--cold`` writes
a 256 MB buffer before each timed call (not timed), as a decode step's weights pass through the
caches between two layers' attention, so the cache is read from memory, not from L2/L3.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from benchmarks.host import cpu_name
from cuvil.backends.cpu import plan_loop

CASES = (  # rows, heads, kv_heads, head dim, position
    (16, 8, 2, 32, 60),
    (16, 8, 2, 32, 500),
    (1, 12, 4, 64, 1000),
    (16, 12, 4, 64, 100),
    (16, 12, 4, 64, 1000),
)


EVICTION_FLOATS = 64 << 20  # 256 MB: past any L3 of these hosts
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def median_ms(call: Any, runs: int, before: Any = None) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(runs):
        if before is not None:
            before()
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return sorted(times)[runs // 2] * 1e3


def case(
    shape: tuple[int, ...], max_seq: int, runs: int, cache_dtype: str = "fp32", cold: bool = False
) -> dict[str, Any]:
    rows, heads, kv_heads, dim, position = shape
    generator = torch.Generator().manual_seed(0)
    dtype = DTYPES[cache_dtype]
    keys = torch.randn(rows, kv_heads, max_seq, dim, generator=generator).to(dtype)
    values = torch.randn(rows, kv_heads, max_seq, dim, generator=generator).to(dtype)
    query = torch.randn(rows, heads, 1, dim, generator=generator)
    slots, positions = torch.arange(rows), torch.full((rows,), position)
    attend = torch.ops.cuvil_native.cached_attention.default
    prefix_keys = keys[:, :, : position + 1].float()
    prefix_values = values[:, :, : position + 1].float()
    eviction = torch.empty(EVICTION_FLOATS) if cold else None

    def cuvil() -> torch.Tensor:
        return attend(query, keys, values, slots, positions, None)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            query, prefix_keys, prefix_values, enable_gqa=True
        )

    def evict() -> None:
        if eviction is not None:
            eviction.fill_(1.0)

    ours, theirs = median_ms(cuvil, runs, evict), median_ms(sdpa, runs, evict)
    return {
        "cache_dtype": cache_dtype,
        "cold": cold,
        "rows": rows,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": dim,
        "position": position,
        "cuvil_ms": round(ours, 4),
        "sdpa_ms": round(theirs, 4),
        "cuvil_over_sdpa": round(ours / theirs, 3),
        "max_abs_diff": float((cuvil() - sdpa()).abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--max-seq", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--cache-dtypes", default="fp32", help="comma-separated: fp32, bf16")
    parser.add_argument("--cold", action="store_true", help="evict the caches before each call")
    args = parser.parse_args()
    if not plan_loop.load():
        raise SystemExit(f"the native plan library is not there: {plan_loop.reason()}")
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for cache_dtype in args.cache_dtypes.split(","):
            for shape in CASES:
                timed = case(shape, args.max_seq, args.runs, cache_dtype, args.cold)
                results.append({"threads": threads, **timed})
    report = {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "max_seq": args.max_seq,
        "cases": results,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

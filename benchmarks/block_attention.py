"""Attention over whole short sequences: Cuvil's block attention against ATen's
``scaled_dot_product_attention`` on the same operands, and MKL's packed GEMM against ``addmm``
at MiniLM's linear shapes. Prints one JSON document.

    .venv/bin/python -m benchmarks.block_attention --threads 1,2 --rounds 60

Attention cases: MiniLM's (12 heads of 32, 128 tokens, batch 1 and 8, an additive padding mask,
queries, keys and values read from one fused QKV projection as the compiled model reads them)
and causal prompts with grouped KV heads (the tiny Llama's 8 / 2 heads of 32, the ~100M
Llama's 12 / 4 heads of 64). ``cuvil``: ``torch.ops.cuvil_native.block_attention``, which runs
the call itself on AVX-512 and AVX2 CPUs (``native`` says whether it did) and hands it to ATen's
kernel elsewhere; ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``.

GEMM cases: a fused linear's ``x W^T + b`` through ``torch.addmm`` on a transposed copy of
``W`` (MKL packs ``W`` inside every call) against ``cblas_sgemm_compute`` on a copy packed
once (backends/cpu/packed_gemm.py), packed for each row class and for the other one.

The candidates of a case run interleaved, call by call, over ``--rounds`` rounds (a host that
slows down mid-case slows all alike); each figure is the median ms, with the ratio to ATen's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.host import cpu_name, emit
from cuvil.backends.cpu import packed_gemm, plan_loop

# batch, heads, kv heads, tokens, head dim, causal
ATTENTION = (
    (1, 12, 12, 128, 32, False),
    (8, 12, 12, 128, 32, False),
    (1, 8, 2, 128, 32, True),
    (1, 12, 4, 128, 64, True),
    (1, 12, 4, 512, 64, True),
)
GEMMS = ((128, 384, 1152), (128, 1536, 384), (1024, 384, 1152), (1024, 1536, 384))  # M, K, N


def interleaved(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median ms of each call, the calls taking turns."""
    for call in calls.values():
        call()
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    return {name: round(statistics.median(found) * 1e3, 4) for name, found in times.items()}


def attention_case(shape: tuple[Any, ...], rounds: int) -> dict[str, Any]:
    batch, heads, kv_heads, tokens, dim, causal = shape
    generator = torch.Generator().manual_seed(0)
    mask = None
    if causal:
        q = torch.randn(batch, heads, tokens, dim, generator=generator)
        k, v = (torch.randn(batch, kv_heads, tokens, dim, generator=generator) for _ in range(2))
    else:  # split from a fused projection [batch, tokens, 3, heads, dim], as MiniLM's are
        qkv = torch.randn(batch, tokens, 3, heads, dim, generator=generator)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        mask = torch.zeros(batch, 1, tokens, tokens)
    gqa = kv_heads != heads
    block = torch.ops.cuvil_native.block_attention
    times = interleaved(
        {
            "cuvil": lambda: block(q, k, v, mask, causal, None, gqa),
            "sdpa": lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
            ),
        },
        rounds,
    )
    difference = block(q, k, v, mask, causal, None, gqa) - F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
    )
    return {
        "batch": batch,
        "heads": heads,
        "kv_heads": kv_heads,
        "tokens": tokens,
        "head_dim": dim,
        "causal": causal,
        "native": bool(torch.ops.cuvil_native.block_attention_takes(q, k, v, mask, causal, gqa)),
        "median_ms": times,
        "cuvil / sdpa": round(times["cuvil"] / times["sdpa"], 3),
        "max_abs_diff": float(difference.abs().max()),
    }


def gemm_case(shape: tuple[int, int, int], rounds: int) -> dict[str, Any]:
    rows, width, features = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=generator)
    weight = torch.randn(features, width, generator=generator)
    bias = torch.randn(features, generator=generator)
    transposed = weight.t().contiguous()
    packing = packed_gemm.functions()
    if packing is None:
        return {"rows": rows, "in": width, "out": features, "error": "MKL packing not offered"}
    linear = torch.ops.cuvil_native.packed_linear
    own = packed_gemm.row_class(rows)
    other = next(made for _, made in packed_gemm.ROW_CLASSES if made != own)
    packs = {made: packed_gemm.pack(weight, packing, made) for made in (own, other)}
    calls = {
        "addmm": lambda: torch.addmm(bias, x, transposed),
        f"packed for {own} rows": lambda: linear(packing.compute, x, packs[own], features, bias),
        f"packed for {other} rows": lambda: linear(
            packing.compute, x, packs[other], features, bias
        ),
    }
    times = interleaved(calls, rounds)
    flops = 2 * rows * width * features
    return {
        "rows": rows,
        "in": width,
        "out": features,
        "median_ms": times,
        "gflops": {name: round(flops / ms / 1e6, 1) for name, ms in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if not plan_loop.load():
        raise SystemExit(f"the native library is not loaded: {plan_loop.reason()}")
    runs: dict[str, Any] = {}
    for threads in (int(part) for part in args.threads.split(",")):
        torch.set_num_threads(threads)
        runs[str(threads)] = {
            "attention": [attention_case(shape, args.rounds) for shape in ATTENTION],
            "gemm": [gemm_case(shape, args.rounds) for shape in GEMMS],
        }
    report = {
        "environment": {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "cpu": cpu_name(),
            "load_average": list(os.getloadavg()),
            "torch": torch.__version__,
        },
        "threads": runs,
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()

"""Cuvil's int8-weight GEMM (``backends/cpu/int8_weights.py``: AMX int8 tiles, rows as two int8
digits) against oneDNN's bf16 GEMM on the same weight in bf16, per row count and weight shape,
in one process. Prints one JSON document.

    .venv/bin/python -m benchmarks.int8_weight_gemm

The shapes are a ~100M Llama's (hidden 768, intermediate 2048, 12 heads, 4 KV heads): its
fused QKV, output, gate-up and down projections and its LM head. A decode step multiplies a few
rows by every weight once, so the weights come from memory: each timed pass cycles through
``--weights`` distinct weights of a shape (one for the LM head) and reports milliseconds per
pass; the two paths alternate, the best of ``--repeats`` passes kept. ``bf16_over_int8``: the
bf16 GEMM's time over the int8 kernel's (> 1: int8 is faster); ``gb_per_s``: weight bytes read
per second. Both write bf16 results (the values a low-activation graph passes on);
``max_relative_error``: the int8 kernel's largest difference, writing fp32, from F.linear in
fp32 on the dequantized weight, relative to the result's largest value. Needs AMX-INT8.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.host import cpu_name, emit
from cuvil.backends.cpu import int8_weights
from cuvil.passes.precision import quantize_rows

ROWS = (1, 4, 16, 64, 128)
SHAPES = {  # name: (out features, in features, weights per pass)
    "qkv": (1280, 768, 12),
    "output": (768, 768, 12),
    "gate_up": (4096, 768, 12),
    "down": (768, 2048, 12),
    "lm_head": (32000, 768, 1),
}


def best_ms(call: Callable[[], Any], repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def shape_rows(name: str, rows: int, repeats: int) -> dict[str, Any]:
    out_features, in_features, count = SHAPES[name]
    weights = [torch.randn(out_features, in_features) for _ in range(count)]
    quantized = [quantize_rows(w) for w in weights]
    int8 = [int8_weights.Int8WeightLinear(q, s, None, "none", True) for q, s in quantized]
    bf16 = [
        torch.ops.mkldnn._reorder_linear_weight((q.float() * s[:, None]).bfloat16(), None)
        for q, s in quantized
    ]
    x = torch.randn(rows, in_features).bfloat16()
    linear = torch.ops.mkldnn._linear_pointwise

    def run_int8() -> None:
        for path in int8:
            path(x)

    def run_bf16() -> None:
        for packed in bf16:
            linear(x, packed, None, "none", [], "")

    times = {"int8": float("inf"), "bf16": float("inf")}
    for _ in range(3):  # alternate the two, keep each one's best
        times["int8"] = min(times["int8"], best_ms(run_int8, repeats))
        times["bf16"] = min(times["bf16"], best_ms(run_bf16, repeats))
    q, s = quantized[0]
    expected = F.linear(x.float(), q.float() * s[:, None])
    fp32_result = int8_weights.Int8WeightLinear(q, s, None, "none", False)(x)
    error = float((fp32_result - expected).abs().max() / expected.abs().max())
    megabytes = out_features * in_features * count / 1e6
    return {
        "rows": rows,
        "int8_ms": round(times["int8"], 3),
        "bf16_ms": round(times["bf16"], 3),
        "bf16_over_int8": round(times["bf16"] / times["int8"], 2),
        "gb_per_s": {
            "int8": round(megabytes / times["int8"], 1),
            "bf16": round(2 * megabytes / times["bf16"], 1),
        },
        "max_relative_error": round(error, 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    parser.add_argument("--out", type=str)
    args = parser.parse_args()
    if not int8_weights.offered():
        raise SystemExit("the int8 kernel is not offered here (needs AMX-INT8)")
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    names = args.shapes.split(",")
    results = {name: [shape_rows(name, r, args.repeats) for r in rows] for name in names}
    totals = {}
    for index, count in enumerate(rows):
        int8 = sum(results[name][index]["int8_ms"] for name in names)
        bf16 = sum(results[name][index]["bf16_ms"] for name in names)
        totals[count] = {
            "int8_ms": round(int8, 3),
            "bf16_ms": round(bf16, 3),
            "bf16_over_int8": round(bf16 / int8, 2),
        }
    result = {
        "cpu": f"{cpu_name()} x{torch.get_num_threads()} threads",
        "shapes": {name: list(SHAPES[name]) for name in names},
        "results": results,
        "all_shapes": totals,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()

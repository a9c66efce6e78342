"""Cuvil's bf16-weight GEMM (``backends/cpu/bf16_weights.py``) against MKL's fp32 GEMM on the
widened weight, per row count, for each ISA code this CPU runs, in one process. Prints one
JSON document.

    .venv/bin/python -m benchmarks.bf16_weight_gemm --in-features 768 --out-features 4096

A decode step multiplies a few rows by every weight of the model once, so the weights come
from memory, not cache: each timed pass cycles through ``--weights`` distinct weights of the
same shape and reports milliseconds per weight. The paths run interleaved, round by round (the
best round's median). ``mkl_over``, per code and row count: MKL's time over the code's (> 1:
the bf16-weight code is faster). ``max_abs_error``:
each code's largest difference from MKL's product on the widened weight (the same values, up
to summation order). On an AVX-512 CPU both codes run (4: AVX-512, 3: AVX2), on an AVX2 CPU
only code 3.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.host import cpu_name, emit
from cuvil.backends.cpu import bf16_weights

ROWS = (1, 2, 4, 8, 16, 64)
CODES = {4: "avx512", 3: "avx2"}


def ms_per_weight(call: Callable[[int], Any], weights: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for index in range(weights):
            call(index)
        times.append((time.perf_counter() - started) / weights)
    return statistics.median(times) * 1e3


def calls(
    x: torch.Tensor, widened: list[torch.Tensor], packed: list[torch.Tensor], codes: dict[str, int]
) -> dict[str, Callable[[int], Any]]:
    """Path -> a call on ``x`` and weight i: MKL on the widened weight, each code on the packed."""
    gemm = torch.ops.cuvil_native.bf16_weight_linear
    features = int(widened[0].shape[0])
    paths: dict[str, Callable[[int], Any]] = {"mkl_fp32": lambda i: torch.mm(x, widened[i].t())}
    for name, isa in codes.items():
        paths[name] = functools.partial(code_call, gemm, x, packed, features, isa)
    return paths


def code_call(
    gemm: Any, x: torch.Tensor, packed: list[torch.Tensor], features: int, isa: int, index: int
) -> Any:
    return gemm(x, packed[index], features, None, None, isa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-features", type=int, default=768)
    parser.add_argument("--out-features", type=int, default=4096)
    parser.add_argument("--weights", type=int, default=16, help="distinct weights cycled")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="passes per round")
    parser.add_argument("--out")
    args = parser.parse_args()
    level = bf16_weights.isa_level()
    if not level:
        parser.error("the bf16-weight GEMM is not offered on this CPU (bf16_weights.offered())")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = (args.out_features, args.in_features)
    weights = [torch.randn(shape).bfloat16() for _ in range(args.weights)]
    packed = [bf16_weights.pack(weight) for weight in weights]
    widened = [weight.float() for weight in weights]
    codes = {name: isa for isa, name in CODES.items() if isa <= level}
    best: dict[str, dict[str, float]] = {}
    errors: dict[str, float] = {}
    for rows in (int(count) for count in args.rows.split(",")):
        x = torch.randn(rows, args.in_features)
        paths = calls(x, widened, packed, codes)
        reference = torch.mm(x, widened[0].t())
        for name in codes:
            error = (paths[name](0) - reference).abs().max().item()
            errors[name] = max(errors.get(name, 0.0), error)
        timings = best.setdefault(str(rows), {})
        for _ in range(args.rounds):
            for name, call in paths.items():
                ms = ms_per_weight(call, args.weights, args.repeats)
                timings[name] = min(timings.get(name, ms), ms)
    result = {
        "cpu": f"{cpu_name()} x{os.cpu_count()}",
        "threads": args.threads,
        "weight": {"out_features": args.out_features, "in_features": args.in_features},
        "weights_cycled": args.weights,
        "codes": codes,
        "ms_per_weight": {rows: {k: round(v, 4) for k, v in t.items()} for rows, t in best.items()},
        "mkl_over": {
            name: {rows: round(t["mkl_fp32"] / t[name], 3) for rows, t in best.items()}
            for name in codes
        },
        "max_abs_error": errors,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()

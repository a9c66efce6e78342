"""A bf16 generation model's steps with its GEMMs in oneDNN's bf16 against fp32 compute (the
weights widened, and Cuvil's bf16-weight GEMM among the paths), in one process. Prints one
JSON document.

    .venv/bin/python -m benchmarks.bf16_compute --model llama_100m

On a CPU with AVX-512 but without AVX512-BF16 or AMX, ATen offers oneDNN's bf16, which
emulates it there; Cuvil computes in fp32 instead unless ``CUVIL_BF16_GEMM=onednn``
(``cuvil/backends/cpu/linear_kernels.py``, ``has_onednn_bf16``). This compiles
``generate.py``'s model with ``precision="bf16"`` once each way (the choice is made at compile
and load: the activations between GEMMs, the kernels), warms both up as the sidecar does, then
times decode steps of 1, 4 and 16 rows and prompt chunks of 32 and 128 tokens, the two models
interleaved round by round (median of each round, best round). ``onednn_over_fp32`` > 1: the
fp32 compute is faster. ``decode_paths``: per decode row bucket, how many of the decode graph's
GEMM choices took each path (``bf16_weights``: Cuvil's bf16-weight GEMM). On a CPU with native
bf16 both settings are oneDNN's bf16, and on one without AVX-512 both compute in fp32 (ATen
offers no bf16 there): the ratios are then about 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from benchmarks.generate import MAX_SEQ, MODELS
from benchmarks.host import cpu_name, emit

SETTINGS = {"onednn_bf16": "onednn", "fp32_compute": "auto"}
DECODE_ROWS = (1, 4, 16)
PROMPT_TOKENS = (32, 128)


def compiled(model: torch.nn.Module, setting: str) -> tuple[Any, float, dict[str, Any]]:
    """The bf16 generation model compiled and warmed up under ``CUVIL_BF16_GEMM=setting``; the
    seconds that took, and what ``execution()`` says it computes in."""
    import cuvil
    from cuvil.backends.cpu import linear_kernels
    from cuvil.runtime.generation import GenerationModel

    os.environ["CUVIL_BF16_GEMM"] = setting
    linear_kernels.has_onednn_bf16.cache_clear()
    started = time.perf_counter()
    example = {"input_ids": torch.randint(3, 100, (1, 8))}
    generation = cuvil.jit(
        model, example, task="text-generation", max_batch=max(DECODE_ROWS), max_seq=MAX_SEQ,
        precision="bf16",
    )  # fmt: skip
    assert isinstance(generation, GenerationModel)
    generation.warm_up(max(PROMPT_TOKENS))
    seconds = time.perf_counter() - started
    execution = generation.execution()
    described = {k: execution[k] for k in ("weights", "gemm_compute")}
    return generation, seconds, described | {"decode_paths": paths(execution["tactics"])}


def paths(tactics: dict[str, dict[int, str]]) -> dict[str, dict[str, int]]:
    """Row bucket -> {path: how many of the decode graph's choices took it}."""
    counted: dict[str, dict[str, int]] = {}
    for buckets in tactics.values():
        for rows, name in buckets.items():
            into = counted.setdefault(str(rows), {})
            into[name] = into.get(name, 0) + 1
    return dict(sorted(counted.items(), key=lambda item: int(item[0])))


def decode_ms(model: Any, rows: int, repeats: int) -> float:
    slots, last = list(range(rows)), torch.randint(3, 100, (rows,))
    positions = torch.full((rows,), 40)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        model.decode(slots, last, positions)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def prompt_ms(model: Any, tokens: int, repeats: int) -> float:
    ids = torch.randint(3, 100, (tokens,))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        model.extend(0, ids, 0)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny_llama")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=8, help="calls per round")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source = MODELS[args.model]()
    models, setup = {}, {}
    for name, setting in SETTINGS.items():
        model, seconds, execution = compiled(source, setting)
        models[name] = model
        setup[name] = {"setup_seconds": round(seconds, 1), **execution}
    cases = [f"decode_{rows}_rows" for rows in DECODE_ROWS]
    cases += [f"prompt_{tokens}_tokens" for tokens in PROMPT_TOKENS]
    best: dict[str, dict[str, float]] = {name: {} for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            measured = [decode_ms(model, rows, args.repeats) for rows in DECODE_ROWS]
            measured += [prompt_ms(model, tokens, args.repeats // 2) for tokens in PROMPT_TOKENS]
            for case, ms in zip(cases, measured, strict=True):
                best[name][case] = min(best[name].get(case, ms), ms)
    result = {
        "model": args.model,
        "threads": args.threads,
        "cpu": f"{cpu_name()} x{os.cpu_count()}",
        "settings": setup,
        "median_ms": {name: {k: round(v, 3) for k, v in b.items()} for name, b in best.items()},
        "onednn_over_fp32": {
            case: round(best["onednn_bf16"][case] / best["fp32_compute"][case], 3) for case in cases
        },
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()

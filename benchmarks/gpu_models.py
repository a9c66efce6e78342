"""GPU benchmark: Cuvil's CUDA plan against eager and torch.compile (default and reduce-overhead),
side by side on one GPU, in fp16 and bf16.

    python -m benchmarks.gpu_models --runs 50 --warmup 10 --out gpu.json

Models: the MLP, ResNet-50 (batch 1), MiniLM (sequence 128, batch 1 and 8; a MiniLM-shaped BERT
with random weights where the bundled one is not installed) and the tiny Llama (sequence 128).
For each model and precision, in one process: eager is the model in that dtype on the GPU;
torch.compile compiles it (Inductor, default and ``mode="reduce-overhead"``, which replays CUDA
graphs); Cuvil compiles the fp32 model for this GPU's architecture at that precision
(``cuvil.jit(..., target="cuda-sm_XY", precision=...)``: its GEMM weights in the precision, fp32
between ops), captures the CUDA graph of the benchmark shape (``prepare``) and runs on the
caller's GPU tensors. Every call is timed from a synchronised start to a synchronised end (what
a batch-1 request waits for), peers interleaved round by round. Errors are against eager fp32 on
the GPU with TF32 off. Prints one JSON document: per case the rows (median and p90 ms, error,
setup seconds) and Cuvil's ratios (peer ms / Cuvil ms: above 1 means Cuvil is faster). A peer
that fails records its error; ``--budget-s`` skips what would start after the budget is spent.
On a machine without a GPU it exits 2 saying so.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.peers import first_tensor

Inputs = dict[str, torch.Tensor]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PEERS = ("eager", "torch.compile", "torch.compile reduce-overhead", "cuvil")


def _minilm(batch: int) -> tuple[torch.nn.Module, Inputs, Any]:
    try:
        from cuvil.models import catalog

        spec = catalog.minilm()
        model = spec.model
    except Exception:  # the bundled weights are not installed: the same shapes, random weights
        from transformers import BertConfig, BertModel

        config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                            intermediate_size=1536, vocab_size=30522)  # fmt: skip
        torch.manual_seed(0)
        model = BertModel(config).eval()
    ids = torch.randint(1000, 30000, (batch, 128), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return model, inputs, None


def _catalog(name: str, make: Callable[[torch.Generator], Inputs]) -> Callable[[], Any]:
    def build() -> tuple[torch.nn.Module, Inputs, Any]:
        from cuvil.models import catalog

        spec = getattr(catalog, name)()
        return spec.model, make(torch.Generator().manual_seed(0)), spec.dynamic_shapes

    return build


CASES: dict[str, Callable[[], tuple[torch.nn.Module, Inputs, Any]]] = {
    "mlp": _catalog("mlp", lambda g: {"x": torch.randn(1, 784, generator=g)}),
    "resnet50": _catalog(
        "resnet50", lambda g: {"pixel_values": torch.randn(1, 3, 224, 224, generator=g)}
    ),
    "minilm": lambda: _minilm(1),
    "minilm_b8": lambda: _minilm(8),
    "tiny_llama": _catalog(
        "tiny_llama", lambda g: {"input_ids": torch.randint(0, 2048, (1, 128), generator=g)}
    ),
}


def on_gpu(inputs: Inputs, dtype: torch.dtype | None = None) -> Inputs:
    """The inputs on the GPU, floating ones in ``dtype`` (ids and masks keep theirs)."""
    return {
        name: t.cuda().to(dtype) if dtype is not None and t.is_floating_point() else t.cuda()
        for name, t in inputs.items()
    }


def _eager_peer(model: torch.nn.Module, dtype: torch.dtype, inputs: Inputs) -> Callable[[], Any]:
    low = copy.deepcopy(model).to("cuda", dtype)
    placed = on_gpu(inputs, dtype)
    return lambda: low(**placed)


def _compiled_peer(mode: str | None) -> Callable[[torch.nn.Module, torch.dtype, Inputs], Any]:
    def build(model: torch.nn.Module, dtype: torch.dtype, inputs: Inputs) -> Callable[[], Any]:
        compiled = torch.compile(copy.deepcopy(model).to("cuda", dtype), mode=mode)
        placed = on_gpu(inputs, dtype)
        return lambda: compiled(**placed)

    return build


def cuvil_peer(
    model: torch.nn.Module, precision: str, inputs: Inputs, dynamic_shapes: Any
) -> Callable[[], Any]:
    import cuvil

    major, minor = torch.cuda.get_device_capability()
    compiled = cuvil.jit(
        copy.deepcopy(model).float().cpu(),
        dict(inputs),
        target=f"cuda-sm_{major}{minor}",
        precision=precision,
        dynamic_shapes=dynamic_shapes,
    )
    placed = on_gpu(inputs)
    compiled.prepare(placed)
    return lambda: compiled.run(placed)


def time_round_robin(calls: dict[str, Callable[[], Any]], runs: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            call()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().clamp_min(1e-12)
    return float((got.float() - want.float()).abs().max() / scale)


def run_case(name: str, precision: str, options: argparse.Namespace) -> dict[str, Any]:
    model, inputs, dynamic_shapes = CASES[name]()
    model = model.eval()
    dtype = DTYPES[precision]
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with torch.inference_mode():
        reference = first_tensor(copy.deepcopy(model).cuda()(**on_gpu(inputs)))
    builders: dict[str, Callable[[], Callable[[], Any]]] = {
        "eager": lambda: _eager_peer(model, dtype, inputs),
        "torch.compile": lambda: _compiled_peer(None)(model, dtype, inputs),
        "torch.compile reduce-overhead": lambda: _compiled_peer("reduce-overhead")(
            model, dtype, inputs
        ),
        "cuvil": lambda: cuvil_peer(model, precision, inputs, dynamic_shapes),
    }
    rows: dict[str, dict[str, Any]] = {}
    calls: dict[str, Callable[[], Any]] = {}
    for peer in options.peers:
        start = time.perf_counter()
        try:
            call = builders[peer]()
            with torch.inference_mode():
                for _ in range(options.warmup):
                    out = call()
                rows[peer] = {
                    "setup_s": round(time.perf_counter() - start, 2),
                    "max_relative_error": relative_error(first_tensor(out), reference),
                }
            calls[peer] = call
        except Exception as error:  # recorded in its row; the other peers go on
            rows[peer] = {"error": f"{type(error).__name__}: {error}"[:800]}
    with torch.inference_mode():
        times = time_round_robin(calls, options.runs)
    for peer, measured in times.items():
        ordered = sorted(measured)
        rows[peer]["median_ms"] = round(statistics.median(ordered), 4)
        rows[peer]["p90_ms"] = round(ordered[int(0.9 * (len(ordered) - 1))], 4)
    return {"rows": rows, "ratios": ratios(rows)}


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Peer median / Cuvil median for every peer that ran (above 1: Cuvil is faster)."""
    mine = rows.get("cuvil", {}).get("median_ms")
    if not mine:
        return {}
    return {
        f"{peer} / cuvil": round(row["median_ms"] / mine, 3)
        for peer, row in rows.items()
        if peer != "cuvil" and row.get("median_ms")
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--precisions", default="fp16,bf16")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=float("inf"))
    parser.add_argument("--out", type=Path)
    options = parser.parse_args(argv)
    options.models = [m for m in options.models.split(",") if m]
    options.precisions = [p for p in options.precisions.split(",") if p]
    options.peers = [p for p in options.peers.split(",") if p]
    for values, known, what in (
        (options.models, CASES, "model"),
        (options.precisions, DTYPES, "precision"),
        (options.peers, PEERS, "peer"),
    ):
        unknown = [value for value in values if value not in known]
        if unknown:
            parser.error(f"unknown {what}(s) {unknown}; choose from {list(known)}")
    return options


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu_models: no CUDA device on this machine", file=sys.stderr)
        return 2
    started = time.perf_counter()
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "capability": "sm_{}{}".format(*torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "runs": options.runs,
        "cases": {},
    }
    for precision in options.precisions:
        for name in options.models:
            key = f"{name} {precision}"
            if time.perf_counter() - started > options.budget_s:
                results["cases"][key] = {"skipped": f"time budget of {options.budget_s} s spent"}
                continue
            print(f"benchmarking {key}", file=sys.stderr, flush=True)
            results["cases"][key] = run_case(name, precision, options)
    results["seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(results, indent=1)
    if options.out:
        options.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

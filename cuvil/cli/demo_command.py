"""``cuvil demo``: the main job on embedded defaults, end to end on this machine.

Compiles the bundled models, stores each artifact, loads it back as a fresh artifact would be
loaded (no model code), checks it against eager PyTorch, times both, and prints the report.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cuvil.api import jit, load
from cuvil.cli.spec import load_factory_spec
from cuvil.verify import compare_outputs

DEFAULT_MODELS = ("cuvil.models:minilm", "cuvil.models:resnet50")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="compile, store, load and run the bundled models")
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), metavar="SPEC")
    parser.add_argument("--out", type=Path, default=Path("out"), help="where artifacts go")
    parser.add_argument("--runs", type=int, default=20)
    parser.set_defaults(handler=run_demo)


def median_ms(fn: Callable[[], Any], runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def demo_one(spec_text: str, out: Path, runs: int) -> dict[str, Any]:
    spec = load_factory_spec(spec_text)
    compiled = jit(
        spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes, name=spec.name
    )
    path = compiled.save(out / f"{spec.name}.cuvil")
    loaded = load(path)
    inputs = {
        k.removeprefix("input."): v
        for k, v in loaded.contents.golden.items()
        if k.startswith("input.")
    }
    expected = {
        k.removeprefix("output."): v
        for k, v in loaded.contents.golden.items()
        if k.startswith("output.")
    }
    errors = compare_outputs(loaded.run(inputs), expected)
    with torch.no_grad():
        eager_ms = median_ms(lambda: spec.model(**inputs), runs)
    cuvil_ms = median_ms(lambda: loaded.run(inputs), runs)
    report = compiled.report
    return {
        "model": spec.name,
        "artifact": str(path),
        "artifact_bytes": path.stat().st_size,
        "compile_seconds": report["compile_seconds"],
        "ops": {"before": report["ops_before"], "after": report["ops_after"]},
        "top_ops": dict(list(report["op_histogram"].items())[:6]),
        "inputs": {k: list(v.shape) for k, v in inputs.items()},
        "max_error_relative_to_scale": max(e.relative_to_scale for e in errors),
        "latency_ms": {
            "eager": round(eager_ms, 3),
            "cuvil": round(cuvil_ms, 3),
            "speedup": round(eager_ms / cuvil_ms, 3),
        },
    }


def run_demo(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for spec_text in args.models:
        print(f"== {spec_text}", flush=True)
        result = demo_one(spec_text, args.out, args.runs)
        results.append(result)
        print(json.dumps(result, indent=2), flush=True)
    ok = all(r["max_error_relative_to_scale"] <= 1e-4 for r in results)
    print(json.dumps({"demo": "ok" if ok else "verification failed", "models": len(results)}))
    return 0 if ok else 1

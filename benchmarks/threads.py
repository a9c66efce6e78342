"""Two Python threads calling one compiled model at once, against one thread: does a call hold
the GIL? Each thread runs with ``torch.set_num_threads(1)``, so two threads can use two cores
only if neither holds the GIL while the model computes. Also the fixed cost of one call of a
tiny graph: the MLP and a one-linear model at batch 1, Cuvil against eager (``call_overhead``).

    .venv/bin/python -m benchmarks.threads --models mlp resnet18 minilm --calls 40

Per model: Cuvil (prepared at the shape first, so its calls run the native schedules) and eager
PyTorch, each timed as ``--calls`` calls on one thread, then ``--calls`` calls on each of two
threads at once; rounds interleave (one, two, one, two ...) and the medians over ``--rounds`` are
kept. Throughput ratio = two threads' calls per second over one thread's (2.0 is perfect
scaling). Prints one JSON document; see benchmarks/README.md. Needs two idle cores for a
meaningful ratio: the host's load average is recorded with the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cuvil
from benchmarks.host import cpu_name
from cuvil.models import catalog

# model -> inputs at the benchmark shape
INPUTS: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
    "mlp": lambda: {"x": torch.randn(64, 784)},
    "resnet18": lambda: {"pixel_values": torch.randn(1, 3, 224, 224)},
    "minilm": lambda: {
        "input_ids": torch.randint(1000, 30000, (1, 128)),
        "attention_mask": torch.ones(1, 128, dtype=torch.int64),
    },
}


def _timed(call: Callable[[], Any], calls: int, threads: int) -> float:
    """Seconds for ``threads`` threads to make ``calls`` calls each."""
    start = threading.Barrier(threads + 1)

    def work() -> None:
        torch.set_num_threads(1)
        with torch.inference_mode():
            start.wait()
            for _ in range(calls):
                call()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    began = time.perf_counter()
    for worker in workers:
        worker.join()
    return time.perf_counter() - began


def measure(call: Callable[[], Any], calls: int, rounds: int) -> dict[str, float]:
    one, two = [], []
    for _ in range(rounds):
        one.append(_timed(call, calls, 1))
        two.append(_timed(call, calls, 2))
    single, double = statistics.median(one), statistics.median(two)
    return {
        "one_thread_calls_per_s": round(calls / single, 2),
        "two_threads_calls_per_s": round(2 * calls / double, 2),
        "throughput_ratio": round((2 * calls / double) / (calls / single), 3),
    }


def run_model(name: str, calls: int, rounds: int) -> dict[str, Any]:
    spec = getattr(catalog, name)()
    inputs = INPUTS[name]()
    compiled = cuvil.jit(spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes)
    torch.set_num_threads(1)  # schedules are per thread count: settle at the one used
    compiled.prepare(inputs)
    plan_loop = compiled.execution()["plan_loop"]
    row = {
        "cuvil": measure(lambda: compiled.run(inputs), calls, rounds),
        "eager": measure(lambda: spec.model(**inputs), calls, rounds),
        "plan_loop": plan_loop,
    }
    return row


def call_overhead(calls: int, rounds: int) -> dict[str, Any]:
    """Median microseconds per call at batch 1, one thread, interleaved rounds: the MLP and a
    one-linear model (784 -> 10), Cuvil's ``compiled(x)`` against eager."""
    torch.manual_seed(0)
    spec = catalog.mlp()
    linear = torch.nn.Linear(784, 10).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    compiled_mlp = cuvil.jit(spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes)
    compiled_linear = cuvil.jit(
        linear, (torch.randn(2, 784),), dynamic_shapes={"input": {0: batch}}
    )
    models = {"mlp": (spec.model, compiled_mlp), "linear": (linear, compiled_linear)}
    x = torch.randn(1, 784)
    torch.set_num_threads(1)
    candidates: dict[str, Callable[[], Any]] = {}
    for name, (eager, compiled) in models.items():
        compiled.prepare({compiled.signature.input_names[0]: x})
        compiled(x)  # a checked call: later ones take the direct path
        candidates[f"{name}_eager"] = functools.partial(eager, x)
        candidates[f"{name}_cuvil"] = functools.partial(compiled, x)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, call in candidates.items():
                began = time.perf_counter()
                for _ in range(calls):
                    call()
                times[name].append((time.perf_counter() - began) / calls * 1e6)
    row: dict[str, Any] = {
        f"{name}_us": round(statistics.median(t), 1) for name, t in times.items()
    }
    row["plan_loop"] = {
        name: compiled.execution()["plan_loop"] for name, (_, compiled) in models.items()
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "resnet18", "minilm"])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = {
        "cpu": cpu_name(),
        "load_average_before": os.getloadavg(),
        "models": {name: run_model(name, args.calls, args.rounds) for name in args.models},
        "call_overhead": call_overhead(args.calls * 50, args.rounds * 3),
        "load_average_after": os.getloadavg(),
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

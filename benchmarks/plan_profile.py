"""Where a settled Cuvil plan spends its time, step by step, beside ONNX Runtime's per-node profile.

    .venv/bin/python -m benchmarks.plan_profile --model resnet50 --threads 1 --runs 40 [--ort]

The model of a ``benchmarks/cpu_models.py`` case is compiled and prepared (its kernel choices
made), then its Python plan runs ``--runs`` times with every step's kernel timed; each step's
figure is its fastest call (the call no neighbour on a shared host slowed), with the path its
tactic chose. ``--ort`` adds ONNX Runtime's own profile of the same case (its per-node kernel
times, ``SessionOptions.enable_profiling``), fastest call per node. Prints one JSON document.
Step times are of the Python plan (the native plan loop runs the same kernels without the
interpreter between them); on a busy host compare figures from one run only.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.cpu_models import CASES, load_spec
from benchmarks.peers import Case, export_onnx, ort_session_options


def _timed(kernel: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = kernel(*args, **kwargs)
        into.append(time.perf_counter() - start)
        return result

    return run


def cuvil_steps(case: Case, runs: int) -> dict[str, Any]:
    """Each data step's fastest call (ms), slowest first, with its kernel and chosen paths."""
    import cuvil

    spec = case.spec
    compiled = cuvil.jit(
        spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes, name=spec.name
    )
    compiled.prepare(case.inputs)
    plan, symbols = compiled.plan, compiled.bind(case.inputs)
    times: dict[str, list[float]] = collections.defaultdict(list)
    steps = [
        dataclasses.replace(step, kernel=_timed(step.kernel, times[step.name]))
        for step in plan.data_steps
    ]
    with torch.inference_mode():
        for _ in range(runs):
            slots = plan.start(case.inputs, symbols)
            plan.execute(steps, slots, symbols)
    rows: list[dict[str, Any]] = []
    for step in plan.data_steps:
        kernel = getattr(step.kernel, "__qualname__", type(step.kernel).__name__)
        chosen = step.choices.describe() if step.choices is not None else {}
        fastest = min(times[step.name]) * 1e3
        rows.append({"step": step.name, "ms": round(fastest, 4), "kernel": str(kernel)})
        if chosen:
            rows[-1]["chosen"] = {str(key): name for key, name in chosen.items()}
    rows.sort(key=lambda row: -float(row["ms"]))
    return {"sum_ms": round(sum(float(row["ms"]) for row in rows), 3), "steps": rows}


def ort_nodes(case: Case, runs: int) -> dict[str, Any]:
    """ONNX Runtime's per-node kernel times (fastest call, ms), slowest first."""
    import onnxruntime as ort

    path, _ = export_onnx(case)
    options = ort_session_options(case)
    options.enable_profiling = True
    options.profile_file_prefix = str(case.workdir / case.name)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feed = {name: tensor.numpy() for name, tensor in case.inputs.items()}
    for _ in range(runs):
        session.run(None, feed)
    events = json.loads(Path(session.end_profiling()).read_text())
    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    suffix = "_kernel_time"
    for event in events:
        name = str(event.get("name", ""))
        if event.get("cat") == "Node" and name.endswith(suffix):
            op_name = str(event.get("args", {}).get("op_name", ""))
            times[(name[: -len(suffix)], op_name)].append(float(event["dur"]) / 1e3)
    rows: list[dict[str, Any]] = [
        {"node": node, "op": op_name, "ms": round(min(found), 4)}
        for (node, op_name), found in times.items()
    ]
    rows.sort(key=lambda row: -float(row["ms"]))
    return {"sum_ms": round(sum(float(row["ms"]) for row in rows), 3), "nodes": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, choices=sorted(CASES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--ort", action="store_true", help="add ONNX Runtime's node profile")
    options = parser.parse_args(argv)
    torch.set_num_threads(options.threads)
    factory, build_inputs = CASES[options.model]
    inputs = build_inputs(torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory(prefix="cuvil-profile-") as workdir:
        case = Case(options.model, load_spec(factory), inputs, options.threads, Path(workdir))
        report: dict[str, Any] = {"model": options.model, "threads": options.threads}
        report["cuvil"] = cuvil_steps(case, options.runs)
        if options.ort:
            report["onnxruntime"] = ort_nodes(case, options.runs)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

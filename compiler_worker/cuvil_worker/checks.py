"""Verification against eager fp32, the latency benchmark, and the spec's gates.

All pure functions of a model pair and inputs; the worker's pipeline calls them in order
(validate -> benchmark -> gates) after ``cuvil.jit`` and before anything is packaged.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from cuvil.precisions import PRECISIONS
from cuvil.verify import compare_output, output_scale
from cuvil_worker.errors import GateFailed, InvalidSpec, VerificationFailed

DEFAULT_SAMPLES = 4


def call(model: Callable[..., Any], inputs: Any) -> list[torch.Tensor]:
    """Run ``model`` on inputs given as the example was (dict -> keywords, tuple -> positional)."""
    with torch.no_grad():
        if isinstance(inputs, Mapping):
            outputs = model(**inputs)
        elif isinstance(inputs, tuple | list):
            outputs = model(*inputs)
        else:
            outputs = model(inputs)
    return [leaf for leaf in pytree.tree_leaves(outputs) if isinstance(leaf, torch.Tensor)]


def validate(
    compiled: Callable[..., Any],
    eager: torch.nn.Module,
    samples: list[Any],
    output_names: list[str],
    validation: Mapping[str, Any],
    precision: str = "fp32",
) -> dict[str, Any]:
    """Compiled vs eager fp32 on every golden sample: per output the worst max abs / relative
    error, the lowest cosine and top-1 agreement; fails where an element is off by more than
    ``atol + rtol * |eager|``. An ``atol`` the spec gives is absolute; the precision's default
    is relative to the output's scale (max |eager|, taken as 1 where smaller): a correct fp32
    plan rounds sums in another order than eager (Winograd's transforms scale values by up to
    8x and back), off by a few 1e-6 of that scale, so logits of scale ~200 may differ by ~3e-4
    where eager's is near zero, which an absolute 1e-4 would call a failure."""
    defaults = PRECISIONS.get(precision, PRECISIONS["fp32"])  # rtol/atol per precision
    rtol = float(validation.get("rtol", defaults.rtol))
    scaled = "atol" not in validation
    atol = float(validation.get("atol", defaults.atol))
    worst: dict[str, dict[str, Any]] = {}
    outside: list[str] = []
    for index, sample in enumerate(samples):
        actual, expected = call(compiled, sample), call(eager, sample)
        if len(actual) != len(expected):
            raise VerificationFailed(
                f"compiled model gave {len(actual)} outputs, eager {len(expected)}"
            )
        names = (
            output_names
            if len(output_names) == len(expected)
            else [f"output{i}" for i in range(len(expected))]
        )
        for name, a, e in zip(names, actual, expected, strict=True):
            try:
                error = compare_output(name, a, e)
            except AssertionError as mismatch:
                raise VerificationFailed(f"sample {index}: {mismatch}") from None
            entry = worst.setdefault(
                name,
                {
                    "name": name,
                    "max_abs_error": 0.0,
                    "relative_to_scale": 0.0,
                    "cosine": 1.0,
                    "top1_agreement": None,
                },
            )
            entry["max_abs_error"] = max(entry["max_abs_error"], error.max_abs_error)
            entry["relative_to_scale"] = max(entry["relative_to_scale"], error.relative_to_scale)
            entry["cosine"] = min(entry["cosine"], error.cosine)
            if error.top1_agreement is not None:
                previous = entry["top1_agreement"]
                entry["top1_agreement"] = min(error.top1_agreement, previous or 1.0)
            floor = atol * max(1.0, output_scale(e)) if scaled else atol
            if e.is_floating_point() and not torch.allclose(
                a.double(), e.double(), rtol=rtol, atol=floor
            ):
                outside.append(f"{name} (sample {index}, max abs {error.max_abs_error:.3g})")
    report = {
        "samples": len(samples),
        "rtol": rtol,
        "atol": atol,
        "atol_relative_to_scale": scaled,
        "outputs": list(worst.values()),
        "max_abs_error": max((o["max_abs_error"] for o in worst.values()), default=0.0),
        "max_relative_to_scale": max((o["relative_to_scale"] for o in worst.values()), default=0.0),
        "min_cosine": min((o["cosine"] for o in worst.values()), default=1.0),
        "min_top1_agreement": min(
            (o["top1_agreement"] for o in worst.values() if o["top1_agreement"] is not None),
            default=None,
        ),
    }
    if outside:
        bound = f"atol={atol:g}" + (" x the output's scale" if scaled else "")
        raise VerificationFailed(
            f"outputs differ from eager fp32 beyond rtol={rtol:g} {bound}: "
            + ", ".join(outside[:4])
        )
    return report


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def time_call(model: Callable[..., Any], inputs: Any, sync: Callable[[], None]) -> float:
    """Milliseconds of one call, from a synchronised start to a synchronised end (``sync``: the
    GPU's, where the calls run there)."""
    sync()
    start = time.perf_counter()
    call(model, inputs)
    sync()
    return (time.perf_counter() - start) * 1e3


def benchmark(
    compiled: Callable[..., Any], eager: torch.nn.Module, inputs: Any, iterations: int
) -> dict[str, Any]:
    """p50/p99 latency (ms) of eager and compiled on the example inputs after three untimed
    calls each, timed call by call in turn so that a noisy neighbour slows both alike (a burst
    of load lands on calls of both, not on one side's run of calls); speedup = eager p50 /
    compiled p50. The compiled model is first prepared at the inputs' shape as the sidecar's
    warm-up prepares it (kernel choices not carried from the compile are made then), so the
    figures are the speed it serves at, not its first calls' trials. A model whose plan runs on
    a GPU is timed there against eager on the same GPU (fp32), with both reading GPU inputs."""
    sync: Callable[[], None] = lambda: None  # noqa: E731
    device = getattr(compiled, "device", torch.device("cpu"))
    if device.type == "cuda":
        eager = copy.deepcopy(eager).to(device)
        inputs = pytree.tree_map_only(torch.Tensor, lambda tensor: tensor.to(device), inputs)
        sync = torch.cuda.synchronize
    _prepare(compiled, inputs)
    for _ in range(3):
        call(eager, inputs)
        call(compiled, inputs)
    eager_ms: list[float] = []
    compiled_ms: list[float] = []
    for _ in range(max(1, iterations)):
        eager_ms.append(time_call(eager, inputs, sync))
        compiled_ms.append(time_call(compiled, inputs, sync))
    eager_p50, compiled_p50 = statistics.median(eager_ms), statistics.median(compiled_ms)
    return {
        "iterations": len(compiled_ms),
        "threads": torch.get_num_threads(),
        "eager_p50_ms": round(eager_p50, 4),
        "eager_p99_ms": round(_percentile(eager_ms, 99), 4),
        "compiled_p50_ms": round(compiled_p50, 4),
        "compiled_p99_ms": round(_percentile(compiled_ms, 99), 4),
        "speedup": round(eager_p50 / compiled_p50, 4) if compiled_p50 > 0 else 0.0,
    }


def _prepare(compiled: Callable[..., Any], inputs: Any) -> None:
    """``compiled.prepare`` at the inputs, named as the model's signature names them."""
    prepare = getattr(compiled, "prepare", None)
    signature = getattr(compiled, "signature", None)
    if prepare is None or signature is None:
        return
    if isinstance(inputs, Mapping):
        named = dict(inputs)
    else:
        values = inputs if isinstance(inputs, tuple | list) else (inputs,)
        named = dict(zip(signature.input_names, values, strict=False))
    prepare(named)


def not_measured(why: str) -> dict[str, Any]:
    """The benchmark of a target whose speed this machine cannot measure (a CUDA plan run by
    interpretation on a CPU worker): its speed gates are deferred to where it runs."""
    return {"measured": False, "reason": why}


def _or_one(value: float | None) -> float:
    """Top-1 agreement of a model without class-like outputs: nothing can disagree."""
    return 1.0 if value is None else value


# gates that read the benchmark: deferred where speed is not measured
SPEED_GATES = frozenset({"minSpeedup", "maxLatencyP99Ms"})
# gate name -> (what it reads from the report, how the measured value must compare)
GATES: dict[str, tuple[Callable[[dict[str, Any]], float], str]] = {
    "maxAbsError": (lambda r: r["validation"]["max_abs_error"], "<="),
    "maxRelativeError": (lambda r: r["validation"]["max_relative_to_scale"], "<="),
    "minCosine": (lambda r: r["validation"]["min_cosine"], ">="),
    "minTop1Agreement": (lambda r: _or_one(r["validation"]["min_top1_agreement"]), ">="),
    "minSpeedup": (lambda r: r["benchmark"]["speedup"], ">="),
    "maxLatencyP99Ms": (lambda r: r["benchmark"]["compiled_p99_ms"], "<="),
}


def check_gates(gates: Mapping[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """Every gate of the spec against the report; raises GateFailed naming every gate missed
    (measured value and limit), with the gates and the measured report as its details."""
    unknown = sorted(set(gates) - set(GATES))
    if unknown:
        raise InvalidSpec(f"unknown gates {unknown}; known: {sorted(GATES)}")
    checked = {}
    missed = []
    for gate, limit in gates.items():
        if limit is None:
            continue
        read, relation = GATES[gate]
        if gate in SPEED_GATES and report["benchmark"].get("measured") is False:
            reason = "speed is not measured on this machine; checked where the model runs"
            checked[gate] = {"measured": None, "limit": float(limit), "deferred": reason}
            continue
        measured = float(read(report))
        met = measured <= float(limit) if relation == "<=" else measured >= float(limit)
        checked[gate] = {"measured": measured, "limit": float(limit), "passed": met}
        if not met:
            missed.append(GateFailed.describe(gate, measured, relation, float(limit)))
    if missed:
        measured_report: dict[str, Any] = {
            k: report[k] for k in ("validation", "benchmark") if k in report
        }
        raise GateFailed("; ".join(missed), {"gates": checked, **measured_report})
    return checked

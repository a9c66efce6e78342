"""Planned against measured activation memory, and a text chart of the buffers' lifetimes.

What ``cuvil inspect --memory`` prints. The measurement hooks the allocator: the call runs under
torch's profiler with memory profiling on, which records every allocation and free the CPU
allocator makes on the calling thread (kernels' temporaries and scratch included), and the peak
is the highest running sum of those during the call, over what was allocated before it (the
inputs and weights are not counted; the outputs are, as in the plan). A call is measured after
one unmeasured call, so buffers allocated once per shape (oneDNN scratchpads, packed weights)
are not counted as activations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile

from cuvil.analysis.memory import MemoryPlan, lifetimes
from cuvil.ir import Graph


def measure_peak_bytes(call: Callable[[], Any]) -> int:
    """The peak of bytes allocated and not yet freed during ``call``, from allocator events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        call()
    results = profiler.profiler.kineto_results if profiler.profiler is not None else None
    if results is None:
        return 0
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in results.events()
        if event.name() == "[memory]"
    )
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak


def memory_table(plan: MemoryPlan, measured: int | None) -> list[str]:
    rows = [
        ("planned peak (arena)", plan.arena_bytes),
        ("naive (every intermediate kept)", plan.naive_bytes),
    ]
    if measured is not None:
        rows.append(("measured peak (allocator)", measured))
    width = max(len(name) for name, _ in rows)
    lines = [f"  {name:<{width}}  {value:>14,d} bytes" for name, value in rows]
    if measured is not None and plan.arena_bytes:
        lines.append(f"  measured / planned  {measured / plan.arena_bytes:.3f}")
    return lines


def lifetime_chart(graph: Graph, plan: MemoryPlan, width: int = 64, rows: int = 40) -> list[str]:
    """One line per buffer (the ``rows`` largest, in the order they are made): its size, its
    offset, and a bar over the steps it is alive for, ``width`` columns for the whole graph."""
    spans = lifetimes(graph)
    steps = max(len(graph.nodes), 1)
    largest = sorted(plan.sizes, key=lambda v: -plan.sizes[v])[:rows]
    chosen = sorted(largest, key=lambda v: spans[v])
    label = max((len(str(v)) for v in chosen), default=0)
    lines = [f"  {'buffer':<{label}}  {'bytes':>11}  {'offset':>11}  steps 0..{steps}"]
    for value in chosen:
        first, last = spans[value]
        start = first * width // steps
        end = max(start + 1, (last + 1) * width // steps)
        bar = " " * start + "#" * (end - start)
        lines.append(
            f"  {value!s:<{label}}  {plan.sizes[value]:>11,d}  {plan.offsets[value]:>11,d}  "
            f"|{bar:<{width}}|"
        )
    hidden = len(plan.sizes) - len(chosen)
    if hidden > 0:
        lines.append(f"  ... and {hidden} smaller buffers")
    return lines

"""CUDA graphs per input shape: a plan's launches (Cuvil's kernels and ATen's cuBLAS/cuDNN
calls alike) captured once over static input buffers and replayed per call, so a call costs one
graph launch and two copies instead of one Python dispatch per op.

A shape is captured when ``capture`` is called for it (warm-up: ``CompiledModel.prepare``, which
the sidecar runs for every bucket before it reports ready) or on its ``CAPTURE_AFTER``-th call;
before that, calls run the plan directly. The latest ``CAPACITY`` shapes keep their graphs.
Each graph has its own static inputs and outputs and a lock: a call copies its inputs in
(device to device for GPU tensors: no host round trip), replays, and returns clones of the
outputs, so callers never see a later call's values. Shape-only values the plan cached for the
shape (shape_cache.py) are held by the graph, which reads their memory. The capture itself is
a parameter (``cuda_capture`` on a GPU), so this bookkeeping is tested on the CPU with a
stand-in graph that replays by running the plan into the captured outputs.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from cuvil.backends.cuda.gpu import gpu_math
from cuvil.runtime.plan import ExecutionPlan

CAPACITY = 32
CAPTURE_AFTER = 2
WARMUP_RUNS = 2  # before a capture, on a side stream: cuBLAS workspaces, cuDNN plans, caches

log = logging.getLogger("cuvil.backends.cuda")
ShapeKey = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


def shape_key(inputs: Mapping[str, torch.Tensor]) -> ShapeKey:
    return tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(inputs.items()))


class Replayable(Protocol):
    def replay(self) -> None: ...


# (device, the call to capture) -> the graph and the outputs its replays write into
CaptureFn = Callable[
    [torch.device, Callable[[], dict[str, Any]]], tuple[Replayable, dict[str, Any]]
]


def cuda_capture(
    device: torch.device, run: Callable[[], dict[str, Any]]
) -> tuple[Replayable, dict[str, Any]]:
    """Warm-up runs on a side stream (cuBLAS workspaces, cuDNN plans, the plan's shape cache),
    then one run captured into a CUDA graph."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            run()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = run()
    return graph, outputs


@dataclass
class Captured:
    graph: Replayable
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, Any]
    held: Any  # the plan's cached shape-only values the graph reads
    lock: threading.Lock = field(default_factory=threading.Lock)

    def replay(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        with self.lock:
            for name, tensor in inputs.items():
                self.inputs[name].copy_(tensor, non_blocking=True)
            self.graph.replay()
            return {
                name: value.clone() if isinstance(value, torch.Tensor) else value
                for name, value in self.outputs.items()
            }


class GraphedPlan:
    """``ExecutionPlan.run`` through CUDA graphs (see the module docstring)."""

    def __init__(
        self, plan: ExecutionPlan, *, allow_tf32: bool = False, capture: CaptureFn = cuda_capture
    ) -> None:
        self.plan = plan
        self.allow_tf32 = allow_tf32
        self._capture = capture
        self.device = plan.device
        self._graphs: OrderedDict[ShapeKey, Captured] = OrderedDict()
        self._calls: Counter[ShapeKey] = Counter()
        self.uncaptured: dict[ShapeKey, str] = {}  # shapes whose capture failed, and why
        self._lock = threading.Lock()

    @property
    def shapes(self) -> list[ShapeKey]:
        return list(self._graphs)

    def run(self, inputs: Mapping[str, torch.Tensor], symbols: Mapping[str, int]) -> dict[str, Any]:
        key = shape_key(inputs)
        with self._lock:
            captured = self._graphs.get(key)
            if captured is not None:
                self._graphs.move_to_end(key)
            else:
                self._calls[key] += 1
        if captured is None:
            if self._calls[key] >= CAPTURE_AFTER and key not in self.uncaptured:
                captured = self.try_capture(inputs, symbols)
            if captured is None:
                with gpu_math(self.allow_tf32):
                    return self.plan.run(inputs, symbols)
        return captured.replay(inputs)

    def try_capture(
        self, inputs: Mapping[str, torch.Tensor], symbols: Mapping[str, int]
    ) -> Captured | None:
        """``capture``, or None (the reason kept in ``uncaptured``, and logged once) when the
        plan at this shape cannot be captured, e.g. an ATen op that synchronises with the host:
        the shape then runs the plan directly."""
        try:
            return self.capture(inputs, symbols)
        except RuntimeError as error:
            key = shape_key(inputs)
            self.uncaptured[key] = f"{type(error).__name__}: {error}"[:500]
            log.warning("no CUDA graph at %s, the plan runs op by op: %s", key, error)
            return None

    def capture(self, inputs: Mapping[str, torch.Tensor], symbols: Mapping[str, int]) -> Captured:
        """Capture the plan at these inputs' shapes (on the plan's device), and keep it."""
        key = shape_key(inputs)
        static = {
            name: torch.empty(t.shape, dtype=t.dtype, device=self.device).copy_(t)
            for name, t in inputs.items()
        }
        with gpu_math(self.allow_tf32), torch.inference_mode():
            graph, outputs = self._capture(self.device, lambda: self.plan.run(static, symbols))
        held = self.plan.shape_cache.get(self.plan.shape_cache.key(symbols))
        captured = Captured(graph, static, dict(outputs), held)
        with self._lock:
            self._graphs[key] = captured
            self._calls.pop(key, None)
            while len(self._graphs) > CAPACITY:
                self._graphs.popitem(last=False)
        return captured

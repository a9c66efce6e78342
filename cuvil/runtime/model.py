"""CompiledModel: what ``cuvil.jit`` returns and ``cuvil.load`` brings back.

Holds the planned graph, its weights and signature, and the execution plan built from them.
Every call checks its inputs against the signature first: a dim outside its declared range or a
wrong dtype is refused with an InputError, never answered.

A tiny model's call costs more in this bookkeeping than in its arithmetic, so once inputs of one
dtype, shape and device have been checked and the runner offers a direct call for their shape
(``runner.direct``: the CPU's whole-plan native schedule), later calls with inputs of that
dtype, shape, device and thread count go straight to it (``_DIRECT`` keys per model).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from cuvil.analysis.memory import MemoryPolicy, plan_memory
from cuvil.artifact.files import ArtifactContents, read_artifact, write_artifact
from cuvil.artifact.kernels_layer import unpack_kernels
from cuvil.backends import Backend, backend_for
from cuvil.ir import Graph
from cuvil.runtime.plan import ExecutionPlan
from cuvil.runtime.signature import InputBinder, InputError, Signature

MAX_DIRECT = 32  # input dtype/shape/device/thread-count keys with a direct call kept per model
# a runner's call for one input key, straight to its foreign call; it runs in inference mode
# of its own (native_plan.py's schedules set it in C++), as the checked path does
Direct = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


class CompiledModel:
    def __init__(
        self, contents: ArtifactContents, *, output_spec: pytree.TreeSpec | None = None
    ) -> None:
        self.contents = contents
        self.signature = Signature.of_graph(contents.graph)
        self.backend: Backend = backend_for(str(contents.config.get("target", "cpu")))
        self.device = self.backend.device
        self._binder = InputBinder(self.signature)
        self._input_names = self.signature.input_names
        self._output_names = self.signature.output_names
        factories = {
            **self.backend.kernels,
            **self.backend.load_kernels(unpack_kernels(contents.kernels)),
        }
        self.memory_policy = MemoryPolicy.from_json(contents.config.get("memory_policy"))
        self.plan = ExecutionPlan(
            contents.graph,
            contents.weights,
            self.device,
            factories,
            in_place=self.memory_policy.in_place,
        )
        self._output_spec = output_spec  # the model's own output structure, when known
        self.runner = self.backend.runner(self)
        spec = output_spec
        self._single_output = len(self._output_names) == 1 and (spec is None or spec.is_leaf())
        self._direct: dict[tuple[Any, ...], Direct] = {}  # by positional inputs' key
        self._direct_named: dict[tuple[Any, ...], Direct] = {}  # by named inputs' key

    @property
    def graph(self) -> Graph:
        return self.contents.graph

    @property
    def config(self) -> dict[str, Any]:
        return self.contents.config

    @property
    def report(self) -> dict[str, Any]:
        return dict(self.contents.config.get("report", {}))

    @property
    def name(self) -> str:
        return str(self.contents.config.get("name", self.graph.name))

    def execution(self) -> dict[str, Any]:
        """What runs on this machine, as the backend describes it: for the CPU, the precision
        the GEMMs compute in, the path each kernel with a choice took (``tactics``), which
        oneDNN and which native kernels are offered."""
        return self.backend.describe(self)

    def memory_plan(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The arena plan for the intermediates at these inputs' shapes (bytes, vs the naive
        sum of every intermediate); the executor frees each value after its last use."""
        return plan_memory(
            self.graph, self._binder.bind(inputs), planner=self.memory_policy.planner
        ).summary()

    def measure_memory(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """``memory_plan(inputs)`` with the peak activation bytes one call at these inputs
        allocates (allocator events, analysis/memory_report.py), after one unmeasured call."""
        from cuvil.analysis.memory_report import measure_peak_bytes

        self.run(inputs)
        measured = measure_peak_bytes(lambda: self.run(inputs))
        return {**self.memory_plan(inputs), "measured_bytes": measured}

    def prepare(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """Make the model ready to serve inputs of this shape, the backend's way (the CPU runs
        it until every kernel choice the shape meets is made, so later calls at this shape give
        bit-identical results). Returns the runs made."""
        return self.backend.prepare(self, inputs)

    def preset_tactics(self, choices: Mapping[str, Mapping[int, str]]) -> int:
        """Run the kernels chosen before (``execution()["tactics"]``, e.g. from the CPU
        backend's tactics cache) instead of deciding again; returns how many were taken."""
        return self.plan.preset_choices(choices)

    def bind(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, int]:
        """The symbols' values at these inputs, once they are checked against the signature."""
        return dict(self._binder.bind(inputs))

    def run(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run on named inputs; returns outputs by name, on the inputs' device. Tensors on the
        model's device are used in place; others are copied to it, and the outputs back."""
        key = _named_key(inputs)
        direct = self._direct_named.get(key) if key is not None else None
        if direct is not None:
            values = direct(list(inputs.values()))
            return dict(zip(self._output_names, values, strict=True))
        outputs = self._run_checked(inputs)
        if key is not None:
            self._remember(self._direct_named, key, tuple(inputs), inputs)
        return outputs

    def _run_checked(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        symbols = self._binder.bind(inputs)
        caller = next((t.device for t in inputs.values() if isinstance(t, torch.Tensor)), None)
        moved = caller is not None and caller != self.device
        if moved:
            inputs = {name: tensor.to(self.device) for name, tensor in inputs.items()}
        if torch.is_inference_mode_enabled():  # the caller's own block: no second one
            outputs = self.runner.run(inputs, symbols)
        else:
            with torch.inference_mode():
                outputs = self.runner.run(inputs, symbols)
        if moved:
            outputs = {
                name: value.to(caller) if isinstance(value, torch.Tensor) else value
                for name, value in outputs.items()
            }
        return outputs

    def _remember(
        self,
        table: dict[tuple[Any, ...], Direct],
        key: tuple[Any, ...],
        order: Sequence[str],
        inputs: Mapping[str, torch.Tensor],
    ) -> None:
        """After a checked call: keep the runner's direct call for this key, if it has one."""
        offer = getattr(self.runner, "direct", None)
        if offer is None or len(table) >= MAX_DIRECT or key in table:
            return
        if any(t.device != self.device for t in inputs.values()):
            return
        direct = offer(self._binder.bind(inputs), tuple(order), self._output_names)
        if direct is not None:
            table[key] = direct

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        names = self._input_names
        key = _positional_key(args) if not kwargs and len(args) == len(names) else None
        direct = self._direct.get(key) if key is not None else None
        if direct is not None:
            values = direct(args)
            return values[0] if self._single_output else self._shaped(values)
        if len(args) > len(names):
            raise InputError(f"{len(args)} positional inputs given, the model takes {list(names)}")
        inputs = dict(zip(names, args, strict=False))
        for name, value in kwargs.items():
            if name in inputs:
                raise InputError(f"input {name!r} given twice")
            inputs[name] = value
        outputs = self._run_checked(inputs)
        if key is not None:
            self._remember(self._direct, key, names, inputs)
        return self._shaped([outputs[name] for name in self._output_names])

    def _shaped(self, flat: list[Any]) -> Any:
        if self._output_spec is not None:
            return pytree.tree_unflatten(flat, self._output_spec)
        return flat[0] if len(flat) == 1 else tuple(flat)

    def save(self, path: str | Path, *, directory: bool = False) -> Path:
        """Write the artifact: one tar file by default, or a directory of its files."""
        return write_artifact(self.contents, path, directory=directory)

    def __repr__(self) -> str:
        return f"CompiledModel({self.name!r}, target={self.config.get('target')!r})\n" + (
            self.signature.describe()
        )


def load(path: str | Path) -> CompiledModel:
    """Load an artifact (tar file or directory) written by ``CompiledModel.save``; one compiled
    for generation comes back as a ``GenerationModel`` (runtime/generation.py)."""
    return from_contents(read_artifact(path))


def from_contents(contents: ArtifactContents) -> CompiledModel:
    """The model an artifact's contents stand for: a generation model or a plain one."""
    if "generation" in contents.config:
        from cuvil.runtime.generation import GenerationModel

        return GenerationModel(contents)
    return CompiledModel(contents)


def _positional_key(args: Sequence[Any]) -> tuple[Any, ...] | None:
    """What a direct call depends on: each input's dtype, shape and device, the thread count."""
    try:
        if len(args) == 1:
            (only,) = args
            return (only.dtype, only.shape, only.device, torch.get_num_threads())
        return (*((t.dtype, t.shape, t.device) for t in args), torch.get_num_threads())
    except AttributeError:
        return None  # not tensors: the checked path says what is wrong


def _named_key(inputs: Mapping[str, Any]) -> tuple[Any, ...] | None:
    try:
        return (
            *((name, t.dtype, t.shape, t.device) for name, t in inputs.items()),
            torch.get_num_threads(),
        )
    except AttributeError:
        return None

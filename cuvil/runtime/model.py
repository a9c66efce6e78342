"""CompiledModel: what ``cuvil.jit`` returns and ``cuvil.load`` brings back.

Holds the planned graph, its weights and signature, and the execution plan built from them.
Every call checks its inputs against the signature first: a dim outside its declared range or a
wrong dtype is refused with an InputError, never answered.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from cuvil.artifact.files import ArtifactContents, read_artifact, write_artifact
from cuvil.backends.cpu.dnnl import describe as describe_dnnl
from cuvil.backends.cpu.linear_kernels import compute_precision
from cuvil.backends.cpu.native import describe as describe_native
from cuvil.backends.cpu.tactics import trial_length
from cuvil.ir import Graph
from cuvil.runtime.kernels import Kernel
from cuvil.runtime.plan import ExecutionPlan
from cuvil.runtime.signature import InputBinder, InputError, Signature

TARGET_DEVICES = {"cpu": "cpu", "cuda": "cuda"}
SETTLE_RUNS = trial_length(3) + 1  # up to three candidates


def target_device(target: str) -> torch.device:
    """``cpu``, ``cpu-x86_64-amx``, ``cuda-sm_90`` … -> the torch device that runs it."""
    family = target.split("-", 1)[0]
    if family not in TARGET_DEVICES:
        raise ValueError(
            f"unknown target {target!r}; targets start with one of {sorted(TARGET_DEVICES)}"
        )
    return torch.device(TARGET_DEVICES[family])


class CompiledModel:
    def __init__(
        self,
        contents: ArtifactContents,
        *,
        kernels: Mapping[str, Kernel] | None = None,
        output_spec: pytree.TreeSpec | None = None,
    ) -> None:
        self.contents = contents
        self.signature = Signature.of_graph(contents.graph)
        self.device = target_device(str(contents.config.get("target", "cpu")))
        self._binder = InputBinder(self.signature)
        self._plan = ExecutionPlan(contents.graph, contents.weights, self.device, kernels)
        self._output_spec = output_spec  # the model's own output structure, when known

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
        """What runs on this machine: the precision the GEMMs compute in (a bf16 artifact runs
        fp32 GEMMs on a CPU without bf16 instructions), the GEMM path each linear chose, which
        oneDNN the convolutions and linears call, and whether Cuvil's native kernels (Winograd
        transforms; RMSNorm and RoPE) are offered."""
        dtypes = {tensor.dtype for tensor in self.contents.weights.values()}
        has_bf16 = torch.bfloat16 in dtypes
        return {
            "weights": "bf16" if has_bf16 else "fp32",
            "gemm_compute": compute_precision(torch.bfloat16) if has_bf16 else "fp32",
            "tactics": self._plan.tactic_choices(),
            "onednn": describe_dnnl(),
            "winograd": describe_native("winograd"),
            "rowwise": describe_native("rowwise"),
        }

    def memory_plan(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The arena plan for the intermediates at these inputs' shapes (bytes, vs the naive
        sum of every intermediate); the executor frees each value after its last use."""
        from cuvil.analysis.memory import plan_memory

        return plan_memory(self.graph, self._binder.bind(inputs)).summary()

    def settle(self, inputs: Mapping[str, torch.Tensor], max_runs: int = SETTLE_RUNS) -> int:
        """Run these inputs until every kernel choice they meet is made (backends/cpu/tactics.py):
        from then on, calls at this shape give bit-identical results. Returns the runs made."""
        before = self._plan.tactic_trials()
        for runs in range(1, max_runs + 1):
            self.run(inputs)
            after = self._plan.tactic_trials()
            if not any(before.get(key) != calls for key, calls in after.items()):
                return runs  # no choice this shape meets is still open
            before = after
        return max_runs

    def preset_tactics(self, choices: Mapping[str, Mapping[int, str]]) -> int:
        """Run the kernels chosen before (``execution()["tactics"]``, e.g. from the CPU
        backend's tactics cache) instead of timing them; returns how many choices were taken."""
        return self._plan.preset_tactics(choices)

    def run(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run on named inputs; returns outputs by name. Tensors on the model's device are used
        in place."""
        symbols = self._binder.bind(inputs)
        with torch.inference_mode():
            return self._plan.run(inputs, symbols)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        names = self.signature.input_names
        if len(args) > len(names):
            raise InputError(f"{len(args)} positional inputs given, the model takes {list(names)}")
        inputs = dict(zip(names, args, strict=False))
        for key, value in kwargs.items():
            if key in inputs:
                raise InputError(f"input {key!r} given twice")
            inputs[key] = value
        outputs = self.run(inputs)
        flat = [outputs[name] for name in self.signature.output_names]
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


def load(path: str | Path, *, kernels: Mapping[str, Kernel] | None = None) -> CompiledModel:
    """Load an artifact (tar file or directory) written by ``CompiledModel.save``."""
    return CompiledModel(read_artifact(path), kernels=kernels)

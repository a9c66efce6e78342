"""Helpers for the CUDA backend's tests: one fused node as a graph, the manifest the executor
reads for a spec (what codegen writes, less what only a compile knows), and a kernel run.
Triton's interpreter is imported only where a kernel runs by it: the GPU tests import this too,
under the GPU image's Triton."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy
import torch

from cuvil.backends.cuda.backend import FALLBACKS
from cuvil.backends.cuda.codegen import plan_kernels
from cuvil.backends.cuda.launches import LAUNCHES
from cuvil.backends.cuda.layer import GuardedLauncher
from cuvil.backends.cuda.specs import KernelSpec
from cuvil.backends.cuda.templates import template_digest
from cuvil.dtypes import dtype_name
from cuvil.fused_ops import fused_node
from cuvil.ir import Graph, Node, TensorType, Value
from cuvil.runtime.kernels import FusedCall


def _type(shape: tuple[int, ...], dtype: torch.dtype) -> TensorType:
    return TensorType(dtype_name(dtype), tuple(sympy.Integer(size) for size in shape))


def one_node(
    op: str,
    runtime: Mapping[str, torch.Tensor],
    constants: Mapping[str, Any],
    out_shape: tuple[int, ...],
) -> tuple[Graph, dict[str, torch.Tensor], FusedCall]:
    """A graph of one fused node over these inputs and constants, and its plan's FusedCall."""
    nodes: list[Node] = []
    args: dict[str, Any] = {}
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in runtime.items():
        nodes.append(Node(name, "input", (), (_type(tuple(tensor.shape), tensor.dtype),)))
        args[name] = Value(name)
    for name, value in constants.items():
        if isinstance(value, torch.Tensor):
            weights[name] = value
            nodes.append(
                Node(f"c_{name}", "const", (("key", name),), (_type(value.shape, value.dtype),))
            )
            args[name] = Value(f"c_{name}")
        else:
            args[name] = value
    first = next(iter(runtime.values()))
    node = fused_node(op, "fused", args, (_type(out_shape, first.dtype),))
    graph = Graph("one", (*nodes, node), tuple(runtime), (("out", node.value()),))
    call = FusedCall(op, "fused", dict(constants), tuple(runtime))
    return graph, weights, call


def manifest_for(spec: KernelSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "template": spec.template,
        "source_sha256": template_digest(spec.template),
        "constexprs": spec.constexprs,
        "guards": {"div16": list(spec.div16)},
        "params": [{"name": name, "type": kind} for name, kind in spec.runtime_params],
    }


def only_spec(graph: Graph, weights: Mapping[str, torch.Tensor]) -> KernelSpec:
    specs = list(plan_kernels(graph, weights, FALLBACKS).kernels.values())
    assert len(specs) == 1, specs
    return specs[0]


def run_kernel(
    op: str,
    runtime: Mapping[str, torch.Tensor],
    constants: Mapping[str, Any],
    out_shape: tuple[int, ...],
) -> tuple[torch.Tensor, KernelSpec]:
    """The node run as its kernel through the interpreter: (output, the spec it ran)."""
    graph, weights, call = one_node(op, runtime, constants, out_shape)
    spec = only_spec(graph, weights)
    manifest = manifest_for(spec)
    prepared = LAUNCHES[spec.template](call, manifest, guarded_launcher(spec))
    return prepared.run(*runtime.values()), spec


def guarded_launcher(spec: KernelSpec) -> GuardedLauncher:
    """The spec's kernel and its generic variant through the interpreter, as the layer has."""
    from cuvil.backends.cuda.interpreter import Interpreted  # Triton 3.9's; not on GPU images

    generic = Interpreted(manifest_for(spec.generic()))
    return GuardedLauncher(Interpreted(manifest_for(spec)), generic, spec.div16)


def relative_to_scale(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().clamp_min(1e-12)
    return float((actual.float() - expected.float()).abs().max() / scale)

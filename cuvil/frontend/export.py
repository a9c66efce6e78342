"""Frontend stage: a torch model and its example inputs -> torch.export's ATen graph.

Normalises what users pass (a tensor, a tuple of positional inputs, a dict of keyword inputs),
exports in eval mode with the user's ``dynamic_shapes`` untouched, and keeps the op level that
Cuvil's patterns match on (``run_decompositions({})``: linear, layer_norm and
scaled_dot_product_attention stay whole). Graphs of common CNN ops reach that level by local
rewrites instead of the retrace, which takes longer than the export itself (training_ir.py).

One trap is handled here rather than left to the user: torch.export specialises a dynamic dim
whose example size is 1 (the 0/1 specialisation). Such examples are tiled to size 2 for tracing,
so the dim stays symbolic over its whole declared range; the report says so.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from cuvil.frontend.huggingface import traceable_experts
from cuvil.frontend.training_ir import as_inference_ir


class ExportError(ValueError):
    """torch.export could not capture the model; the message carries the exporter's reason."""


@dataclass
class ExportedModel:
    program: torch.export.ExportedProgram
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    dim_names: dict[tuple[str, int], str]
    arg_names: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def normalise_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, list | tuple):
        return tuple(example_inputs), {}
    raise TypeError(
        "example_inputs must be a tensor, a tuple of positional inputs or a dict of keyword "
        f"inputs, not {type(example_inputs).__name__}"
    )


def bound_names(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """Names of the model's parameters that the example inputs fill, in call order."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return [f"input_{i}" for i in range(len(args))] + list(kwargs)
    names: list[str] = []
    for name, value in bound.arguments.items():
        if isinstance(value, tuple) and inspect.signature(model.forward).parameters[name].kind == (
            inspect.Parameter.VAR_POSITIONAL
        ):
            names += [f"{name}_{i}" for i in range(len(value))]
        else:
            names.append(name)
    return names


def dims_by_input(
    model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any
) -> dict[str, dict[int, Any]]:
    """The user's ``dynamic_shapes`` as {input name: {dim index: Dim}} (tensor inputs only)."""
    if dynamic_shapes is None:
        return {}
    names = bound_names(model, args, kwargs)
    if isinstance(dynamic_shapes, Mapping):
        specs = dict(dynamic_shapes)
    else:
        specs = dict(zip(names, dynamic_shapes, strict=False))
    out: dict[str, dict[int, Any]] = {}
    for name, spec in specs.items():
        if isinstance(spec, Mapping):
            out[name] = {int(k): v for k, v in spec.items() if v is not None}
        elif isinstance(spec, list | tuple):
            out[name] = {i: v for i, v in enumerate(spec) if v is not None}
    return out


def _dim_bounds(dim: Any) -> tuple[int, int]:
    lower = getattr(dim, "min", None)
    upper = getattr(dim, "max", None)
    return (int(lower) if lower is not None else 0, int(upper) if upper is not None else 2**31)


def widen_unit_examples(
    model: torch.nn.Module, args: tuple, kwargs: dict, dims: dict[str, dict[int, Any]]
) -> tuple[tuple, dict, list[str]]:
    """Tile examples whose dynamic dims have size < 2, so export keeps those dims symbolic."""
    names = bound_names(model, args, kwargs)
    values: dict[str, Any] = dict(zip(names, args, strict=False)) | dict(kwargs)
    notes: list[str] = []
    widen: set[int] = set()  # ids of Dim objects to widen
    for name, by_index in dims.items():
        tensor = values.get(name)
        for index, dim in by_index.items():
            if isinstance(tensor, torch.Tensor) and tensor.shape[index] < 2 <= _dim_bounds(dim)[1]:
                widen.add(id(dim))
    if not widen:
        return args, kwargs, notes
    for name, by_index in dims.items():
        tensor = values.get(name)
        for index, dim in by_index.items():
            if id(dim) in widen and isinstance(tensor, torch.Tensor) and tensor.shape[index] == 1:
                repeats = [1] * tensor.dim()
                repeats[index] = 2
                tensor = tensor.repeat(*repeats)
                notes.append(
                    f"example {name} dim {index} ({getattr(dim, '__name__', dim)}) has size 1: "
                    "tiled to 2 for tracing so that it stays dynamic"
                )
        values[name] = tensor
    new_args = tuple(values[name] for name in names[: len(args)])
    new_kwargs = {name: values[name] for name in kwargs}
    return new_args, new_kwargs, notes


def export_model(model: torch.nn.Module, example_inputs: Any, dynamic_shapes: Any) -> ExportedModel:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"cuvil compiles torch.nn.Module instances, not {type(model).__name__}")
    model = model.eval()
    args, kwargs = normalise_inputs(example_inputs)
    dims = dims_by_input(model, args, kwargs, dynamic_shapes)
    args, kwargs, notes = widen_unit_examples(model, args, kwargs, dims)
    try:
        with torch.no_grad(), traceable_experts(model):
            program = torch.export.export(
                model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False
            )
            if as_inference_ir(program):
                notes.append("training IR converted directly (no run_decompositions retrace)")
            else:
                program = program.run_decompositions({})
    except Exception as error:  # the exporter raises many types; all mean "cannot capture"
        reason = str(error).strip().split("\n\n")[0][:2000]
        raise ExportError(f"torch.export failed: {type(error).__name__}: {reason}") from error
    dim_names = {  # a derived dim (4 * d) is named after its root (d): the symbol to bind
        (name, index): str(getattr(getattr(dim, "root", dim), "__name__", f"{name}_{index}"))
        for name, by_index in dims.items()
        for index, dim in by_index.items()
    }
    arg_names = bound_names(model, args, kwargs)[: len(args)]
    return ExportedModel(program, args, kwargs, dim_names, arg_names, notes)

"""Resolving a compile SPEC: a ModelCompilation YAML file, or a Python ``module:factory``.

The YAML is the same file ``kubectl apply`` takes; its ``spec.source``/``inputs``/``dynamicDims``
go through ``cuvil.frontend.sources`` (``targets``/``precision`` land in the ModelSpec's metadata).
The factory may return a ModelSpec, a ``(model, example_inputs[, dynamic_shapes])`` tuple, or a
dict with those keys.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cuvil.models.catalog import ModelSpec
from cuvil_cli.compilation import CompilationSpecError, read_compilation


class SpecError(ValueError):
    pass


def load_factory_spec(spec: str) -> ModelSpec:
    """A ModelCompilation YAML path or a ``module:factory`` -> ModelSpec."""
    if spec.endswith((".yaml", ".yml", ".json")) or Path(spec).is_file():
        return load_compilation_spec(spec)
    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name:
        raise SpecError(f"SPEC {spec!r} is not 'module:factory' (e.g. cuvil.models:resnet50)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise SpecError(f"cannot import {module_name!r}: {error}") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise SpecError(f"{module_name!r} has no callable {factory_name!r}")
    return as_model_spec(factory(), default_name=factory_name)


def as_model_spec(result: Any, default_name: str) -> ModelSpec:
    if isinstance(result, ModelSpec):
        return result
    if isinstance(result, Mapping):
        return ModelSpec(
            str(result.get("name", default_name)),
            result["model"],
            result["example_inputs"],
            result.get("dynamic_shapes"),
        )
    if (
        isinstance(result, tuple)
        and len(result) in (2, 3)
        and isinstance(result[0], torch.nn.Module)
    ):
        return ModelSpec(
            default_name, result[0], result[1], result[2] if len(result) == 3 else None
        )
    raise SpecError(
        f"factory returned {type(result).__name__}; expected a ModelSpec, a (model, example_inputs"
        "[, dynamic_shapes]) tuple, or a dict with those keys"
    )


def load_compilation_spec(path: str | Path) -> ModelSpec:
    """The model of a ModelCompilation manifest (the first document of that kind in the file)."""
    from cuvil.frontend.sources import SourceError, load_source

    try:
        compilation = read_compilation(path)
        source = load_source(compilation.spec)
    except (CompilationSpecError, SourceError) as error:
        raise SpecError(str(error)) from None
    body = compilation.spec
    metadata = {"targets": list(body.get("targets") or []), "precision": body.get("precision")}
    return ModelSpec(
        compilation.name, source.model, source.example_inputs, source.dynamic_shapes, metadata
    )

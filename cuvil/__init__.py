"""Cuvil: compile PyTorch models into verified, target-specific inference artifacts.

compiled = cuvil.jit(model, example_inputs, target="cpu", precision="fp32",
                     dynamic_shapes={"x": {0: cuvil.Dim("batch", min=1, max=64)}})
y = compiled(x)
compiled.save("model.cuvil")
same = cuvil.load("model.cuvil")
"""

from __future__ import annotations

from torch.export import Dim

__version__ = "0.1.0"

from cuvil.api import jit, load

__all__ = ["Dim", "__version__", "jit", "load"]

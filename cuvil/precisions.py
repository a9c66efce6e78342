"""Precisions, in one place: what each compiles to and how far its outputs may drift from eager.

``budget`` is the compiler's own check (max error relative to the output's scale on the example
inputs; above it the passes are bisected). ``rtol``/``atol`` are the validation defaults a
ModelCompilation's ``spec.validation`` overrides (elementwise, on every golden sample).
bf16 keeps 8 mantissa bits, so its outputs drift by a few 1e-3 per op and its bounds are wider;
fp16 keeps 11 (and the CUDA backend alone compiles it), so its bounds lie between the two.
int8 (CPU only) is bf16 with the linears' weights rounded to int8 per output row (one scale
each: about 4x bf16's weight rounding), so its bounds are about twice bf16's.
tf32 (CUDA only) keeps fp32 weights and values and lets cuBLAS/cuDNN multiply in TensorFloat-32
(11 bits); without it a CUDA plan computes in fp32 throughout.
This module imports nothing heavy (the operator reads it without torch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    name: str
    budget: float
    rtol: float
    atol: float


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", budget=1e-4, rtol=1e-3, atol=1e-4),
        Precision("bf16", budget=3e-2, rtol=5e-2, atol=5e-2),
        Precision("fp16", budget=1e-2, rtol=2e-2, atol=2e-2),
        Precision("tf32", budget=5e-3, rtol=1e-2, atol=1e-2),
        Precision("int8", budget=6e-2, rtol=1e-1, atol=1e-1),
    )
}


def precision(name: str) -> Precision:
    """The named precision; a ValueError listing the supported ones otherwise."""
    found = PRECISIONS.get(name)
    if found is None:
        raise ValueError(f"precision {name!r} is not supported; choose from {list(PRECISIONS)}")
    return found

"""A third GEMM path for linears called with a few rows: the weight split across threads.

At one row a linear is a matrix-vector product, and MKL runs it on one thread however many
there are, so its time does not fall with more threads. Splitting the output features into one
part per thread and running the parts as a batched GEMM (``baddbmm``, batch = parts) puts every
thread to work, each on the same slice of the weight every call, so on a CPU with per-core L2
each part can stay in its core's cache between calls. Whether that wins for a given shape and
host is for ``Tactics`` to time; the figures are in benchmarks/README.md.

The parts are views of the weight when the feature count divides evenly, else of a copy padded
with zero rows (the padding is sliced off the result). The path joins the others under
``Tactics`` only for row buckets up to ``SPLIT_MAX_ROWS``: beyond that MKL threads the GEMM well
and the split's transposing copy of the result only costs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cuvil.backends.cpu.activations import INPLACE_ACTIVATIONS

SPLIT_MAX_ROWS = 4


def split_parts() -> int:
    """One part per intra-op thread; 1 (no split path) on a single thread."""
    return max(1, torch.get_num_threads())


def split_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, activation: str, residual: bool, parts: int
) -> Callable[..., torch.Tensor]:
    """``(x)`` or ``(x, residual)`` -> activation(x W^T + b) [+ residual], x of shape [rows, K]."""
    features, width = int(weight.shape[0]), int(weight.shape[1])
    per_part = -(-features // parts)
    padded = per_part * parts
    if padded != features:
        weight = torch.cat((weight, weight.new_zeros(padded - features, width)))
    blocks = weight.reshape(parts, per_part, width).transpose(1, 2)  # [parts, K, per_part], a view
    offsets = None
    if bias is not None:
        full = torch.cat((bias, bias.new_zeros(padded - features))) if padded != features else bias
        offsets = full.reshape(parts, 1, per_part)
    activate = INPLACE_ACTIVATIONS[activation]

    def gemm(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        spread = x.unsqueeze(0).expand(parts, rows, width)
        y = torch.baddbmm(offsets, spread, blocks) if offsets is not None else spread.bmm(blocks)
        y = y.view(1, padded) if rows == 1 else y.transpose(0, 1).reshape(rows, padded)
        return y if padded == features else y[:, :features]

    if residual:

        def gemm_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            return gemm(x).add_(residual)

        return gemm_add

    def gemm_activate(x: torch.Tensor) -> torch.Tensor:
        return activate(gemm(x))

    return gemm_activate

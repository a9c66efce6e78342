"""``cuvil.linear`` on oneDNN inner-product primitives kept across calls: the "onednn" path of
runtime/linear_kernels.py where libdnnl is loaded (backends/cpu/dnnl.py).

How the primitives are kept: backends/cpu/kept_primitives.py. The inner product applies the
bias, the activation and the residual add as post-ops while each output block is still in
cache, where MKL's ``addmm`` plus an in-place activation makes a second pass over the output.
Which is faster depends on the CPU's ISA (oneDNN picks its kernel for it, ``brgemm`` on AVX2 and
up) and on the shape, so the tactics time both in place rather than assume either.
"""

from __future__ import annotations

import torch

from cuvil.backends.cpu.dnnl import Dnnl, Handle
from cuvil.backends.cpu.kept_primitives import KeptPrimitives, Layouts


class DirectLinear(KeptPrimitives):
    """activation(rows @ weight^T + bias [+ residual]) for a constant ``[out, in]`` weight;
    rows are ``[M, in]``, one primitive per M. fp32 throughout, or bf16 rows and weight with a
    bf16 or fp32 output (``dtypes``)."""

    def __init__(
        self,
        dnnl: Dnnl,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        activation: str,
        residual: bool,
        dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
    ) -> None:
        self.out_features, self.in_features = (int(size) for size in weight.shape)
        dims = [self.out_features, self.in_features]
        super().__init__(dnnl, weight, dims, bias, activation, residual, False, dtypes)

    def layouts(self, dims: tuple[int, ...]) -> Layouts:
        dnnl, own = self.dnnl, self.own
        rows, columns = dims[0], self.out_features
        bias = None
        if self.bias is not None:
            bias = own("memory_desc", dnnl.strided_desc([columns], [1]))
        return Layouts(
            src=own("memory_desc", dnnl.strided_desc(dims, [self.in_features, 1], self.dtype)),
            dst=own(
                "memory_desc", dnnl.strided_desc([rows, columns], [columns, 1], self.out_dtype)
            ),
            weights=own("memory_desc", dnnl.any_desc([columns, self.in_features], self.dtype)),
            bias=bias,
            output_shape=(rows, columns),
        )

    def describe(self, layouts: Layouts, attr: Handle) -> Handle:
        return self.dnnl.inner_product(
            layouts.src, layouts.weights, layouts.bias, layouts.dst, attr
        )

    def __call__(self, rows: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = rows.contiguous()
        primitive = self.prepare(rows.shape)
        if residual is not None:
            residual = residual.contiguous()
        out = torch.empty(primitive.output_shape, dtype=self.out_dtype)
        self.execute(primitive, rows, out, residual)
        return out

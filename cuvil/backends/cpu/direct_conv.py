"""``cuvil.conv2d`` on oneDNN convolution primitives kept across calls, channels-last in and out.

How the primitives are kept: backends/cpu/kept_primitives.py. Against ATen's
``mkldnn._convolution_pointwise`` on the same weights, a kept primitive saves the descriptor
ATen rebuilds on every call: a large share of a small convolution's time, where that set-up
outweighs the arithmetic, and a smaller one on large layers. The figures for whole models are
in benchmarks/README.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cuvil.backends.cpu.dnnl import Dnnl, Handle
from cuvil.backends.cpu.kept_primitives import KeptPrimitives, Layouts


def channels_last_strides(shape: Sequence[int]) -> list[int]:
    _, channels, height, width = shape
    return [channels * height * width, 1, width * channels, channels]


class DirectConv(KeptPrimitives):
    """activation(conv(x) [+ residual]) for a constant weight and fp32 bias: fp32 throughout,
    or bf16 input and weight with a bf16 or fp32 output (``dtypes``)."""

    def __init__(
        self,
        dnnl: Dnnl,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        geometry: tuple[list[int], list[int], list[int], int],
        activation: str,
        residual: bool,
        donated: bool = False,
        dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
    ) -> None:
        self.stride, self.padding, self.dilation, self.groups = geometry
        self.weight_shape = tuple(int(size) for size in weight.shape)
        out_channels, in_per_group, *kernel = self.weight_shape
        dims = [out_channels, in_per_group, *kernel]
        if self.groups > 1:
            dims = [self.groups, out_channels // self.groups, in_per_group, *kernel]
        super().__init__(dnnl, weight, dims, bias, activation, residual, donated, dtypes)
        self.weight_dims = dims

    def output_shape(self, x_shape: Sequence[int]) -> tuple[int, int, int, int]:
        spatial = [
            (size + 2 * pad - dil * (kernel - 1) - 1) // step + 1
            for size, kernel, step, pad, dil in zip(
                x_shape[2:],
                self.weight_shape[2:],
                self.stride,
                self.padding,
                self.dilation,
                strict=True,
            )
        ]
        return int(x_shape[0]), self.weight_shape[0], spatial[0], spatial[1]

    def layouts(self, dims: tuple[int, ...]) -> Layouts:
        dnnl, own = self.dnnl, self.own
        output_shape = self.output_shape(dims)
        out_strides = channels_last_strides(output_shape)
        bias = None
        if self.bias is not None:
            bias = own("memory_desc", dnnl.strided_desc([self.weight_shape[0]], [1]))
        return Layouts(
            src=own(
                "memory_desc", dnnl.strided_desc(dims, channels_last_strides(dims), self.dtype)
            ),
            dst=own(
                "memory_desc",
                dnnl.strided_desc(output_shape, out_strides, self.out_dtype),
            ),
            weights=own("memory_desc", dnnl.any_desc(self.weight_dims, self.dtype)),
            bias=bias,
            output_shape=output_shape,
        )

    def describe(self, layouts: Layouts, attr: Handle) -> Handle:
        return self.dnnl.convolution(
            layouts.src,
            layouts.weights,
            layouts.bias,
            layouts.dst,
            self.stride,
            self.dilation,
            self.padding,
            attr,
        )

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The result, or None for a residual of another shape (a broadcast add)."""
        x = x.contiguous(memory_format=torch.channels_last)
        primitive = self.prepare(x.shape)
        if residual is not None:
            if residual.shape != primitive.output_shape:
                return None
            residual = residual.contiguous(memory_format=torch.channels_last)
        if self.donated and residual is not None:
            out = residual  # the sum post-op adds to what is there
        else:
            out = torch.empty(
                primitive.output_shape, dtype=self.out_dtype, memory_format=torch.channels_last
            )
        self.execute(primitive, x, out, residual)
        return out

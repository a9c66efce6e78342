"""Convolution weights in oneDNN's blocked layout, packed per batch class.

The blocked layout oneDNN wants depends on the input geometry, batch included: on AVX2, for
example, a 1x1 convolution's weight blocks differ between batch 1 and larger batches. A weight
packed for the wrong one is reordered on every call, through oneDNN's generic reorder, which for
a large weight costs many times the convolution itself. So weights are packed per batch class:
batch 1, and batch >= 2 (above one, oneDNN's choice rarely varies with the batch, and where it
does the cost is a reorder, not a wrong answer). The class a model is compiled for is packed at
load; the other only when a call first needs it, from the packed one (no second plain copy is
kept). Without static channels and spatial sizes the weight stays plain channels-last.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

mkldnn = torch.ops.mkldnn


def batch_class(batch: int) -> int:
    return 1 if batch == 1 else 2


class ConvWeight:
    def __init__(
        self,
        weight: torch.Tensor,
        padding: list[int],
        stride: list[int],
        dilation: list[int],
        groups: int,
        input_sizes: Sequence[int | None] | None,
    ) -> None:
        sizes = list(input_sizes or [])
        self.geometry = padding, stride, dilation, groups
        self.packs: dict[int, torch.Tensor] = {}
        if len(sizes) != 4 or any(size is None for size in sizes[1:]):
            self.plain: torch.Tensor | None = weight.contiguous(memory_format=torch.channels_last)
            self.channels_and_space: list[int] = []
            return
        self.plain = None
        self.channels_and_space = [int(size) for size in sizes[1:]]  # type: ignore[arg-type]
        self._pack(batch_class(int(sizes[0] or 1)), weight)

    def for_batch(self, batch: int) -> torch.Tensor:
        """The weight to pass for an input of this batch size."""
        if self.plain is not None:
            return self.plain
        key = batch_class(batch)
        packed = self.packs.get(key)
        if packed is None:
            packed = self._pack(key, next(iter(self.packs.values())).to_dense())
        return packed

    def _pack(self, key: int, source: torch.Tensor) -> torch.Tensor:
        padding, stride, dilation, groups = self.geometry
        hint = [key, *self.channels_and_space]
        packed = mkldnn._reorder_convolution_weight(source, padding, stride, dilation, groups, hint)
        self.packs[key] = packed
        return packed

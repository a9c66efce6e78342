"""Convolution weights in oneDNN's blocked layout, packed per batch class.

The blocked layout oneDNN wants depends on the input geometry, batch included: on this AVX2
EPYC a 1x1 convolution uses ``Acdb32a`` at batch 1 and ``Acdb24a`` at batch 2 and above. A
weight packed for the wrong one is reordered on every call — through oneDNN's generic reorder,
44 ms for ResNet-50's 2048->512 weight, which made a batch-2 ResNet-50 4.5x slower than at
batch 1 per image. So weights are packed per batch class: batch 1, and batch >= 2 (checked on
every ResNet-50 convolution at batches 2, 3, 4, 8, 16, 32: one layout, but for a 3x3 128-channel
convolution at batch 3). The class a model is compiled for is packed at load; the other only
when a call first needs it, from the packed one (no second plain copy is kept). Without static
channels and spatial sizes the weight stays plain channels-last.
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

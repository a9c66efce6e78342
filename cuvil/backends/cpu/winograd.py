"""``cuvil.conv2d`` by Winograd's F(4x4, 3x3) for stride-1, undilated, ungrouped 3x3 convolutions.

A 3x3 convolution does 144 multiplies per 4x4 output tile per channel pair; Winograd does 36,
as 36 GEMMs over the tiles (torch.bmm, MKL) between an input and an output transform
(native/winograd.c: one pass over memory each, bias, residual and ReLU/ReLU6 folded into
the output one). With a quarter of the multiplies, the GEMMs take a fraction of the direct
convolution's time, which leaves room for the two transforms on large feature maps. Neither ONNX
Runtime's MLAS nor oneDNN (Winograd only with AVX-512) offers this on an AVX2-only CPU.

It is offered as a tactic beside the direct convolution (backends/cpu/tactics.py), which times both
in the running model and keeps the faster per batch bucket: with few tiles (7x7 feature maps) the
GEMMs are too thin to win. Rounding differs from the direct path by a few 1e-6 of the output's
scale (the transforms scale values by up to 8x and back). The transformed weight, 36/9 = 4x the
weight, is built on the first call and dropped again when the tactic picks the other path.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cuvil.backends.cpu.activations import INPLACE_ACTIVATIONS
from cuvil.backends.cpu.native import load as load_native
from cuvil.backends.cpu.native_calls import INPLACE_OPS, Result, op
from cuvil.backends.cpu.tactics import batch_tactics
from cuvil.runtime.kernels import PreparedKernel

TILE = 4  # output pixels per tile side; input tiles are TILE + 2 wide
# Tiles go through in chunks of at most 256 (transform, GEMMs, transform back, chunk by chunk):
# a chunk's transformed tiles then stay in cache between the three steps, where a whole batch at
# once spills them to memory; much smaller chunks make the GEMMs too thin. A 56x56 image (196
# tiles) is one chunk. CHUNK_FLOATS bounds the per-thread workspaces (16 MiB) where channels are
# many.
TILES_PER_CHUNK = 256
CHUNK_FLOATS = 4 << 20
FUSED_ACTIVATIONS = {"none": 0, "relu": 1, "relu6": 2}  # done in the output transform

# G of F(4, 3): the weight transform, U = G g G^T (exact in float64, rounded once to fp32)
WEIGHT_TRANSFORM = torch.tensor(
    [
        [1 / 4, 0, 0],
        [-1 / 6, -1 / 6, -1 / 6],
        [-1 / 6, 1 / 6, -1 / 6],
        [1 / 24, 1 / 12, 1 / 6],
        [1 / 24, -1 / 12, 1 / 6],
        [0, 0, 1],
    ],
    dtype=torch.float64,
)

_Int = ctypes.c_int64
_Ptr = ctypes.c_void_p
_workspaces = threading.local()


def workspace(kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """This thread's buffer ``kind`` viewed as ``shape``, grown as needed and never shrunk.

    Every Winograd layer on a thread shares it: allocating the transformed tiles afresh (buffers
    of megabytes) would let glibc hand the pages back to the system and fault them in again on
    every call, a cost of the order of the layer's own arithmetic."""
    size = 1
    for dim in shape:
        size *= dim
    buffer = getattr(_workspaces, kind, None)
    if buffer is None or buffer.numel() < size:
        # a normal tensor, even when made under inference mode: bmm writes into it in place,
        # which torch refuses for an inference tensor once a later call runs outside that mode
        with torch.inference_mode(False):
            buffer = torch.empty(size)
        setattr(_workspaces, kind, buffer)
    return buffer[:size].view(shape)


def is_winograd_shape(
    weight: torch.Tensor, stride: Sequence[int], dilation: Sequence[int], groups: int
) -> bool:
    return (
        weight.dim() == 4
        and tuple(weight.shape[2:]) == (3, 3)
        and list(stride) == [1, 1]
        and list(dilation) == [1, 1]
        and groups == 1
        and weight.dtype == torch.float32
    )


MIN_TILES = 16  # per image: below this the GEMMs are too thin to win (ResNet's 7x7 maps: 4)


def output_tiles(height: int, width: int, padding: Sequence[int]) -> tuple[int, int]:
    """Tiles down and across the output of a padded 3x3, stride-1 convolution."""
    out_h, out_w = height + 2 * int(padding[0]) - 2, width + 2 * int(padding[1]) - 2
    return -(-out_h // TILE), -(-out_w // TILE)


def has_enough_tiles(sizes: Sequence[int | None], padding: Sequence[int]) -> bool:
    """Whether Winograd is worth timing for inputs of these static sizes: 16 or more output
    tiles per image (ResNet's 14x14 maps and up). On 7x7 maps its GEMMs are four rows thin, too
    thin to beat oneDNN, and its transformed weight would be the largest resident copy (4x the
    weight). Dynamic spatial sizes (None) leave it to the timing."""
    if len(sizes) != 4 or sizes[2] is None or sizes[3] is None:
        return True
    tiles_h, tiles_w = output_tiles(int(sizes[2]), int(sizes[3]), padding)
    return tiles_h * tiles_w >= MIN_TILES


def _library() -> ctypes.CDLL | None:
    library = load_native("winograd")
    if library is not None:  # once per kernel built: cheap, and no state to keep in step
        library.cuvil_winograd_input.argtypes = [_Ptr, *[_Int] * 9, _Ptr, ctypes.c_int]
        library.cuvil_winograd_output.argtypes = [
            *[_Ptr] * 4,
            *[_Int] * 7,
            ctypes.c_int,
            ctypes.c_int,
        ]
    return library


def transformed_weight(weight: torch.Tensor) -> torch.Tensor:
    """[36, C_in, C_out]: G g G^T for every channel pair, tile position major."""
    grid = torch.einsum("ai,ocij,bj->abco", WEIGHT_TRANSFORM, weight.double(), WEIGHT_TRANSFORM)
    out_channels, in_channels = weight.shape[:2]
    return grid.reshape(36, in_channels, out_channels).float().contiguous()


class WinogradConv:
    """activation(conv3x3(x) + bias [+ residual]) for channels-last fp32 tensors."""

    def __init__(
        self,
        library: ctypes.CDLL,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        padding: Sequence[int],
        activation: str,
        donated: bool = False,
    ) -> None:
        self.library = library
        self.weight = weight.float().contiguous()
        self.bias = bias.float().contiguous() if bias is not None else None
        self.padding = (int(padding[0]), int(padding[1]))
        self.activation = activation
        self.donated = donated
        self.fused = FUSED_ACTIVATIONS.get(activation)
        self._transformed: torch.Tensor | None = None

    def release(self) -> None:
        """Drops the transformed weight (rebuilt on a later call)."""
        self._transformed = None

    def native_calls(self, args: tuple[Any, ...]) -> list[Any] | None:
        """The native plan loop's calls for one call's ``(x[, residual])``: the same chunks in
        native/kernel_ops.cc, the activation the output transform does not fuse after."""
        if self._transformed is None:
            return None
        x, residual = args[0], (args[1] if len(args) > 1 else None)
        _, _, height, width = x.shape
        shape = (x.shape[0], self.weight.shape[0], height + 2 * self.padding[0] - 2,
                 width + 2 * self.padding[1] - 2)  # fmt: skip
        broadcast = residual is not None and tuple(residual.shape) != shape
        fused = self.fused if self.fused is not None and not broadcast else 0
        geometry = [*self.padding, fused, TILES_PER_CHUNK, CHUNK_FLOATS]
        kernels = [_address(self.library, name) for name in ("input", "output")]
        winograd = torch.ops.cuvil_native.winograd.default
        inputs = (x, self._transformed, self.bias, residual)
        calls: list[Any] = [op(winograd, *kernels, *inputs, geometry, self.donated)]
        if fused == 0 and self.activation != "none":
            calls.append(INPLACE_OPS[self.activation](Result(0)))
        return calls

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self._transformed is None:
            self._transformed = transformed_weight(self.weight)
        x = x.contiguous(memory_format=torch.channels_last)
        batch, channels, height, width = x.shape
        out_channels = self.weight.shape[0]
        out_h = height + 2 * self.padding[0] - 2
        out_w = width + 2 * self.padding[1] - 2
        tiles_h, tiles_w = output_tiles(height, width, self.padding)
        tiles = batch * tiles_h * tiles_w
        shape = (batch, out_channels, out_h, out_w)
        broadcast = residual is not None and tuple(residual.shape) != shape
        fused = self.fused if self.fused is not None and not broadcast else 0
        if residual is not None and not broadcast:
            residual = residual.contiguous(memory_format=torch.channels_last)
        if self.donated and residual is not None and not broadcast:
            out = residual  # each element is read, then written, by the same thread
        else:
            out = torch.empty(shape, memory_format=torch.channels_last)
        added = residual.data_ptr() if residual is not None and not broadcast else None
        bias = self.bias.data_ptr() if self.bias is not None else None
        threads = torch.get_num_threads()
        chunk = max(1, min(TILES_PER_CHUNK, CHUNK_FLOATS // (36 * max(channels, out_channels))))
        for first in range(0, tiles, chunk):
            count = min(chunk, tiles - first)
            transformed = workspace("tiles", (36, count, channels))
            self.library.cuvil_winograd_input(
                x.data_ptr(), height, width, channels, *self.padding, tiles_h, tiles_w,
                first, count, transformed.data_ptr(), threads,
            )  # fmt: skip
            products = workspace("products", (36, count, out_channels))
            torch.bmm(transformed, self._transformed, out=products)
            self.library.cuvil_winograd_output(
                products.data_ptr(), bias, added, out.data_ptr(),
                out_h, out_w, out_channels, tiles_h, tiles_w, first, count, fused, threads,
            )  # fmt: skip
        if broadcast and residual is not None:  # another shape: added unfused, broadcasting
            out.add_(residual)
        if fused == 0 and self.activation != "none":
            INPLACE_ACTIVATIONS[self.activation](out)
        return out


def _address(library: ctypes.CDLL, stage: str) -> int:
    return int(ctypes.cast(getattr(library, f"cuvil_winograd_{stage}"), ctypes.c_void_p).value or 0)


def winograd_conv(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    padding: Sequence[int],
    activation: str,
    donated: bool = False,
) -> WinogradConv | None:
    """The Winograd kernel, or None where no native library could be built."""
    library = _library()
    if library is None:
        return None
    return WinogradConv(library, weight, bias, padding, activation, donated)


def with_winograd_tactic(
    direct: Callable[..., torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    padding: Sequence[int],
    activation: str,
    donated: bool = False,
) -> PreparedKernel:
    """``direct`` and the Winograd path under one tactic choice per batch bucket; ``direct``
    alone where no native library could be built."""
    winograd = winograd_conv(weight, bias, padding, activation, donated)
    if winograd is None:
        return PreparedKernel(direct)

    def release_unless_chosen(choices: dict[int, str]) -> None:
        if "winograd" not in choices.values() and "timing" not in choices.values():
            winograd.release()

    return batch_tactics([("onednn", direct), ("winograd", winograd)], release_unless_chosen)

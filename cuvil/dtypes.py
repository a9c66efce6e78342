"""Names for torch dtypes and enums as they appear in the IR, signatures and artifacts."""

from __future__ import annotations

import torch

TORCH_TO_NAME: dict[torch.dtype, str] = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
}
NAME_TO_TORCH: dict[str, torch.dtype] = {name: dtype for dtype, name in TORCH_TO_NAME.items()}

MEMORY_FORMATS: dict[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
    "channels_last_3d": torch.channels_last_3d,
}
LAYOUTS: dict[str, torch.layout] = {"strided": torch.strided}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_NAME[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported by Cuvil") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return NAME_TO_TORCH[name]
    except KeyError:
        raise TypeError(f"unknown dtype name {name!r}; known: {sorted(NAME_TO_TORCH)}") from None

"""A compiled kernel of the layer as the function the plan calls: the launch arguments of each
template from a fused node's tensors, its grid, and what each pointer's grid reaches.

The arguments follow the kernel's manifest (its parameters, constexprs and guards), so the same
code serves every launcher; today's is the interpreter (interpreter.py), which runs the plan on
the CPU. Inputs the guards do not hold for (a strided view, a misaligned slice) are copied to
fresh contiguous tensors first, as a GPU launch will have to.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from cuvil.runtime.kernels import FusedCall, PreparedKernel

POINTER_DTYPES = {"*fp32": torch.float32, "*bf16": torch.bfloat16, "*fp16": torch.float16}


class Launcher(Protocol):
    def launch(
        self, grid: tuple[int, ...], args: Mapping[str, Any], reach: Mapping[str, int]
    ) -> None: ...


def _dtypes(manifest: Mapping[str, Any]) -> dict[str, torch.dtype]:
    return {
        param["name"]: POINTER_DTYPES[param["type"]]
        for param in manifest["params"]
        if param["type"] in POINTER_DTYPES
    }


def _aligned(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``, contiguous and 16-byte aligned (a copy only where it is not)."""
    tensor = tensor.to(dtype)
    if tensor.is_contiguous() and tensor.data_ptr() % 16 == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _constant(call: FusedCall, key: str, dtype: torch.dtype, width: int) -> torch.Tensor | None:
    tensor = call.arg(key)
    if tensor is None:
        return None
    if tensor.numel() != width:
        raise ValueError(f"{key} has {tensor.numel()} elements, the rows {width}")
    return _aligned(tensor.reshape(width), dtype)


def norm_rows(call: FusedCall, manifest: Mapping[str, Any], launcher: Launcher) -> PreparedKernel:
    """``cuvil.rms_norm`` and ``cuvil.layer_norm``: one program per row of the last dim."""
    call.check_runtime(("input",))
    width = int(manifest["constexprs"]["N"])
    dtypes = _dtypes(manifest)
    eps = float(call.arg("eps"))
    params = {"w_ptr": _constant(call, "weight", dtypes["w_ptr"], width)}
    if "b_ptr" in dtypes:
        params["b_ptr"] = _constant(call, "bias", dtypes["b_ptr"], width)

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != width:
            raise ValueError(f"{manifest['name']}: rows of {x.shape[-1]}, compiled for {width}")
        rows = x.numel() // width
        source = _aligned(x, dtypes["x_ptr"])
        out = torch.empty(x.shape, dtype=dtypes["out_ptr"])
        args: dict[str, Any] = {
            "x_ptr": source,
            "out_ptr": out,
            "stride_x": width,
            "stride_out": width,
            "eps": eps,
        }
        reach = {"x_ptr": rows * width, "out_ptr": rows * width}
        for name, tensor in params.items():
            args[name] = source if tensor is None else tensor  # absent: never read
            if tensor is not None:
                reach[name] = width
        launcher.launch((rows, 1, 1), args, reach)
        return out.to(x.dtype)

    return PreparedKernel(run)


def linear_epilogue(
    call: FusedCall, manifest: Mapping[str, Any], launcher: Launcher
) -> PreparedKernel:
    """``cuvil.linear`` with an activation or residual: ATen's GEMM (``input @ weight.T`` in the
    weight's dtype; cuBLAS on a GPU), then the template's bias/activation/residual pass."""
    call.check_runtime(("input", "residual"))
    weight: torch.Tensor = call.arg("weight")
    constexprs = manifest["constexprs"]
    width, block = int(constexprs["N"]), int(constexprs["BLOCK"])
    dtypes = _dtypes(manifest)
    if weight.shape[0] != width or weight.dtype != dtypes["y_ptr"]:
        raise ValueError(f"{manifest['name']}: compiled for {width} outputs in {dtypes['y_ptr']}")
    transposed = weight.t()
    bias = _constant(call, "bias", dtypes["bias_ptr"], width) if constexprs["HAS_BIAS"] else None

    def run(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = _aligned(torch.matmul(x.to(weight.dtype), transposed), dtypes["y_ptr"])
        out = torch.empty(y.shape, dtype=dtypes["out_ptr"])
        count = out.numel()
        args: dict[str, Any] = {"y_ptr": y, "out_ptr": out, "n_elements": count}
        reach = {"y_ptr": count, "out_ptr": count}
        args["bias_ptr"] = y if bias is None else bias
        if bias is not None:
            reach["bias_ptr"] = width
        if residual is not None:
            args["res_ptr"] = _aligned(residual.expand(out.shape), dtypes["res_ptr"])
            reach["res_ptr"] = count
        else:
            args["res_ptr"] = y  # never read
        launcher.launch((-(-count // block), 1, 1), args, reach)
        return out.to(x.dtype)

    return PreparedKernel(run)


def _reach(tensor: torch.Tensor) -> int:
    """Elements from a view's first to its last one: what indexing it by its strides reaches."""
    return (
        sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
        + 1
    )


def rope(call: FusedCall, manifest: Mapping[str, Any], launcher: Launcher) -> PreparedKernel:
    """``cuvil.rope``: x made contiguous [outer, middle, inner, D]; cos and sin keep their own
    storage and are read through the strides of their broadcast to x (0 where they repeat)."""
    width = int(manifest["constexprs"]["D"])
    dtypes = _dtypes(manifest)

    def broadcast(value: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return value.reshape((1,) * (4 - value.dim()) + tuple(value.shape)).expand(shape)

    def run(x: torch.Tensor, *given: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != width or x.dim() > 4:
            raise ValueError(f"{manifest['name']}: input {tuple(x.shape)}, compiled for D={width}")
        values = iter(given)
        cos = next(values) if call.is_runtime("cos") else call.arg("cos")
        sin = next(values) if call.is_runtime("sin") else call.arg("sin")
        source = _aligned(x, dtypes["x_ptr"])
        shape = torch.Size((1,) * (4 - x.dim()) + tuple(x.shape))
        cos, sin = _aligned(cos, dtypes["cos_ptr"]), _aligned(sin, dtypes["sin_ptr"])
        cos4, sin4 = broadcast(cos, shape), broadcast(sin, shape)
        out = torch.empty(x.shape, dtype=dtypes["out_ptr"])
        rows = x.numel() // width
        args: dict[str, Any] = {
            "x_ptr": source,
            "out_ptr": out,
            "inner": shape[2],
            "middle": shape[1],
        }
        args |= {"cos_ptr": cos, "sin_ptr": sin}
        args |= {f"cos_{dim}": cos4.stride(dim) for dim in range(3)}
        args |= {f"sin_{dim}": sin4.stride(dim) for dim in range(3)}
        reach = {"x_ptr": rows * width, "out_ptr": rows * width}
        reach |= {"cos_ptr": _reach(cos4), "sin_ptr": _reach(sin4)}
        launcher.launch((rows, 1, 1), args, reach)
        return out.to(x.dtype)

    return PreparedKernel(run)


# template -> how its kernel becomes the plan's function
LAUNCHES: dict[str, Callable[[FusedCall, Mapping[str, Any], Launcher], PreparedKernel]] = {
    "rms_norm_rows": norm_rows,
    "layer_norm_rows": norm_rows,
    "bias_act_residual": linear_epilogue,
    "rope_rows": rope,
}

"""A compiled kernel of the layer as the function the plan calls: the launch arguments of each
template from a fused node's tensors, its grid, and what each pointer's grid reaches.

The arguments follow the kernel's manifest (its parameters, constexprs and guards), so the same
code serves every launcher: the GPU's (gpu.py) and the interpreter's on the CPU
(interpreter.py). Outputs are allocated on the input's device. A view whose rows are not
contiguous is copied first; a call that breaks a divisibility guard (an odd offset, a stride
that is not a multiple of 16) runs the kernel's generic variant (layer.py's GuardedLauncher).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from cuvil import fused_ops as fused
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
    """``tensor`` in ``dtype`` and contiguous (a copy only where it is not; an odd offset is
    the generic variant's to take, layer.py)."""
    tensor = tensor.to(dtype)
    if tensor.is_contiguous():
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
    """``cuvil.rms_norm`` and ``cuvil.layer_norm``: ``BLOCK_M`` rows of the last dim per
    program."""
    call.check_runtime(("input",))
    width = int(manifest["constexprs"]["N"])
    per_program = int(manifest["constexprs"]["BLOCK_M"])
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
        out = torch.empty(x.shape, dtype=dtypes["out_ptr"], device=x.device)
        args: dict[str, Any] = {
            "x_ptr": source,
            "out_ptr": out,
            "stride_x": width,
            "stride_out": width,
            "n_rows": rows,
            "eps": eps,
        }
        reach = {"x_ptr": rows * width, "out_ptr": rows * width}
        for name, tensor in params.items():
            args[name] = source if tensor is None else tensor  # absent: never read
            if tensor is not None:
                reach[name] = width
        launcher.launch((-(-rows // per_program), 1, 1), args, reach)
        return out.to(x.dtype)

    return PreparedKernel(run)


def _producer(call: FusedCall, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The op before the epilogue, in the weight's dtype with no bias: a linear's GEMM or a
    convolution (cuBLAS, cuDNN through ATen on a GPU)."""
    if call.op == fused.CONV2D:
        stride, padding, dilation = (
            list(call.arg(key)) for key in ("stride", "padding", "dilation")
        )
        groups = int(call.arg("groups"))
        return lambda x: F.conv2d(x, weight, None, stride, padding, dilation, groups)
    transposed = weight.t()
    return lambda x: torch.matmul(x, transposed)


def epilogue(call: FusedCall, manifest: Mapping[str, Any], launcher: Launcher) -> PreparedKernel:
    """``cuvil.linear`` or ``cuvil.conv2d`` with an activation or residual: ATen's GEMM or
    convolution, then the template's bias/activation/residual pass over its output."""
    call.check_runtime(("input", "residual"))
    weight: torch.Tensor = call.arg("weight")
    constexprs = manifest["constexprs"]
    width, block = int(constexprs["N"]), int(constexprs["BLOCK"])
    dtypes = _dtypes(manifest)
    if weight.shape[0] != width or weight.dtype != dtypes["y_ptr"]:
        raise ValueError(f"{manifest['name']}: compiled for {width} outputs in {dtypes['y_ptr']}")
    produce = _producer(call, weight)
    bias = _constant(call, "bias", dtypes["bias_ptr"], width) if constexprs["HAS_BIAS"] else None

    def run(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = _aligned(produce(x.to(weight.dtype)), dtypes["y_ptr"])
        out = torch.empty(y.shape, dtype=dtypes["out_ptr"], device=y.device)
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


def swiglu(call: FusedCall, manifest: Mapping[str, Any], launcher: Launcher) -> PreparedKernel:
    """``cuvil.swiglu``: ATen's one GEMM over the packed weights (``input @ gate_up.T`` in their
    dtype; cuBLAS on a GPU), then the template's silu(gate) * up."""
    call.check_runtime(("input",))
    weight: torch.Tensor = call.arg("gate_up_weight")
    constexprs, dtypes = manifest["constexprs"], _dtypes(manifest)
    hidden, block = int(constexprs["HIDDEN"]), int(constexprs["BLOCK"])
    if weight.shape[0] != 2 * hidden or weight.dtype != dtypes["y_ptr"]:
        raise ValueError(f"{manifest['name']}: compiled for 2 x {hidden} rows in {dtypes['y_ptr']}")
    transposed = weight.t()

    def run(x: torch.Tensor) -> torch.Tensor:
        y = _aligned(torch.matmul(x.to(weight.dtype), transposed), dtypes["y_ptr"])
        out = torch.empty((*y.shape[:-1], hidden), dtype=dtypes["out_ptr"], device=y.device)
        count = out.numel()
        args = {"y_ptr": y, "out_ptr": out, "n_elements": count}
        launcher.launch((-(-count // block), 1, 1), args, {"y_ptr": 2 * count, "out_ptr": count})
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
        out = torch.empty(x.shape, dtype=dtypes["out_ptr"], device=x.device)
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


def _rows_contiguous(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A view the kernel may index by its strides: its last dim contiguous (alignment and the
    other strides are the guards' business, layer.py)."""
    tensor = tensor.to(dtype)
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous().clone()


def attention(call: FusedCall, manifest: Mapping[str, Any], launcher: Launcher) -> PreparedKernel:
    """``cuvil.attention``: query, key and value read through their strides ([batch, heads,
    seq, dim] views, as the model's transposes leave them); the mask broadcast to [batch, heads,
    queries, keys] by its strides."""
    constexprs = manifest["constexprs"]
    dtypes = _dtypes(manifest)
    width, block_m = int(constexprs["D"]), int(constexprs["BLOCK_M"])
    scale = call.arg("scale")
    scale = float(scale) if scale is not None else width**-0.5
    runtime_mask = call.is_runtime("mask")
    constant_mask = None if runtime_mask else call.arg("mask")

    def run(*given: torch.Tensor) -> torch.Tensor:
        q, k, v = (
            _rows_contiguous(x, dtypes[f"{key}_ptr"])
            for x, key in zip(given[:3], "qkv", strict=True)
        )
        mask = given[3] if runtime_mask else constant_mask
        batch, heads, seq_q, _ = q.shape
        seq_k = k.shape[2]
        if q.shape[-1] != width or heads % k.shape[1]:
            raise ValueError(f"{manifest['name']}: query {tuple(q.shape)}, key {tuple(k.shape)}")
        out = torch.empty(q.shape, dtype=dtypes["o_ptr"], device=q.device)
        args: dict[str, Any] = {"q_ptr": q, "k_ptr": k, "v_ptr": v, "o_ptr": out, "scale": scale}
        args |= {"seq_q": seq_q, "seq_k": seq_k, "heads": heads, "group": heads // k.shape[1]}
        for key, tensor in (("q", q), ("k", k), ("v", v), ("o", out)):
            third = "m" if key in "qo" else "n"
            args |= dict(
                zip((f"{key}_b", f"{key}_h", f"{key}_{third}"), tensor.stride()[:3], strict=True)
            )
        reach = {name: _reach(args[name]) for name in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
        if mask is None:
            args |= {"mask_ptr": q, "mask_b": 0, "mask_h": 0, "mask_m": 0}  # never read
        else:
            base = _rows_contiguous(mask, dtypes["mask_ptr"])
            full = base.reshape((1,) * (4 - base.dim()) + tuple(base.shape))
            full = full.expand(batch, heads, seq_q, seq_k)
            args |= {"mask_ptr": base, "mask_b": full.stride(0), "mask_h": full.stride(1)}
            args["mask_m"] = full.stride(2)
            reach["mask_ptr"] = _reach(full)
        launcher.launch((-(-seq_q // block_m), batch * heads, 1), args, reach)
        return out.to(given[0].dtype)

    return PreparedKernel(run)


# template -> how its kernel becomes the plan's function
LAUNCHES: dict[str, Callable[[FusedCall, Mapping[str, Any], Launcher], PreparedKernel]] = {
    "rms_norm_rows": norm_rows,
    "layer_norm_rows": norm_rows,
    "bias_act_residual": epilogue,
    "rope_rows": rope,
    "swiglu_rows": swiglu,
    "attention_blocks": attention,
}

"""Which kernel a fused node compiles to: a template, specialised per node, or ATen and why.

A ``KernelSpec`` is what ``triton.compile`` needs besides the template's source: every template
parameter with its Triton type (``*fp32`` pointers, ``i32``, ``fp32``, or ``constexpr``), the
constexpr values, the parameters hinted divisible by 16 (``tt.divisibility``), warps and stages,
and the grid as the launcher computes it. Specialisation is what Triton's JIT would do at the
first call: the row width is a constexpr taken from the node's static last dim, the block a
power of two that covers it, and the 16-divisibility hints go where the row width makes them
hold for contiguous tensors. The hints are guards: a call that breaks one (an odd offset, a row
stride that is not a multiple of 16) runs the kernel's generic variant, compiled without them
(``KernelSpec.generic``); a view whose rows are not contiguous is copied first.

A node the templates do not take (a dynamic last dim, rows wider than one program holds, a
linear without an epilogue, where cuBLAS adds the bias itself) gets a reason instead, and runs
through ATen on the device. Pure data: no torch, no Triton.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from hashlib import sha256

from cuvil import fused_ops as fused
from cuvil.ir import Graph, Node, Value

MAX_ROW = 16384  # widest row one program normalises (registers: BLOCK_N fp32 values per row)
# A row kernel's tile: narrow rows share a program up to this many elements (BLOCK_M rows of
# BLOCK_N), so a LayerNorm over rows of 64 keeps a program's warps busy instead of one warp
# each, and Triton's interpreter runs one program per tile rather than per row.
ROW_TILE = 2048
MAX_ROWS_PER_PROGRAM = 64
EPILOGUE_BLOCK = 1024
# Epilogue activations -> the ACT constexpr of templates.bias_act_residual.
ACTIVATION_CODES = {
    "none": 0,
    "relu": 1,
    "relu6": 2,
    "silu": 3,
    "gelu": 4,
    "gelu_tanh": 5,
    "hardswish": 6,
    "tanh": 7,
    "sigmoid": 8,
}
POINTER_TYPES = {"f32": "*fp32", "bf16": "*bf16", "f16": "*fp16"}


@dataclass(frozen=True)
class KernelSpec:
    name: str
    template: str
    params: tuple[tuple[str, str], ...]  # every template parameter in order: (name, type)
    constexprs: dict[str, int | bool]
    div16: tuple[str, ...]  # parameters hinted divisible by 16: the launch guards
    num_warps: int
    grid: str  # how the launcher computes the grid, in words over the launch's sizes
    num_stages: int = 1

    def generic(self) -> KernelSpec:
        """The same kernel without divisibility hints: what a call that breaks them runs (an
        odd offset, a row stride that is not a multiple of 16), instead of a copy."""
        return replace(self, name=f"{self.name}_generic", div16=())

    @property
    def runtime_params(self) -> tuple[tuple[str, str], ...]:
        """The cubin's parameters: the non-constexpr ones in order, then Triton's two trailing
        scratch pointers (global and profile scratch, 8 bytes each)."""
        values = tuple((name, kind) for name, kind in self.params if kind != "constexpr")
        return (*values, ("global_scratch", "*i8"), ("profile_scratch", "*i8"))

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["params"] = [list(param) for param in self.params]
        data["div16"] = list(self.div16)
        return data

    @classmethod
    def from_json(cls, data: dict[str, object]) -> KernelSpec:
        params = tuple((str(name), str(kind)) for name, kind in data["params"])  # type: ignore[attr-defined]
        return cls(
            name=str(data["name"]),
            template=str(data["template"]),
            params=params,
            constexprs=dict(data["constexprs"]),  # type: ignore[call-overload]
            div16=tuple(data["div16"]),  # type: ignore[arg-type]
            num_warps=int(data["num_warps"]),  # type: ignore[call-overload]
            grid=str(data["grid"]),
            num_stages=int(data["num_stages"]),  # type: ignore[call-overload]
        )


def _named(prefix: str, spec_without_name: dict[str, object]) -> str:
    """A readable, unique kernel name: what it is, plus a digest of its specialisation."""
    digest = sha256(json.dumps(spec_without_name, sort_keys=True).encode()).hexdigest()[:10]
    return f"{prefix}_{digest}"


def _spec(prefix: str, **fields: object) -> KernelSpec:
    draft = KernelSpec(name="", **fields)  # type: ignore[arg-type]
    data = draft.to_json()
    del data["name"]
    return KernelSpec(name=_named(prefix, data), **fields)  # type: ignore[arg-type]


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def _static_width(graph: Graph, value: Value) -> int | None:
    shape = graph.type_of(value).shape
    return int(shape[-1]) if shape and shape[-1].is_Integer else None


def _pointer(graph: Graph, value: Value) -> str | None:
    return POINTER_TYPES.get(graph.type_of(value).dtype)


def _row_problem(width: int | None, pointer: str | None) -> str | None:
    if width is None:
        return "the last dim is dynamic: the row width must be a constexpr"
    if width > MAX_ROW:
        return f"rows of {width} are wider than one program holds ({MAX_ROW})"
    if pointer is None:
        return "the dtype has no kernel variant (fp32, bf16, fp16)"
    return None


def _rows(graph: Graph, node: Node) -> tuple[Value, int, str, int] | str:
    """A row-wise node's input, its static width, pointer type and power-of-two block; or why
    no row kernel takes it."""
    x = node.arg("input")
    assert isinstance(x, Value)
    width, pointer = _static_width(graph, x), _pointer(graph, x)
    problem = _row_problem(width, pointer)
    if problem is not None or width is None or pointer is None:
        return problem or ""
    return x, width, pointer, 1 << (width - 1).bit_length()


ROWS_GRID = "(cdiv(n_rows, BLOCK_M), 1, 1): BLOCK_M rows per program, n_rows = numel(input) / N"


def rows_per_program(block: int) -> int:
    """BLOCK_M of a row kernel whose rows take ``block`` lanes: a power of two, as ``block``."""
    return max(1, min(MAX_ROWS_PER_PROGRAM, ROW_TILE // block))


def _row_hints(width: int) -> tuple[str, ...]:
    """Pointers from torch's allocator are 16-byte aligned; row strides are multiples of 16
    only where the width is."""
    strides = ("stride_x", "stride_out") if width % 16 == 0 else ()
    return ("x_ptr", "out_ptr", *strides)


def rms_norm_spec(graph: Graph, node: Node, weights_dtype: str) -> KernelSpec | str:
    rows = _rows(graph, node)
    if isinstance(rows, str):
        return rows
    x, width, pointer, block = rows
    weight_pointer = POINTER_TYPES.get(weights_dtype, pointer)
    out_pointer = POINTER_TYPES[node.types[0].dtype]
    return _spec(
        f"rms_norm_{graph.type_of(x).dtype}_n{width}",
        template="rms_norm_rows",
        params=(
            ("x_ptr", pointer),
            ("w_ptr", weight_pointer),
            ("out_ptr", out_pointer),
            ("stride_x", "i32"),
            ("stride_out", "i32"),
            ("n_rows", "i32"),
            ("eps", "fp32"),
            ("N", "constexpr"),
            ("BLOCK_N", "constexpr"),
            ("BLOCK_M", "constexpr"),
        ),
        constexprs={"N": width, "BLOCK_N": block, "BLOCK_M": rows_per_program(block)},
        div16=(*_row_hints(width), "w_ptr"),
        num_warps=_warps(block * rows_per_program(block)),
        grid=ROWS_GRID,
    )


def layer_norm_spec(
    graph: Graph, node: Node, weight_dtype: str | None, bias_dtype: str | None
) -> KernelSpec | str:
    rows = _rows(graph, node)
    if isinstance(rows, str):
        return rows
    x, width, pointer, block = rows
    # an absent weight or bias is never read: its pointer is the input's
    w_pointer = POINTER_TYPES.get(weight_dtype or "", pointer)
    b_pointer = POINTER_TYPES.get(bias_dtype or "", pointer)
    hints = _row_hints(width)
    hints += tuple(
        name for name, dtype in (("w_ptr", weight_dtype), ("b_ptr", bias_dtype)) if dtype
    )
    return _spec(
        f"layer_norm_{graph.type_of(x).dtype}_n{width}",
        template="layer_norm_rows",
        params=(
            ("x_ptr", pointer),
            ("w_ptr", w_pointer),
            ("b_ptr", b_pointer),
            ("out_ptr", POINTER_TYPES[node.types[0].dtype]),
            ("stride_x", "i32"),
            ("stride_out", "i32"),
            ("n_rows", "i32"),
            ("eps", "fp32"),
            ("N", "constexpr"),
            ("BLOCK_N", "constexpr"),
            ("BLOCK_M", "constexpr"),
            ("HAS_WEIGHT", "constexpr"),
            ("HAS_BIAS", "constexpr"),
        ),
        constexprs={
            "N": width,
            "BLOCK_N": block,
            "BLOCK_M": rows_per_program(block),
            "HAS_WEIGHT": weight_dtype is not None,
            "HAS_BIAS": bias_dtype is not None,
        },
        div16=hints,
        num_warps=_warps(block * rows_per_program(block)),
        grid=ROWS_GRID,
    )


def epilogue_spec(
    graph: Graph, node: Node, weight_dtype: str, bias_dtype: str | None
) -> KernelSpec | str:
    """The epilogue after ATen's GEMM or convolution (in the weight's dtype): bias, activation
    and residual in one pass over its output. The bias runs along the last dim of a linear's
    output and along the channels of a convolution's NCHW one (``INNER`` = H * W apart)."""
    activation = str(node.arg("activation"))
    residual = node.arg("residual")
    if activation == "none" and residual is None:
        return "no epilogue: cuBLAS or cuDNN adds the bias itself (through ATen)"
    shape = node.types[0].shape
    is_conv = node.op == fused.CONV2D
    dims = shape[1:] if is_conv else shape[-1:]
    if not all(dim.is_Integer for dim in dims):
        return "the output's channels or spatial size are dynamic"
    width, inner = int(dims[0]), int(dims[1] * dims[2]) if is_conv else 1
    out_pointer = POINTER_TYPES.get(node.types[0].dtype)
    y_pointer = POINTER_TYPES.get(weight_dtype)
    if out_pointer is None or y_pointer is None:
        return "the dtype has no kernel variant (fp32, bf16, fp16)"
    res_pointer = _pointer(graph, residual) if isinstance(residual, Value) else out_pointer
    hints = ["y_ptr", "out_ptr"]
    hints += ["bias_ptr"] if bias_dtype else []
    hints += ["res_ptr"] if isinstance(residual, Value) else []
    return _spec(
        f"{'conv' if is_conv else 'linear'}_epilogue_{activation}_n{width}",
        template="bias_act_residual",
        params=(
            ("y_ptr", y_pointer),
            ("bias_ptr", POINTER_TYPES.get(bias_dtype or "", y_pointer)),
            ("res_ptr", res_pointer or out_pointer),
            ("out_ptr", out_pointer),
            ("n_elements", "i32"),
            ("N", "constexpr"),
            ("INNER", "constexpr"),
            ("BLOCK", "constexpr"),
            ("ACT", "constexpr"),
            ("HAS_BIAS", "constexpr"),
            ("HAS_RES", "constexpr"),
            ("ACT_AFTER_RES", "constexpr"),
        ),
        constexprs={
            "N": width,
            "INNER": inner,
            "BLOCK": EPILOGUE_BLOCK,
            "ACT": ACTIVATION_CODES[activation],
            "HAS_BIAS": bias_dtype is not None,
            "HAS_RES": isinstance(residual, Value),
            # the epilogue rules' add_act shape: activation(linear + residual)
            "ACT_AFTER_RES": isinstance(residual, Value) and activation != "none",
        },
        div16=tuple(hints),
        num_warps=4,
        grid="(cdiv(n_elements, BLOCK), 1, 1), n_elements = numel(output)",
    )


def rope_spec(graph: Graph, node: Node) -> KernelSpec | str:
    """RoPE over rows of the head dim: x up to 4-D, the output x's shape, cos and sin any
    shape that broadcasts to it with a full last dim."""
    x, cos, sin = (node.arg(key) for key in ("input", "cos", "sin"))
    assert isinstance(x, Value) and isinstance(cos, Value) and isinstance(sin, Value)
    x_type = graph.type_of(x)
    width, pointer = _static_width(graph, x), _pointer(graph, x)
    if x_type.rank > 4 or node.types[0].shape != x_type.shape:
        return "the rotation broadcasts x, or x has more than 4 dims"
    if width is None or width % 2 or pointer is None:
        return "the head dim is dynamic or odd, or its dtype has no kernel variant"
    angles = [_pointer(graph, value) for value in (cos, sin)]
    if any(_static_width(graph, value) != width for value in (cos, sin)) or None in angles:
        return "cos and sin do not span the head dim"
    half = width // 2
    return _spec(
        f"rope_{x_type.dtype}_d{width}",
        template="rope_rows",
        params=(
            ("x_ptr", pointer),
            ("cos_ptr", str(angles[0])),
            ("sin_ptr", str(angles[1])),
            ("out_ptr", POINTER_TYPES[node.types[0].dtype]),
            *((name, "i32") for name in ("inner", "middle", "cos_0", "cos_1", "cos_2")),
            *((name, "i32") for name in ("sin_0", "sin_1", "sin_2")),
            ("D", "constexpr"),
            ("HALF", "constexpr"),
            ("BLOCK_HALF", "constexpr"),
        ),
        constexprs={"D": width, "HALF": half, "BLOCK_HALF": 1 << (half - 1).bit_length()},
        div16=("x_ptr", "cos_ptr", "sin_ptr", "out_ptr"),
        num_warps=1 if width <= 256 else 4,
        grid="(rows, 1, 1): one program per row of D, rows = numel(input) / D",
    )


MAX_HEAD_DIM = 128  # wider heads need smaller tiles than these to stay in registers


def attention_blocks(width: int) -> tuple[int, int]:
    """Queries and keys per block: fp32 tiles that stay in registers on sm_80 and sm_90 with
    four warps (cuobjdump: no spills up to a head dim of 128)."""
    return (32, 32) if width <= 64 else (32, 16)


def attention_spec(graph: Graph, node: Node) -> KernelSpec | str:
    """Flash attention over [batch, heads, seq, head dim] with an additive float mask or none,
    causal or not, grouped-query or not."""
    q, k, v, mask = (node.arg(key) for key in ("query", "key", "value", "mask"))
    assert isinstance(q, Value) and isinstance(k, Value) and isinstance(v, Value)
    types = [graph.type_of(value) for value in (q, k, v)]
    width = _static_width(graph, q)
    if any(t.rank != 4 for t in types) or node.types[0].shape != types[0].shape:
        return "query, key and value are not [batch, heads, seq, head dim] alike"
    if (
        width is None
        or width > MAX_HEAD_DIM
        or any(_static_width(graph, x) != width for x in (k, v))
    ):
        return f"the head dim is dynamic, differs, or is wider than {MAX_HEAD_DIM}"
    pointers = [_pointer(graph, value) for value in (q, k, v)]
    mask_pointer = _pointer(graph, mask) if isinstance(mask, Value) else pointers[0]
    if None in pointers or mask_pointer is None:
        return "a dtype has no kernel variant (a boolean mask, or not fp32/bf16/fp16)"
    strides = [
        f"{x}_{d}" for x in ("q", "k", "v", "o") for d in ("b", "h", "m" if x in "qo" else "n")
    ]
    block_m, block_n = attention_blocks(width)
    return _spec(
        f"attention_{types[0].dtype}_d{width}",
        template="attention_blocks",
        params=(
            ("q_ptr", str(pointers[0])),
            ("k_ptr", str(pointers[1])),
            ("v_ptr", str(pointers[2])),
            ("mask_ptr", mask_pointer),
            ("o_ptr", POINTER_TYPES[node.types[0].dtype]),
            *((name, "i32") for name in ("seq_q", "seq_k", "heads", "group")),
            *((name, "i32") for name in strides),
            *((name, "i32") for name in ("mask_b", "mask_h", "mask_m")),
            ("scale", "fp32"),
            *((name, "constexpr") for name in ("D", "BLOCK_D", "BLOCK_M", "BLOCK_N")),
            ("HAS_MASK", "constexpr"),
            ("IS_CAUSAL", "constexpr"),
        ),
        constexprs={
            "D": width,
            "BLOCK_D": max(16, 1 << (width - 1).bit_length()),
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "HAS_MASK": isinstance(mask, Value),
            "IS_CAUSAL": bool(node.arg("causal")),
        },
        # strides of [batch, heads, seq, dim] views are multiples of the head dim
        div16=("q_ptr", "k_ptr", "v_ptr", "o_ptr", *(strides if width % 16 == 0 else ())),
        num_warps=4,
        num_stages=2,
        grid="(cdiv(seq_q, BLOCK_M), batch * heads, 1)",
    )


def swiglu_spec(graph: Graph, node: Node, weight_dtype: str) -> KernelSpec | str:
    """SwiGLU's epilogue after ATen's one GEMM over the packed gate and up weights."""
    hidden = int(node.arg("hidden"))  # type: ignore[arg-type]
    y_pointer, out_pointer = POINTER_TYPES.get(weight_dtype), POINTER_TYPES.get(node.types[0].dtype)
    if y_pointer is None or out_pointer is None:
        return "the dtype has no kernel variant (fp32, bf16, fp16)"
    return _spec(
        f"swiglu_{weight_dtype}_h{hidden}",
        template="swiglu_rows",
        params=(
            ("y_ptr", y_pointer),
            ("out_ptr", out_pointer),
            ("n_elements", "i32"),
            ("HIDDEN", "constexpr"),
            ("BLOCK", "constexpr"),
        ),
        constexprs={"HIDDEN": hidden, "BLOCK": EPILOGUE_BLOCK},
        div16=("y_ptr", "out_ptr"),
        num_warps=4,
        grid="(cdiv(n_elements, BLOCK), 1, 1), n_elements = numel(output)",
    )

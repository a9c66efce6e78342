"""Cuvil's Triton kernel templates for the fused ops the CUDA backend runs as its own kernels.

Each template is a plain Python function in Triton's language, not decorated here: the compile
worker wraps it in ``triton.jit`` for ``triton.compile`` (compile_worker.py), the CPU executor
in Triton's interpreter (interpreter.py), so both run the same source. A template is specialised
per node (specs.py): the row width ``N`` and the block that covers it are constexprs from the
node's static last dim, and a row kernel takes as many rows per program as fill a tile of
``specs.ROW_TILE`` elements (one row, where a row fills it), each load one masked block.

Math is fp32 whatever the storage type (the loads widen, the store rounds once). A template
calls no other template, so one function is all either wrapper needs. This module imports
Triton: only the compile worker and the CPU executor import it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from hashlib import sha256

import triton.language as tl
from triton.language.extra import libdevice


def rms_norm_rows(
    x_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_out,
    n_rows,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, BLOCK_M rows per program."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    inside = (rows < n_rows) & (cols < N)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    inverse = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = x * inverse * w
    tl.store(out_ptr + rows * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


def layer_norm_rows(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    stride_x,
    stride_out,
    n_rows,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """out[r] = (x[r] - mean) * rsqrt(var + eps) * w + b (biased variance), BLOCK_M rows per
    program. Without a weight or bias their pointers are never read (the caller passes any
    tensor)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    inside = (rows < n_rows) & (cols < N)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    mean = (tl.sum(x, axis=1) / N)[:, None]
    centred = tl.where(inside, x - mean, 0.0)
    inverse = tl.rsqrt(tl.sum(centred * centred, axis=1) / N + eps)[:, None]
    y = centred * inverse
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


def bias_act_residual(
    y_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    n_elements,
    N: tl.constexpr,
    INNER: tl.constexpr,
    BLOCK: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    ACT_AFTER_RES: tl.constexpr,
):
    """The epilogue of a GEMM or convolution that ATen ran (cuBLAS, cuDNN on a GPU): out =
    act(y + bias) + residual, or act(y + bias + residual) with ACT_AFTER_RES, over contiguous
    y whose bias index is (offset // INNER) % N (a linear's rows: INNER 1; NCHW: INNER = H * W).
    ACT is the activation's code in specs.ACTIVATION_CODES."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    inside = offsets < n_elements
    y = tl.load(y_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        channel = (offsets // INNER) % N
        y = y + tl.load(bias_ptr + channel, mask=inside, other=0.0).to(tl.float32)
    if HAS_RES and ACT_AFTER_RES:
        y = y + tl.load(res_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if ACT == 1:  # relu
        y = tl.maximum(y, 0.0)
    elif ACT == 2:  # relu6
        y = tl.minimum(tl.maximum(y, 0.0), 6.0)
    elif ACT == 3:  # silu
        y = y * tl.sigmoid(y)
    elif ACT == 4:  # gelu (erf)
        y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    elif ACT == 5:  # gelu (tanh approximation): libdevice's tanh
        y = 0.5 * y * (1.0 + libdevice.tanh(0.7978845608028654 * (y + 0.044715 * y * y * y)))
    elif ACT == 6:  # hardswish
        y = y * tl.minimum(tl.maximum(y + 3.0, 0.0), 6.0) / 6.0
    elif ACT == 7:  # tanh
        y = libdevice.tanh(y)
    elif ACT == 8:  # sigmoid
        y = tl.sigmoid(y)
    if HAS_RES and not ACT_AFTER_RES:
        y = y + tl.load(res_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=inside)


def swiglu_rows(
    y_ptr,
    out_ptr,
    n_elements,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The epilogue of SwiGLU's one GEMM that ATen ran: y holds rows of [gate, up] (2 * HIDDEN
    wide), out = silu(gate) * up (HIDDEN wide)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n_elements
    source = y_ptr + (offsets // HIDDEN) * (2 * HIDDEN) + offsets % HIDDEN
    gate = tl.load(source, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(source + HIDDEN, mask=inside, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


def rope_rows(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    inner,
    middle,
    cos_0,
    cos_1,
    cos_2,
    sin_0,
    sin_1,
    sin_2,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """out = x * cos + rotate_half(x) * sin over rows of width D, rotate_half(x) being
    cat(-x[D/2:], x[:D/2]). x and out are contiguous [outer, middle, inner, D]; cos and sin are
    indexed by their own strides over the first three dims (0 where they broadcast)."""
    row = tl.program_id(0).to(tl.int64)
    i2 = row % inner
    i1 = (row // inner) % middle
    i0 = row // (inner * middle)
    cols = tl.arange(0, BLOCK_HALF)
    inside = cols < HALF
    x_row = x_ptr + row * D + cols
    x1 = tl.load(x_row, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=inside, other=0.0).to(tl.float32)
    cos_row = cos_ptr + i0 * cos_0 + i1 * cos_1 + i2 * cos_2 + cols
    sin_row = sin_ptr + i0 * sin_0 + i1 * sin_1 + i2 * sin_2 + cols
    c1 = tl.load(cos_row, mask=inside, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + HALF, mask=inside, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row, mask=inside, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + HALF, mask=inside, other=0.0).to(tl.float32)
    out_row = out_ptr + row * D + cols
    kind = out_ptr.dtype.element_ty
    tl.store(out_row, (x1 * c1 - x2 * s1).to(kind), mask=inside)
    tl.store(out_row + HALF, (x2 * c2 + x1 * s2).to(kind), mask=inside)


def attention_blocks(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    o_ptr,
    seq_q,
    seq_k,
    heads,
    group,
    q_b,
    q_h,
    q_m,
    k_b,
    k_h,
    k_n,
    v_b,
    v_h,
    v_n,
    o_b,
    o_h,
    o_m,
    mask_b,
    mask_h,
    mask_m,
    scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
):
    """softmax(q k^T * scale + mask) v for one block of BLOCK_M queries of one (batch, head),
    over key blocks of BLOCK_N with a running max and sum (flash attention, forward). Heads
    share key/value heads in groups of ``group`` (GQA); the mask is additive and broadcast by
    its strides (0 where it repeats); causal keeps keys at or before each query (top-left)."""
    block = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // heads
    h = batch_head % heads
    kv = h // group
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_in = rows < seq_q
    dim_in = dims < D
    q_rows = q_ptr + b * q_b + h * q_h + rows[:, None] * q_m + dims[None, :]
    q = tl.load(q_rows, mask=row_in[:, None] & dim_in[None, :], other=0.0).to(tl.float32)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, seq_k, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_in = cols < seq_k
        k_cols = k_ptr + b * k_b + kv * k_h + cols[None, :] * k_n + dims[:, None]
        k = tl.load(k_cols, mask=dim_in[:, None] & col_in[None, :], other=0.0).to(tl.float32)
        scores = tl.dot(q, k, input_precision="ieee") * scale
        valid = row_in[:, None] & col_in[None, :]
        if HAS_MASK:
            bias = mask_ptr + b * mask_b + h * mask_h + rows[:, None] * mask_m + cols[None, :]
            scores += tl.load(bias, mask=valid, other=0.0).to(tl.float32)
        if IS_CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None])
        scores = tl.where(valid, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        safe = tl.where(new_best == float("-inf"), 0.0, new_best)  # rows with no key yet
        p = tl.exp(scores - safe[:, None])
        alpha = tl.exp(best - safe)
        total = total * alpha + tl.sum(p, axis=1)
        v_rows = v_ptr + b * v_b + kv * v_h + cols[:, None] * v_n + dims[None, :]
        v = tl.load(v_rows, mask=col_in[:, None] & dim_in[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        best = new_best
    out = acc / tl.where(row_in, total, 1.0)[:, None]  # rows past seq_q are never stored
    o_rows = o_ptr + b * o_b + h * o_h + rows[:, None] * o_m + dims[None, :]
    kind = o_ptr.dtype.element_ty
    tl.store(o_rows, out.to(kind), mask=row_in[:, None] & dim_in[None, :])


TEMPLATES: dict[str, Callable[..., None]] = {
    "rms_norm_rows": rms_norm_rows,
    "layer_norm_rows": layer_norm_rows,
    "bias_act_residual": bias_act_residual,
    "rope_rows": rope_rows,
    "swiglu_rows": swiglu_rows,
    "attention_blocks": attention_blocks,
}


def template_source(name: str) -> str:
    """The template's source text, as the kernels layer stores it beside each cubin."""
    return inspect.getsource(TEMPLATES[name])


def template_digest(name: str) -> str:
    """sha256 of the source: a loaded artifact interprets only the template it was built from."""
    return sha256(template_source(name).encode()).hexdigest()

"""The ops an artifact's graph may hold: Cuvil's fused ops and a reviewed list of pure aten ops.

An allowlist, not a denylist. Every family below says why its ops are safe to run from an
artifact someone else built: each computes its outputs from its inputs and literal arguments
only — no files, network, random state, in-place writes, uninitialised memory or other side
effects. An op that allocates from a size its arguments give is listed in ``SIZE_ARGUMENTS``,
and the load limits bound that size (``cuvil.artifact.limits``). The compiler checks a graph
against this list before it packages it (a model that needs another op fails at compile time)
and every loaded graph is checked again, so a forged ``aten.from_file`` is refused by name.

To add an op: put it in the family it belongs to (or a new family with its reason), and check
that it reads nothing but its arguments and writes nothing but its outputs.

Cuvil's fused ops are allowed as a whole (``FUSED_OPS``); each is pure but those in
``IN_PLACE_REASONS``, which write one tensor argument in place and say why that is safe.
``tests/cuvil/test_allowed_ops.py`` holds every in-place fused op to having a reason here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cuvil.fused_ops import FUSED_OPS
from cuvil.ir import Graph, Node

# Graph structure, not computation: an input slot and a constant read from the weights file.
STRUCTURAL_OPS = ("input", "const")


@dataclass(frozen=True)
class OpFamily:
    name: str
    why: str
    ops: tuple[str, ...]


def _overloads(names: str, overload: str = "default") -> tuple[str, ...]:
    return tuple(f"aten.{name}.{overload}" for name in names.split())


FAMILIES: tuple[OpFamily, ...] = (
    OpFamily(
        "elementwise arithmetic",
        "each output element is a function of the matching input elements; output sizes are "
        "the broadcast of the inputs'",
        (
            *_overloads("add sub mul div remainder fmod rsub bitwise_and bitwise_or", "Tensor"),
            *_overloads("add sub mul div remainder fmod rsub bitwise_and bitwise_or", "Scalar"),
            *_overloads("bitwise_xor __and__ __or__ __xor__", "Tensor"),
            *_overloads("bitwise_xor __and__ __or__ __xor__", "Scalar"),
            "aten.div.Tensor_mode",
            "aten.div.Scalar_mode",
            "aten.floor_divide.default",
            "aten.pow.Tensor_Scalar",
            "aten.pow.Tensor_Tensor",
            "aten.pow.Scalar",
            "aten.lerp.Scalar",
            "aten.lerp.Tensor",
            *_overloads(
                "abs neg reciprocal sqrt rsqrt square exp exp2 expm1 log log1p log2 log10 sin cos "
                "tan asin acos atan atan2 sinh cosh tanh asinh acosh atanh erf erfc sign floor "
                "ceil round trunc bitwise_not logical_not logical_and logical_or logical_xor "
                "isnan isinf nan_to_num maximum minimum clamp clamp_min clamp_max"
            ),
            "aten.clamp.Tensor",
            "aten.clamp_min.Tensor",
            "aten.clamp_max.Tensor",
            "aten.max.other",
            "aten.min.other",
        ),
    ),
    OpFamily(
        "comparisons and selection",
        "elementwise tests and choices between existing tensors or scalars",
        (
            *_overloads("eq ne lt le gt ge", "Tensor"),
            *_overloads("eq ne lt le gt ge", "Scalar"),
            "aten.where.self",
            "aten.where.ScalarSelf",
            "aten.where.ScalarOther",
            "aten.where.Scalar",
            "aten.masked_fill.Scalar",
            "aten.masked_fill.Tensor",
        ),
    ),
    OpFamily(
        "activations",
        "elementwise (or along one dim for glu) nonlinearities of their input",
        _overloads(
            "relu relu6 gelu silu sigmoid hardtanh hardswish hardsigmoid leaky_relu elu celu "
            "selu softplus mish glu prelu threshold hardshrink"
        ),
    ),
    OpFamily(
        "reductions, scans and sorting",
        "reduce, accumulate or order along dims of their input; outputs are no larger than it",
        (
            "aten.sum.default",
            "aten.sum.dim_IntList",
            "aten.mean.default",
            "aten.mean.dim",
            "aten.prod.default",
            "aten.prod.dim_int",
            "aten.amax.default",
            "aten.amin.default",
            "aten.max.default",
            "aten.max.dim",
            "aten.min.default",
            "aten.min.dim",
            "aten.argmax.default",
            "aten.argmin.default",
            "aten.all.default",
            "aten.all.dim",
            "aten.any.default",
            "aten.any.dim",
            "aten.var.correction",
            "aten.var_mean.correction",
            "aten.std.correction",
            "aten.std_mean.correction",
            "aten.logsumexp.default",
            "aten.cumsum.default",
            "aten.cumprod.default",
            "aten.diff.default",
            "aten.topk.default",
            "aten.sort.default",
            "aten.sort.stable",
            "aten.argsort.default",
            "aten.argsort.stable",
            "aten.softmax.int",
            "aten.log_softmax.int",
            "aten._softmax.default",
            "aten._log_softmax.default",
        ),
    ),
    OpFamily(
        "linear algebra and attention",
        "products of their input tensors; output sizes follow from the inputs'",
        (
            *_overloads("linear matmul mm bmm addmm baddbmm t scaled_dot_product_attention"),
            "aten.einsum.default",
        ),
    ),
    OpFamily(
        "convolution, pooling and normalisation",
        "windowed or per-channel computations over their input with constant weights",
        (
            *_overloads(
                "conv1d conv2d convolution conv_transpose1d max_pool1d max_pool2d avg_pool1d "
                "avg_pool2d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_max_pool2d "
                "layer_norm native_layer_norm group_norm native_group_norm batch_norm "
                "instance_norm _native_batch_norm_legit_no_training pixel_shuffle"
            ),
            "aten.conv_transpose2d.input",
        ),
    ),
    OpFamily(
        "views and layout",
        "re-index their input (a view, or a copy of the same elements); sizes are checked "
        "against the input's by torch",
        (
            *_overloads(
                "view reshape _unsafe_view permute unsqueeze expand alias clone contiguous "
                "flip roll tril triu narrow chunk type_as _to_copy"
            ),
            "aten.transpose.int",
            "aten.squeeze.default",
            "aten.squeeze.dim",
            "aten.squeeze.dims",
            "aten.flatten.using_ints",
            "aten.unflatten.int",
            "aten.slice.Tensor",
            "aten.select.int",
            "aten.split.Tensor",
            "aten.split_with_sizes.default",
            "aten.unbind.int",
            "aten.movedim.int",
            "aten.to.dtype",
        ),
    ),
    OpFamily(
        "joining, padding and repeating",
        "build a tensor from existing ones; padding and repeat counts are size arguments "
        "bounded at load",
        (
            *_overloads("cat stack pad constant_pad_nd repeat tile"),
            "aten.repeat_interleave.self_int",
        ),
    ),
    OpFamily(
        "indexing and lookup",
        "read elements of their input at given indices; torch refuses indices out of range",
        (*_overloads("gather index_select embedding"), "aten.index.Tensor"),
    ),
    OpFamily(
        "filled tensors",
        "tensors of a constant or a range, never uninitialised memory (no empty*); the sizes "
        "they take are size arguments bounded at load",
        (
            *_overloads("full ones zeros full_like ones_like zeros_like new_ones new_zeros"),
            *_overloads("new_full scalar_tensor arange linspace"),
            "aten.arange.start",
            "aten.arange.start_step",
        ),
    ),
)

# Fused ops that write an argument in place (``FusedOp.writes``), and why an artifact may hold them.
IN_PLACE_REASONS: dict[str, str] = {
    "cuvil.kv_cache_write": (
        "writes a decoder's KV cache, which is state the caller owns and passes in: the IR "
        "verifier accepts the write only into a graph input that no other node reads "
        "(ir_verify.py), so weights, constants and intermediates are never written; the rows "
        "and positions written are indices that torch bounds-checks against the cache"
    ),
}

# Ops that allocate from a size argument: op -> the arguments that give it (bounded at load).
SIZE_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "aten.full.default": ("size",),
    "aten.ones.default": ("size",),
    "aten.zeros.default": ("size",),
    "aten.new_ones.default": ("size",),
    "aten.new_zeros.default": ("size",),
    "aten.new_full.default": ("size",),
    "aten.arange.default": ("end",),
    "aten.linspace.default": ("steps",),
    "aten.arange.start": ("start", "end"),
    "aten.arange.start_step": ("start", "end"),
    "aten.repeat.default": ("repeats",),
    "aten.tile.default": ("dims",),
    "aten.repeat_interleave.self_int": ("repeats",),
    "aten.expand.default": ("size",),
    "aten.pad.default": ("pad",),
    "aten.constant_pad_nd.default": ("pad",),
}

# Arguments that must be absent or hold this value, where another value has side effects:
# attention with dropout draws from the random state.
REQUIRED_LITERALS: dict[str, dict[str, object]] = {
    "aten.scaled_dot_product_attention.default": {"dropout_p": 0.0},
}

ALLOWED_ATEN_OPS: dict[str, str] = {op: family.name for family in FAMILIES for op in family.ops}


class DisallowedOpError(ValueError):
    """A graph holds an op outside the allowlist."""


def is_allowed_op(op: str) -> bool:
    return op in ALLOWED_ATEN_OPS or op in FUSED_OPS or op in STRUCTURAL_OPS


def op_problems(graph: Graph) -> list[str]:
    """Why ``graph`` may not run from an artifact: ops off the list, pinned arguments changed."""
    problems = []
    refused = disallowed_ops(node.op for node in graph.nodes)
    if refused:
        where = [node.name for node in graph.nodes if node.op in refused][:5]
        problems.append(
            f"op(s) {refused} (nodes {where}) are not on Cuvil's allowlist of ops an artifact "
            "may run (cuvil/allowed_ops.py)"
        )
    for node in graph.nodes:
        problems.extend(literal_problems(node))
    return problems


def check_allowed_ops(graph: Graph) -> None:
    """Raise DisallowedOpError with every problem ``op_problems`` finds (the compiler's check)."""
    problems = op_problems(graph)
    if problems:
        raise DisallowedOpError(f"model {graph.name}: " + "; ".join(problems))


def literal_problems(node: Node) -> list[str]:
    """Arguments of ``node`` that ``REQUIRED_LITERALS`` pins and that hold another value."""
    return [
        f"%{node.name} ({node.op}) has {name}={node.arg(name)!r}; an artifact may only hold "
        f"{name}={value!r}"
        for name, value in REQUIRED_LITERALS.get(node.op, {}).items()
        if node.arg(name) not in (None, value)
    ]


def disallowed_ops(ops: Iterable[str]) -> list[str]:
    """The ops of ``ops`` outside the allowlist, sorted, once each."""
    return sorted({op for op in ops if not is_allowed_op(op)})

"""ATen graph (a torch.export ExportedProgram) -> Cuvil IR.

Each ATen call becomes one Node with its arguments named after the op's schema; weights become
``const`` nodes keyed by their state-dict name; symbolic sizes (``sym_size``, SymInt arithmetic)
are folded into sympy expressions over named symbols instead of staying nodes; shape asserts
are dropped (the runtime checks inputs against the symbols' bounds). Anything Cuvil cannot run
ahead of time fails here with an UnsupportedOpError naming the op and where it came from.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx
from torch.utils import _pytree as pytree

from cuvil.dtypes import dtype_name
from cuvil.frontend.symbols import UnsupportedShapeError, shape_symbol_names, to_cuvil_expr
from cuvil.fused_ops import FusedOpError, fused_node
from cuvil.ir import Arg, Enum, Graph, Node, TensorType, Value

# Nodes that only check shapes or metadata at trace time; the runtime's input checks replace them.
DROPPED_TARGETS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
    "aten.sym_constrain_range.default",
    "aten._assert_async.msg",
    "aten._assert_async.default",
}
SUPPORTED_NAMESPACES = ("aten",)
# Cuvil's own torch ops (frontend/kv_cache_ops.py) become the cuvil.* node of the same name.
CUVIL_NAMESPACE = "cuvil"


class UnsupportedOpError(ValueError):
    """An op the frontend cannot turn into IR; the message names the op and its origin."""


@dataclass(frozen=True)
class FrontendResult:
    graph: Graph
    weights: dict[str, torch.Tensor]


def convert_exported_program(
    ep: torch.export.ExportedProgram, name: str, dim_names: Mapping[tuple[str, int], str]
) -> FrontendResult:
    sym_names, symbols = shape_symbol_names(ep, dim_names)
    converter = _Converter(ep, sym_names)
    for fx_node in ep.graph.nodes:
        converter.visit(fx_node)
    graph = Graph(
        name=name,
        nodes=tuple(converter.nodes),
        inputs=tuple(n.name for n in converter.nodes if n.op == "input"),
        outputs=converter.outputs,
        symbols=symbols,
    )
    return FrontendResult(graph, converter.weights)


class _Converter:
    def __init__(
        self, ep: torch.export.ExportedProgram, sym_names: dict[sympy.Symbol, sympy.Symbol]
    ):
        self.ep = ep
        self.sym_names = sym_names
        signature = ep.graph_signature
        self.weight_keys: dict[str, str] = {
            **signature.inputs_to_parameters,
            **signature.inputs_to_buffers,
            **signature.inputs_to_lifted_tensor_constants,
        }
        self.user_inputs = set(signature.user_inputs)
        self.nodes: list[Node] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.env: dict[str, Arg] = {}  # fx node name -> Value, tuple of Values, or sympy expr
        self.outputs: tuple[tuple[str, Value], ...] = ()
        if signature.buffers_to_mutate or signature.user_inputs_to_mutate:
            raise UnsupportedOpError(
                "the model mutates buffers or inputs while running (call model.eval() and "
                "avoid in-place updates of inputs); mutated: "
                f"{sorted({**signature.buffers_to_mutate, **signature.user_inputs_to_mutate})}"
            )

    def visit(self, fx_node: torch.fx.Node) -> None:
        handler = {
            "placeholder": self.placeholder,
            "call_function": self.call_function,
            "output": self.output,
            "get_attr": self.get_attr,
        }.get(fx_node.op)
        if handler is None:
            raise UnsupportedOpError(f"fx node kind {fx_node.op!r}{_where(fx_node)}")
        handler(fx_node)

    # -- node kinds

    def placeholder(self, fx_node: torch.fx.Node) -> None:
        val = fx_node.meta.get("val")
        if fx_node.name in self.weight_keys:
            key = self.weight_keys[fx_node.name]
            tensor = self.ep.state_dict.get(key)
            if tensor is None:
                tensor = self.ep.constants[key]
            self.weights[key] = tensor.detach()
            self.add(fx_node, "const", (("key", key),), (self.tensor_type(tensor, fx_node),))
        elif fx_node.name in self.user_inputs:
            if not isinstance(val, torch.Tensor):
                raise UnsupportedOpError(
                    f"input {fx_node.name!r} is a {type(val).__name__}; only tensor inputs are "
                    "supported (bake Python scalars into the model)"
                )
            self.add(fx_node, "input", (), (self.tensor_type(val, fx_node),))
        else:
            raise UnsupportedOpError(f"placeholder {fx_node.name!r} of unknown kind")

    def get_attr(self, fx_node: torch.fx.Node) -> None:
        tensor = getattr(self.ep.graph_module, str(fx_node.target))
        if not isinstance(tensor, torch.Tensor):
            raise UnsupportedOpError(f"attribute {fx_node.target} is not a tensor{_where(fx_node)}")
        key = f"_attr.{fx_node.target}"
        self.weights[key] = tensor.detach()
        self.add(fx_node, "const", (("key", key),), (self.tensor_type(tensor, fx_node),))

    def call_function(self, fx_node: torch.fx.Node) -> None:
        target = fx_node.target
        val = fx_node.meta.get("val")
        if target is operator.getitem:
            parent, index = fx_node.args
            assert isinstance(parent, torch.fx.Node) and isinstance(index, int)
            source = self.env[parent.name]
            assert isinstance(source, tuple)
            self.env[fx_node.name] = source[index]
            return
        if isinstance(val, torch.SymInt | torch.SymFloat | torch.SymBool | int | float):
            self.env[fx_node.name] = self.sym_value(val, fx_node)
            return
        op_name = op_name_of(target)
        if op_name in DROPPED_TARGETS:
            return
        if not isinstance(target, torch._ops.OpOverload):
            raise UnsupportedOpError(f"unsupported op {op_name}{_where(fx_node)}")
        if target.namespace == CUVIL_NAMESPACE:
            self.cuvil_op(target, fx_node)
            return
        if target.namespace not in SUPPORTED_NAMESPACES:
            raise UnsupportedOpError(
                f"unsupported op {op_name}: custom ops outside {SUPPORTED_NAMESPACES} cannot be "
                f"compiled ahead of time{_where(fx_node)}"
            )
        if target._schema.is_mutable:
            raise UnsupportedOpError(
                f"unsupported op {op_name}: it mutates its inputs{_where(fx_node)}"
            )
        outputs = val if isinstance(val, list | tuple) else (val,)
        if not all(isinstance(out, torch.Tensor) for out in outputs):
            raise UnsupportedOpError(
                f"unsupported op {op_name}: returns non-tensors{_where(fx_node)}"
            )
        try:
            types = tuple(self.tensor_type(out, fx_node) for out in outputs)
        except UnsupportedShapeError as error:
            raise UnsupportedOpError(
                f"unsupported op {op_name}: {error}{_where(fx_node)}"
            ) from None
        args = self.schema_args(target, fx_node)
        node = self.add(fx_node, op_name, args, types)
        if isinstance(val, list | tuple):
            self.env[fx_node.name] = tuple(Value(node.name, i) for i in range(len(types)))

    def cuvil_op(self, target: torch._ops.OpOverload, fx_node: torch.fx.Node) -> None:
        """A ``torch.ops.cuvil.*`` call: the fused node of that name, arguments by schema."""
        op = f"cuvil.{target._schema.name.split('::')[-1]}"
        try:
            node = fused_node(
                op,
                fx_node.name,
                dict(self.schema_args(target, fx_node)),
                (self.tensor_type(fx_node.meta["val"], fx_node),),
                _origin(fx_node),
            )
        except FusedOpError as error:
            raise UnsupportedOpError(f"{error}{_where(fx_node)}") from None
        self.nodes.append(node)
        self.env[fx_node.name] = node.value()

    def output(self, fx_node: torch.fx.Node) -> None:
        (results,) = fx_node.args
        names = output_names(self.ep)
        outputs = []
        for out_name, result in zip(names, results, strict=True):  # type: ignore[arg-type]
            value = self.env.get(result.name) if isinstance(result, torch.fx.Node) else None
            if not isinstance(value, Value):
                raise UnsupportedOpError(
                    f"output {out_name!r} is not a tensor computed by the graph"
                )
            outputs.append((out_name, value))
        self.outputs = tuple(outputs)

    # -- helpers

    def add(self, fx_node: torch.fx.Node, op: str, args: tuple, types: tuple) -> Node:
        node = Node(fx_node.name, op, args, types, origin=_origin(fx_node))
        self.nodes.append(node)
        self.env[fx_node.name] = node.value()
        return node

    def tensor_type(self, tensor: torch.Tensor, fx_node: torch.fx.Node) -> TensorType:
        shape = tuple(self.expr(size) for size in tensor.shape)
        return TensorType(dtype_name(tensor.dtype), shape)

    def expr(self, size: int | torch.SymInt) -> sympy.Expr:
        if isinstance(size, torch.SymInt):
            return to_cuvil_expr(size.node.expr, self.sym_names)
        return sympy.Integer(size)

    def sym_value(self, val: Any, fx_node: torch.fx.Node) -> Arg:
        if isinstance(val, torch.SymInt | torch.SymFloat):
            try:
                expr = to_cuvil_expr(val.node.expr, self.sym_names)
            except UnsupportedShapeError as error:
                raise UnsupportedOpError(f"{error}{_where(fx_node)}") from None
            return int(expr) if expr.is_Integer else (float(expr) if expr.is_Number else expr)
        if isinstance(val, torch.SymBool):
            raise UnsupportedOpError(f"symbolic boolean {val}{_where(fx_node)}")
        return val

    def schema_args(self, target: torch._ops.OpOverload, fx_node: torch.fx.Node) -> tuple:
        schema_names = [argument.name for argument in target._schema.arguments]
        args: list[tuple[str, Arg]] = []
        for index, value in enumerate(fx_node.args):
            args.append((schema_names[index], self.arg(value, fx_node)))
        for key, value in fx_node.kwargs.items():
            args.append((key, self.arg(value, fx_node)))
        return tuple(args)

    def arg(self, value: Any, fx_node: torch.fx.Node) -> Arg:
        if isinstance(value, torch.fx.Node):
            return self.env[value.name]
        if isinstance(value, list | tuple):
            return tuple(self.arg(item, fx_node) for item in value)
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, torch.dtype):
            return Enum("dtype", dtype_name(value))
        if isinstance(value, torch.device):
            return Enum("device", value.type)
        if isinstance(value, torch.memory_format):
            return Enum("memory_format", str(value).removeprefix("torch."))
        if isinstance(value, torch.layout):
            return Enum("layout", str(value).removeprefix("torch."))
        if isinstance(value, torch.SymInt | torch.SymFloat):
            return self.sym_value(value, fx_node)
        raise UnsupportedOpError(
            f"argument {value!r} of type {type(value).__name__} in {op_name_of(fx_node.target)}"
            f"{_where(fx_node)}"
        )


def output_names(ep: torch.export.ExportedProgram) -> list[str]:
    """Names for the flat outputs, from the model's output structure (``logits``, ``output_1``…)."""
    spec = ep.call_spec.out_spec
    leaves = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    paths, _ = pytree.tree_flatten_with_path(leaves)
    names = []
    for index, (path, _) in enumerate(paths):
        parts = [_key_text(key) for key in path]
        name = "_".join(part for part in parts if part) or "output"
        if (name == "output" and len(paths) > 1) or name[0].isdigit():
            name = f"output_{name}" if name != "output" else f"output_{index}"
        names.append(name)
    return names


def _key_text(key: Any) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            text = str(getattr(key, attribute))
            return "".join(char if char.isalnum() or char == "_" else "_" for char in text)
    return ""


def op_name_of(target: Any) -> str:
    """``aten.add.Tensor`` for an ATen overload; the function's name for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def _origin(fx_node: torch.fx.Node) -> str:
    stack = fx_node.meta.get("nn_module_stack") or {}
    module = next(reversed(stack.values()))[0] if stack else ""
    trace = (fx_node.meta.get("stack_trace") or "").strip().splitlines()
    files = [line.strip() for line in trace if line.strip().startswith("File ")]
    location = ""
    if files:
        parts = files[-1].split('"')
        if len(parts) >= 3:
            line = parts[2].split(",")[1].strip().removeprefix("line ")
            location = f"{parts[1].rsplit('/', 1)[-1]}:{line}"
    return " ".join(part for part in (module, f"({location})" if location else "") if part)


def _where(fx_node: torch.fx.Node) -> str:
    origin = _origin(fx_node)
    return f" (node {fx_node.name}{', from ' + origin if origin else ''})"

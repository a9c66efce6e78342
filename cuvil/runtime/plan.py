"""Execution plan: a Graph turned, once, into a flat list of bound kernel calls over slots.

Building the plan resolves every op to its kernel, decodes literal arguments, assigns each value
a slot, places weights on the device, and works out when each intermediate is last used, so
that a call is one loop over prepared steps: fill the step's tensor arguments from slots, call,
store, release dead slots. No graph walking, no dict lookups by name, no shape inference per call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import sympy
import torch

from cuvil.ir import Arg, Enum, Graph, Node, Value
from cuvil.runtime.donation import donated_residuals
from cuvil.runtime.kernels import (
    FusedCall,
    Kernel,
    KernelChoices,
    KernelFactory,
    NativeForm,
    call_layout,
    decode_enum,
    resolve_kernel,
)
from cuvil.runtime.shape_cache import ShapeCache, shape_only_nodes
from cuvil.shape_expr import compile_expr

# A filler computes one argument at call time from the slots and the symbol values.


def view_as_reshape(tensor: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """``aten.view`` in a plan: the graph is functional (nothing writes through an alias), so a
    view may as well be a reshape — the same view where one exists, a copy where a pass left a
    strided tensor (a slice of a merged GEMM) that ``view`` would refuse."""
    return tensor.reshape(size)


# Plan-wide kernels for aten ops.
PLAN_KERNELS: dict[str, Kernel] = {"aten.view.default": view_as_reshape}
Filler = Callable[[list[Any], Mapping[str, int]], Any]


@dataclass(frozen=True)
class Step:
    kernel: Kernel
    args: tuple[Any, ...]  # literals in place, placeholders where fills go
    kwargs: dict[str, Any]
    slot_fills: tuple[tuple[int, int], ...]  # (arg position, slot)
    computed_fills: tuple[tuple[int | str, Filler], ...]  # (position or kwarg name, filler)
    outputs: tuple[int, ...]  # slots for the step's outputs
    release: tuple[int, ...]  # slots whose last use is this step
    name: str
    choices: KernelChoices | None = None  # what the kernel still decides per shape
    native: NativeForm | None = None  # a fused kernel's native form (runtime/kernels.py)
    reads: tuple[int, ...] = ()  # every slot the step reads, fills and lists included


# Sees a step's filled arguments and the slots just before the step runs.
StepObserver = Callable[["Step", tuple[Any, ...], Mapping[str, Any], list[Any]], None]


class PlanError(ValueError):
    pass


class PlanRunner(Protocol):
    """What runs a model's calls: the plan itself, or a backend's wrapper around it (the CUDA
    backend's graphs per shape)."""

    def run(
        self, inputs: Mapping[str, torch.Tensor], symbols: Mapping[str, int]
    ) -> dict[str, Any]: ...


class ExecutionPlan:
    def __init__(
        self,
        graph: Graph,
        weights: Mapping[str, torch.Tensor],
        device: torch.device | str,
        factories: Mapping[str, KernelFactory],
        *,
        in_place: bool = True,
    ) -> None:
        """``factories``: the backend's kernel factory for each fused op it implements;
        ``in_place``: kernels may write over inputs nothing reads later (runtime/donation.py)."""
        self.graph = graph
        self.device = torch.device(device)
        self._kernels = PLAN_KERNELS
        self._slot: dict[Value, int] = {}
        for node in graph.nodes:
            for index in range(len(node.types)):
                self._slot[Value(node.name, index)] = len(self._slot)
        self.initial: list[Any] = [None] * len(self._slot)
        self.input_slots = tuple((name, self._slot[Value(name)]) for name in graph.inputs)
        self.output_slots = tuple((name, self._slot[value]) for name, value in graph.outputs)
        self._factories = factories
        self._const_slots: set[int] = set()
        self._read_slots: set[int] = {slot for _, slot in self.output_slots}
        last_use = self._last_uses()
        self.donated = donated_residuals(graph) if in_place else frozenset()
        self.steps: tuple[Step, ...] = tuple(
            self._step(node, last_use) for node in graph.nodes if not self._place(node, weights)
        )
        for slot in self._const_slots - self._read_slots:  # consumed only by prepacking kernels
            self.initial[slot] = None
        self._split_shape_steps()

    def _split_shape_steps(self) -> None:
        """Shape-only steps run once per shape (see shape_cache.py), data steps every call."""
        shape_only = shape_only_nodes(self.graph)
        self.shape_steps = tuple(step for step in self.steps if step.name in shape_only)
        self.data_steps = tuple(step for step in self.steps if step.name not in shape_only)
        kept = {  # shape-only values that data steps read
            self._slot[value]
            for node in self.graph.nodes
            if node.name not in shape_only
            for value in node.inputs
            if value.node in shape_only
        }
        # Shape steps all run before the data steps, so a shape step must not free a value
        # that a data step reads later, even when it is that value's last reader in graph order.
        self.shape_steps = tuple(
            replace(step, release=tuple(slot for slot in step.release if slot not in kept))
            for step in self.shape_steps
        )
        self.shape_cache = ShapeCache(sorted(kept))

    # -- building

    def _place(self, node: Node, weights: Mapping[str, torch.Tensor]) -> bool:
        """Put consts into their slots; True for nodes that need no step."""
        if node.op == "input":
            return True
        if node.op == "const":
            key = str(node.arg("key"))
            if key not in weights:
                raise PlanError(f"weights have no tensor {key!r} for %{node.name}")
            self.initial[self._slot[node.value()]] = weights[key].to(self.device)
            self._const_slots.add(self._slot[node.value()])
            return True
        return False

    def _last_uses(self) -> dict[int, str]:
        """slot -> name of the last node reading it (graph outputs and consts are never freed)."""
        kept = {slot for _, slot in self.output_slots}
        kept |= {self._slot[n.value()] for n in self.graph.nodes if n.op == "const"}
        last: dict[int, str] = {}
        for node in self.graph.nodes:
            for value in node.inputs:
                slot = self._slot[value]
                if slot not in kept:
                    last[slot] = node.name
        return last

    def _factory_step(self, node: Node, last_use: dict[int, str]) -> Step:
        """A fused op: the factory sees constants now and returns the function for the rest."""
        constants: dict[str, Any] = {}
        sizes: dict[str, tuple[int | None, ...]] = {}
        runtime: list[tuple[str, Value]] = []
        dtypes: dict[str, str] = {}
        for key, arg in node.args:
            if isinstance(arg, Value):
                slot = self._slot[arg]
                if slot in self._const_slots:
                    constants[key] = self.initial[slot]
                else:
                    runtime.append((key, arg))
                    # Static sizes of run-time operands let kernels pick their packed layout.
                    shape = self.graph.type_of(arg).shape
                    sizes[key] = tuple(int(d) if d.is_Integer else None for d in shape)
                    dtypes[key] = self.graph.type_of(arg).dtype
            else:
                literal, filler = self._compile_arg(arg)
                if filler is not None:
                    raise PlanError(f"%{node.name}: {node.op} needs {key!r} to be a constant")
                constants[key] = literal
        call = FusedCall(
            node.op,
            node.name,
            constants,
            tuple(key for key, _ in runtime),
            sizes,
            residual_donated=node.name in self.donated,
            dtypes=dtypes,
            output_dtype=node.types[0].dtype if node.types else "f32",
        )
        try:
            prepared = self._factories[node.op](call)
        except (ValueError, RuntimeError) as error:
            raise PlanError(f"%{node.name}: {node.op}: {error}") from None
        fills = tuple((i, self._slot[value]) for i, (_, value) in enumerate(runtime))
        self._read_slots.update(slot for _, slot in fills)
        return Step(
            prepared.run,
            (None,) * len(runtime),
            {},
            fills,
            (),
            self._outputs(node),
            self._release(node, last_use),
            node.name,
            prepared.choices,
            prepared.native,
            self._reads(node),
        )

    def _outputs(self, node: Node) -> tuple[int, ...]:
        return tuple(self._slot[Value(node.name, i)] for i in range(len(node.types)))

    def _release(self, node: Node, last_use: dict[int, str]) -> tuple[int, ...]:
        slots = {self._slot[v] for v in node.inputs if last_use.get(self._slot[v]) == node.name}
        return tuple(sorted(slots))

    def _step(self, node: Node, last_use: dict[int, str]) -> Step:
        if node.op in self._factories:
            return self._factory_step(node, last_use)
        try:
            kernel = resolve_kernel(node.op, self._kernels)
        except LookupError as error:
            raise PlanError(f"%{node.name}: {error}") from None
        positional, keyword_only, defaults = call_layout(kernel)
        given = dict(node.args)
        if positional or keyword_only:
            unknown = set(given) - set(positional) - keyword_only
            if unknown:
                raise PlanError(f"%{node.name}: {node.op} has no argument(s) {sorted(unknown)}")
            count = max((positional.index(k) + 1 for k in given if k in positional), default=0)
            missing = [k for k in positional[:count] if k not in given and k not in defaults]
            if missing:
                raise PlanError(f"%{node.name}: {node.op} is missing argument(s) {missing}")
            ordered = [given.get(k, defaults.get(k)) for k in positional[:count]]
            named = {k: v for k, v in given.items() if k in keyword_only}
        else:  # Cuvil kernels take their arguments in the node's order
            ordered, named = [arg for _, arg in node.args], {}
        args: list[Any] = []
        slot_fills: list[tuple[int, int]] = []
        computed: list[tuple[int | str, Filler]] = []
        for position, arg in enumerate(ordered):
            if isinstance(arg, Value):
                slot_fills.append((position, self._slot[arg]))
                self._read_slots.add(self._slot[arg])
                args.append(None)
            else:
                literal, filler = self._compile_arg(arg)
                args.append(literal)
                if filler is not None:
                    computed.append((position, filler))
        kwargs: dict[str, Any] = {}
        for key, arg in named.items():
            literal, filler = self._compile_arg(arg)
            kwargs[key] = literal
            if filler is not None:
                computed.append((key, filler))
        return Step(
            kernel,
            tuple(args),
            kwargs,
            tuple(slot_fills),
            tuple(computed),
            self._outputs(node),
            self._release(node, last_use),
            node.name,
            reads=self._reads(node),
        )

    def _reads(self, node: Node) -> tuple[int, ...]:
        return tuple(sorted({self._slot[value] for value in node.inputs}))

    def runtime_slots(self) -> frozenset[int]:
        """Slots whose values change from call to call: the inputs and what data steps make."""
        made = {slot for step in self.data_steps for slot in step.outputs}
        return frozenset(made | {slot for _, slot in self.input_slots})

    def _compile_arg(self, arg: Arg) -> tuple[Any, Filler | None]:
        """A literal ready to pass, or a filler when the argument depends on the call."""
        if isinstance(arg, Value):
            slot = self._slot[arg]
            self._read_slots.add(slot)
            return None, lambda slots, values: slots[slot]
        if isinstance(arg, Enum):
            return decode_enum(arg, self.device), None
        if isinstance(arg, sympy.Expr):
            evaluate = compile_expr(arg)
            return None, lambda slots, values: evaluate(values)
        if isinstance(arg, tuple):
            parts = [self._compile_arg(item) for item in arg]
            if all(filler is None for _, filler in parts):
                return [literal for literal, _ in parts], None
            fillers = [
                filler if filler is not None else (lambda s, v, literal=literal: literal)
                for literal, filler in parts
            ]
            return None, lambda slots, values: [fill(slots, values) for fill in fillers]
        return arg, None

    # -- running

    def run(
        self,
        inputs: Mapping[str, torch.Tensor],
        symbols: Mapping[str, int],
        observe: StepObserver | None = None,
    ) -> dict[str, Any]:
        """Execute with inputs already checked by the signature; returns outputs by name.
        ``observe`` sees each data step's filled arguments before it runs (a native plan loop
        records a shape's calls that way)."""
        slots = self.start(inputs, symbols)
        self.execute(self.data_steps, slots, symbols, observe)
        return {name: slots[slot] for name, slot in self.output_slots}

    def start(self, inputs: Mapping[str, torch.Tensor], symbols: Mapping[str, int]) -> list[Any]:
        """The slots at the start of a call: constants, inputs, and this shape's shape-only
        values (computed once per shape)."""
        slots = list(self.initial)
        for name, slot in self.input_slots:
            slots[slot] = inputs[name]
        if self.shape_steps:
            key = self.shape_cache.key(symbols)
            cached = self.shape_cache.get(key)
            if cached is None:
                self.execute(self.shape_steps, slots, symbols)
                self.shape_cache.put(key, slots)
            else:
                for slot, value in zip(self.shape_cache.kept_slots, cached, strict=True):
                    slots[slot] = value
        return slots

    @staticmethod
    def execute(
        steps: Sequence[Step],
        slots: list[Any],
        symbols: Mapping[str, int],
        observe: StepObserver | None = None,
    ) -> None:
        for step in steps:
            if step.slot_fills or step.computed_fills:
                args = list(step.args)
                kwargs = step.kwargs
                for position, slot in step.slot_fills:
                    args[position] = slots[slot]
                for where, fill in step.computed_fills:
                    if isinstance(where, int):
                        args[where] = fill(slots, symbols)
                    else:
                        kwargs = {**kwargs, where: fill(slots, symbols)}
            else:
                args, kwargs = list(step.args), step.kwargs
            if observe is not None:
                observe(step, tuple(args), kwargs, slots)
            result = step.kernel(*args, **kwargs)
            if len(step.outputs) == 1:
                slots[step.outputs[0]] = result
            else:
                for slot, item in zip(step.outputs, result, strict=True):
                    slots[slot] = item
            for slot in step.release:
                slots[slot] = None

    def kernel_names(self) -> Sequence[str]:
        return [step.name for step in self.steps]

    def kernel_trials(self) -> dict[tuple[str, int], int]:
        """(node, bucket) -> calls so far, for the choices kernels are still making."""
        trials: dict[tuple[str, int], int] = {}
        for step in self.steps:
            if step.choices is not None:
                calls = step.choices.trial_calls()
                trials.update(((step.name, key), n) for key, n in calls.items())
        return trials

    def preset_choices(self, choices: Mapping[str, Mapping[int, str]]) -> int:
        """node -> {bucket: name} made before: taken instead of decided again. Returns how many
        were taken."""
        return sum(
            step.choices.preset(choices[step.name])
            for step in self.steps
            if step.choices is not None and step.name in choices
        )

    def kernel_choices(self) -> dict[str, dict[int, str]]:
        """node -> {bucket: the path chosen, or "timing"} for the kernels that have run with a
        choice to make."""
        choices = {}
        for step in self.steps:
            described = step.choices.describe() if step.choices is not None else None
            if described:
                choices[step.name] = described
        return choices

"""The CPU's plan runner: a call at a settled shape runs as native schedules, not Python steps.

The Python plan (runtime/plan.py) stays the reference and the path every shape starts on. When a
call at a shape (its symbol values and the thread count) finishes with no kernel choice still
open — every tactic that shape meets is decided — the run was also recorded: each data step's
filled arguments, seen just before it ran. From that record each step gets its native calls:

    an ATen (or oneDNN ``mkldnn``) operator step   its dispatcher op, on the same arguments
    a fused kernel                                 its native form (native_calls.py), if any
    anything else                                  none: the step stays a Python call

Tensors in the arguments are bound to slots by identity; every value that is not a slot whose
value changes per call (an input or a data step's result) is a constant at this shape (weights,
shape-only values, literals, symbolic sizes already evaluated) and baked into the schedule.
Maximal runs of native steps become one ``Schedule`` each (native/plan_loop.cc). They are run
once on the recorded inputs and must answer as the Python plan did (else the shape keeps the
Python plan, and ``describe()`` says why); the shape's later calls run the schedules and the
Python steps between them in order. When every step is
native a call is one foreign call, made with the GIL released (``describe()`` says which it is
per shape). Schedules free each value after its last reader, as the Python plan does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cuvil.backends.cpu import fast_call
from cuvil.backends.cpu.native_calls import KeptCall, OpCall, Result
from cuvil.backends.cpu.plan_loop import load, reason
from cuvil.runtime.plan import ExecutionPlan, Step, view_as_reshape
from cuvil.runtime.shape_cache import ShapeCache
from cuvil.verify import compare_output

# shapes with native schedules kept per model: a generation model's decode graph meets every
# row count up to its slots, at the thread count it serves with and the one it was timed at.
# A schedule holds its steps and references to constants, not activations.
MAX_SCHEDULES = 32
# How far the schedules' answer may be from the Python plan's, relative to its largest value,
# where values pass between ops in bf16 or fp16. A fused kernel's native form (a C++
# attention, say) rounds fp32 sums in another order than its Python form; an fp32 plan sees
# that as ~1e-6 and the fp32 check below holds, but in a half-precision plan such a difference
# can tip a value to the next bf16 step at the cast after it, and each later layer carries it:
# a 12-layer bf16 Llama's logits differed by up to 3e-3 of their scale between two correct
# runs. A third of the bf16 verification budget (precisions.py), far below what a misbound
# argument gives (errors of the output's own size).
HALF_PRECISION_RELATIVE = 1e-2
HALF = (torch.bfloat16, torch.float16)
ENUM_ADDERS = {
    torch.dtype: "arg_dtype",
    torch.memory_format: "arg_memory_format",
    torch.layout: "arg_layout",
    torch.device: "arg_device",
}


class NotNative(Exception):
    """A step's arguments hold something a schedule cannot carry."""


@dataclass
class NativeStep:
    step: Step
    calls: Sequence[Any]


@dataclass
class Segment:
    """A run of native steps as one schedule: the slots it reads and writes back."""

    schedule: Any
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    release: tuple[int, ...]
    names: tuple[str, ...]
    call: fast_call.Caller  # one foreign call, made with the GIL released (fast_call.py)


@dataclass
class ShapeRun:
    """A shape's schedules and Python steps, in plan order."""

    parts: list[Segment | Step]
    native_steps: int
    python_steps: tuple[str, ...]
    whole: Segment | None = None  # every step native: the one schedule
    whole_inputs: tuple[str, ...] = ()  # its reads, as input names
    whole_outputs: tuple[tuple[str, int], ...] = ()  # output name -> position in its writes
    refused: str | None = None  # why this shape runs the Python plan after all

    def summary(self) -> dict[str, Any]:
        segments = sum(isinstance(part, Segment) for part in self.parts)
        return {
            "native_steps": self.native_steps,
            "python_steps": list(self.python_steps),
            "schedules": segments,
            "whole_plan_native": self.whole is not None,
            **({"refused": self.refused} if self.refused is not None else {}),
        }


@dataclass
class _Recording:
    plan: ExecutionPlan
    runtime: frozenset[int]
    entries: list[NativeStep | Step] = field(default_factory=list)
    half: bool = False  # some step read a bf16 / fp16 value computed in the call

    def observe(
        self, step: Step, args: tuple[Any, ...], kwargs: Mapping[str, Any], slots: list[Any]
    ) -> None:
        live = {id(slots[s]): s for s in self.runtime if isinstance(slots[s], torch.Tensor)}
        self.half = self.half or any(
            isinstance(slots[s], torch.Tensor) and slots[s].dtype in HALF
            for s in step.reads
            if s in self.runtime
        )
        fixed = {id(value) for s, value in enumerate(slots) if s not in self.runtime}
        try:
            if any(
                s in self.runtime and not isinstance(slots[s], torch.Tensor) for s in step.reads
            ):
                raise NotNative
            calls = _calls_of(step, args, kwargs)
            if calls is None:
                raise NotNative
            bound = [_bind(call, live, fixed, args, step.native is not None) for call in calls]
            entry = NativeStep(step, bound)
            _add_step(_Dry(), entry, _Temps(len(slots)))  # raises NotNative where it cannot
            self.entries.append(entry)
        except NotNative:
            self.entries.append(step)


def _calls_of(step: Step, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Sequence[Any] | None:
    if step.native is not None:
        return step.native(args)
    if step.kernel is view_as_reshape:
        return [OpCall(torch.ops.aten.reshape.default, args, dict(kwargs))]
    if isinstance(step.kernel, torch._ops.OpOverload):
        return [OpCall(step.kernel, args, dict(kwargs))]
    return None


@dataclass(frozen=True)
class _Slot:
    slot: int


def _bind(
    call: Any, live: dict[int, int], fixed: set[int], args: tuple[Any, ...], trusted: bool
) -> Any:
    """The call with run-time tensors replaced by their slots; other tensors must be constants
    (in a constant slot, or held by a fused kernel's native form: ``trusted``)."""
    given = {id(value) for value in args if isinstance(value, torch.Tensor)}

    def bind(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) in live:
                return _Slot(live[id(value)])
            if id(value) in fixed or (trusted and id(value) not in given):
                return value
            raise NotNative
        if isinstance(value, (list, tuple)):
            return [bind(item) for item in value]
        return value

    if isinstance(call, KeptCall):
        return KeptCall(
            call.kept,
            bind(call.source),
            bind(call.residual),
            call.source_shape,
            call.result_shape,
            call.channels_last,
        )
    return OpCall(
        call.op, tuple(bind(a) for a in call.args), {k: bind(v) for k, v in call.kwargs.items()}
    )


def _aliased(inputs: Mapping[str, Any]) -> bool:
    """Whether one tensor object is given as two inputs."""
    tensors = [id(value) for value in inputs.values() if isinstance(value, torch.Tensor)]
    return len(set(tensors)) != len(tensors)


class NativePlanRunner:
    """Runs a plan's calls: the Python plan until a shape is settled, its schedules after."""

    def __init__(self, plan: ExecutionPlan) -> None:
        self.plan = plan
        self._runtime = plan.runtime_slots()
        self._shapes: dict[tuple[Any, ...], ShapeRun] = {}
        self._lock = threading.Lock()
        self.slot_count = len(plan.initial)

    def run(self, inputs: Mapping[str, torch.Tensor], symbols: Mapping[str, int]) -> dict[str, Any]:
        key = (ShapeCache.key(symbols), torch.get_num_threads())
        shape = self._shapes.get(key)
        if shape is not None and shape.whole is not None:
            given = [inputs[name] for name in shape.whole_inputs]
            values = shape.whole.call(given)
            return {name: values[index] for name, index in shape.whole_outputs}
        if shape is not None:
            return self._run_parts(shape, inputs, symbols)
        if not load():
            return self.plan.run(inputs, symbols)
        return self._run_recorded(key, inputs, symbols)

    def direct(
        self,
        symbols: Mapping[str, int],
        input_names: Sequence[str],
        output_names: Sequence[str],
    ) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]] | None:
        """For a shape whose whole plan is one schedule: a call from the inputs in
        ``input_names`` order to the outputs in ``output_names`` order, with nothing between it
        and the foreign call (runtime/model.py keeps it per input key), which runs in inference
        mode whatever the caller's; else None."""
        shape = self._shapes.get((ShapeCache.key(symbols), torch.get_num_threads()))
        if shape is None or shape.whole is None:
            return None
        outputs = dict(shape.whole_outputs)
        if set(output_names) != set(outputs) or not set(shape.whole_inputs) <= set(input_names):
            return None
        run = shape.whole.call
        take = [input_names.index(name) for name in shape.whole_inputs]
        give = [outputs[name] for name in output_names]
        if take == list(range(len(input_names))) and give == list(range(len(give))):
            return run  # any sequence of tensors, straight in
        return lambda tensors: _reordered(run([tensors[i] for i in take]), give)

    @property
    def full(self) -> bool:
        """Whether ``MAX_SCHEDULES`` shapes are kept: a new shape runs the Python plan."""
        return len(self._shapes) >= MAX_SCHEDULES

    def has_shape(self, symbols: Mapping[str, int]) -> bool:
        """Whether calls at these symbol values (and this thread count) run as schedules, or
        the library is not there to build them."""
        key = (ShapeCache.key(symbols), torch.get_num_threads())
        return key in self._shapes or not load()

    def _run_recorded(
        self, key: tuple[Any, ...], inputs: Mapping[str, torch.Tensor], symbols: Mapping[str, int]
    ) -> dict[str, Any]:
        if _aliased(inputs):  # arguments bind to slots by identity: one tensor, two inputs
            return self.plan.run(inputs, symbols)  # would bind both to one: record a later call
        if self.full:  # no room for another: run it, record nothing
            return self.plan.run(inputs, symbols)
        before = self.plan.kernel_trials()
        recording = _Recording(self.plan, self._runtime)
        outputs = self.plan.run(inputs, symbols, recording.observe)
        if self.plan.kernel_trials() != before:
            return outputs  # a choice this shape meets is still open: record a later call
        shape = self._assemble(recording.entries)
        refused = self._check(shape, inputs, symbols, outputs, recording.half)
        if refused is not None:
            steps = self.plan.data_steps
            names = tuple(step.name for step in steps)
            shape = ShapeRun(list(steps), 0, names, refused=refused)
        with self._lock:
            self._shapes.setdefault(key, shape)
        return outputs

    def _check(
        self,
        shape: ShapeRun,
        inputs: Mapping[str, torch.Tensor],
        symbols: Mapping[str, int],
        expected: Mapping[str, Any],
        half: bool = False,
    ) -> str | None:
        """Why the schedules must not serve this shape (a call that fails, or answers other
        than the Python plan's on the recorded inputs, within ``HALF_PRECISION_RELATIVE``
        where the plan passes ``half`` values between its ops), or None."""
        try:
            if shape.whole is not None:
                given = [inputs[name] for name in shape.whole_inputs]
                values = shape.whole.call(given)
                got = {name: values[index] for name, index in shape.whole_outputs}
            else:
                got = self._run_parts(shape, inputs, symbols)
        except RuntimeError as error:
            return f"the schedules failed: {str(error).splitlines()[0]}"
        for name, value in expected.items():
            other = got[name]
            if isinstance(value, torch.Tensor) and not _same(value, other, half):
                return f"output {name!r} differs from the Python plan's"
        return None

    def _run_parts(
        self, shape: ShapeRun, inputs: Mapping[str, torch.Tensor], symbols: Mapping[str, int]
    ) -> dict[str, Any]:
        slots = self.plan.start(inputs, symbols)
        for part in shape.parts:
            if isinstance(part, Segment):
                values = part.call([slots[slot] for slot in part.reads])
                for slot, value in zip(part.writes, values, strict=True):
                    slots[slot] = value
                for slot in part.release:
                    slots[slot] = None
            else:
                ExecutionPlan.execute((part,), slots, symbols)
        return {name: slots[slot] for name, slot in self.plan.output_slots}

    # -- assembling a shape's schedules

    def _assemble(self, entries: list[NativeStep | Step]) -> ShapeRun:
        parts: list[Segment | Step] = []
        run: list[NativeStep] = []
        for index, entry in enumerate(entries):
            if isinstance(entry, NativeStep):
                run.append(entry)
                continue
            if run:
                parts.append(self._segment(run, entries[index:]))
                run = []
            parts.append(entry)
        if run:
            parts.append(self._segment(run, []))
        python = tuple(part.name for part in parts if isinstance(part, Step))
        native = len(entries) - len(python)
        shape = ShapeRun(parts, native, python)
        if len(parts) == 1 and isinstance(parts[0], Segment):
            whole = parts[0]
            inputs = {slot for _, slot in self.plan.input_slots}
            if set(whole.reads) <= inputs and all(
                slot in whole.writes for _, slot in self.plan.output_slots
            ):
                shape.whole = whole
                name_of = {slot: name for name, slot in self.plan.input_slots}
                shape.whole_inputs = tuple(name_of[slot] for slot in whole.reads)
                shape.whole_outputs = tuple(
                    (name, whole.writes.index(slot)) for name, slot in self.plan.output_slots
                )
        return shape

    def _segment(self, run: list[NativeStep], after: Sequence[NativeStep | Step]) -> Segment:
        made: set[int] = set()
        reads: list[int] = []
        for entry in run:
            for slot in _slots_read(entry.calls):
                if slot not in made and slot not in reads:
                    reads.append(slot)
            made.update(entry.step.outputs)
        later = {slot for entry in after for slot in _step_of(entry).reads}
        later |= {slot for _, slot in self.plan.output_slots}
        writes = tuple(sorted(slot for slot in made if slot in later))
        temps = _Temps(self.slot_count)
        schedule = torch.classes.cuvil_native.Schedule(
            self.slot_count + sum(len(e.calls) for e in run), reads, list(writes)
        )
        for entry in run:
            _add_step(schedule, entry, temps)
        released = {slot for entry in run for slot in entry.step.release}
        return Segment(
            schedule,
            tuple(reads),
            writes,
            tuple(sorted(released)),
            tuple(entry.step.name for entry in run),
            fast_call.caller(schedule),
        )

    def describe(self) -> dict[str, Any]:
        """Per settled shape: how many steps run natively, which stay Python, in how many
        schedules; or why no shape runs natively."""
        if not load():
            return {"status": f"Python plan: {reason()}"}
        shapes = {
            ", ".join(f"{name}={value}" for name, value in key[0])
            + f" threads={key[1]}": run.summary()
            for key, run in list(self._shapes.items())
        }
        why = fast_call.reason()
        calls = "one CPython call each" if why is None else f"TorchScript method ({why})"
        return {"status": "native schedules per settled shape", "calls": calls, "shapes": shapes}


def _reordered(values: list[torch.Tensor], order: list[int]) -> list[torch.Tensor]:
    return [values[index] for index in order]


def _same(expected: torch.Tensor, got: Any, half: bool = False) -> bool:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return False
    if not expected.is_floating_point():
        return torch.equal(got, expected)
    if half:
        return compare_output("output", got, expected).relative_to_scale <= HALF_PRECISION_RELATIVE
    return torch.allclose(got, expected, rtol=1e-4, atol=1e-5, equal_nan=True)


def _step_of(entry: NativeStep | Step) -> Step:
    return entry.step if isinstance(entry, NativeStep) else entry


def _slots_read(calls: Sequence[Any]) -> list[int]:
    found: list[int] = []

    def visit(value: Any) -> None:
        if isinstance(value, _Slot):
            found.append(value.slot)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for call in calls:
        if isinstance(call, KeptCall):
            visit([call.source, call.residual])
        else:
            visit(list(call.args))
            visit(list(call.kwargs.values()))
    return found


class _Dry:
    """Takes a schedule's building calls and does nothing: checks a step can be added."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args: None


class _Temps:
    """Slots past the plan's for the values a native form's calls pass between them."""

    def __init__(self, first: int) -> None:
        self.next = first

    def take(self) -> int:
        self.next += 1
        return self.next - 1


def _add_step(schedule: Any, entry: NativeStep, temps: _Temps) -> None:
    results: list[int] = []
    count = len(entry.calls)
    for index, call in enumerate(entry.calls):
        last = index == count - 1
        outputs = list(entry.step.outputs) if last else [temps.take()]
        if isinstance(call, KeptCall):
            _add_kept(schedule, call, results)
        else:
            _add_op(schedule, call, results)
        schedule.outputs(outputs)
        if last:
            schedule.release(sorted({*entry.step.release, *results}))
        results.append(outputs[0])


def _resolve(value: Any, results: list[int]) -> Any:
    if isinstance(value, Result):
        return _Slot(results[value.index])
    if isinstance(value, list):
        return [_resolve(item, results) for item in value]
    return value


def _add_kept(schedule: Any, call: KeptCall, results: list[int]) -> None:
    kept = call.kept
    primitive = kept.prepare(call.source_shape)
    reads = [_resolve(call.source, results).slot]
    if call.residual is not None:
        reads.append(_resolve(call.residual, results).slot)
    handles = [
        primitive.handle,
        primitive.src,
        primitive.dst,
        primitive.scratchpad,
        primitive.weight,
        primitive.bias,
        kept.dnnl.engine,
    ]
    flags = [
        primitive.scratchpad_size,
        int(kept.has_residual and not kept.donated),
        int(kept.donated),
        int(call.channels_last),
        int(kept.out_dtype == torch.bfloat16),
    ]
    out_shape = list(primitive.output_shape)
    if call.channels_last:
        empty = torch.empty(out_shape, memory_format=torch.channels_last, device="meta")
    else:
        empty = torch.empty(out_shape, device="meta")
    schedule.primitive(
        [int(h.value or 0) if h is not None else 0 for h in handles],
        flags,
        list(call.source_shape),
        out_shape,
        list(empty.stride()),
        list(call.result_shape),
        reads,
    )


def _add_op(schedule: Any, call: OpCall, results: list[int]) -> None:
    schema = call.op._schema
    name, overload = schema.name, schema.overload_name
    schedule.op(name, overload)
    arguments = schema.arguments
    values: list[Any] = []
    for position, argument in enumerate(arguments):
        if position < len(call.args):
            values.append(call.args[position])
        elif argument.name in call.kwargs:
            values.append(call.kwargs[argument.name])
        elif argument.has_default_value():
            values.append(argument.default_value)
        else:
            raise NotNative
    for argument, value in zip(arguments, values, strict=True):
        _add_argument(schedule, str(argument.type), _resolve(value, results))


def _add_argument(schedule: Any, kind: str, value: Any) -> None:
    if kind.startswith("Optional[") and value is not None:
        kind = kind[len("Optional[") : -1]
    if isinstance(value, _Slot):
        schedule.arg_slot(value.slot)
    elif isinstance(value, list) and kind in ("List[Tensor]", "List[Optional[Tensor]]"):
        if "Optional" in kind:
            schedule.arg_optional_tensors(len(value))
        else:
            schedule.arg_tensors([torch.empty(0)] * len(value))
        for element, item in enumerate(value):
            if isinstance(item, _Slot):
                schedule.fill_element(element, item.slot)
            elif item is not None:
                schedule.set_element(element, item)
    elif isinstance(value, list):
        if any(isinstance(item, _Slot) for item in value):
            raise NotNative
        if kind == "List[int]":
            schedule.arg_ints([int(item) for item in value])
        elif kind == "List[float]":
            schedule.arg_floats([float(item) for item in value])
        elif kind == "List[Optional[number]]" and all(item is not None for item in value):
            schedule.arg_scalars([float(item) for item in value])
        else:
            raise NotNative
    elif kind == "Tensor" and isinstance(value, (bool, int, float)):
        schedule.arg_number(value)
    elif type(value) in ENUM_ADDERS:
        getattr(schedule, ENUM_ADDERS[type(value)])(value)
    elif value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        schedule.arg(value)
    else:
        raise NotNative

"""The compile pipeline: the one place that fixes the order of stages.

    export -> import -> verify_ir -> passes -> codegen -> plan -> verify

Each stage name is also its OpenTelemetry span name, its key in ``report["stages"]`` and, with a
dump directory, the file its IR is dumped to (``<n>-<stage>.ir``).

The pass list is the target-neutral passes, then the lowering the target's backend declares
(``Lowering``: which epilogues its kernels fuse, channels-last or not, sibling linears, the
precisions it compiles); ``codegen`` asks the backend for the artifact's kernels layer.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from opentelemetry import trace
from torch.utils import _pytree as pytree

import cuvil
from cuvil.allowed_ops import check_allowed_ops
from cuvil.analysis.memory import MemoryPolicy, check_budget, plan_memory
from cuvil.artifact.files import ArtifactContents
from cuvil.artifact.kernels_layer import pack_kernels
from cuvil.backends import Backend, Lowering, backend_for
from cuvil.frontend.convert import convert_exported_program
from cuvil.frontend.export import ExportedModel, export_model
from cuvil.ir import Graph
from cuvil.ir_text import print_graph
from cuvil.ir_verify import verify_graph
from cuvil.passes.attention_masks import share_attention_mask_bias
from cuvil.passes.cleanup import (
    eliminate_common_subexpressions,
    fold_constants,
    remove_identities,
)
from cuvil.passes.dead_code import eliminate_dead_code
from cuvil.passes.fusion import (
    canonicalize_activations,
    epilogue_pass,
    fold_batch_norm,
    fuse_transformer_blocks,
)
from cuvil.passes.layout import to_channels_last
from cuvil.passes.low_activations import keep_low_activations
from cuvil.passes.precision import LOW_PRECISIONS, low_precision_pass
from cuvil.passes.program import Program
from cuvil.passes.rewrite import Rule, apply_rules
from cuvil.passes.sibling_linears import fuse_sibling_linears
from cuvil.precisions import PRECISIONS
from cuvil.runtime.model import CompiledModel
from cuvil.runtime.signature import InputBinder, Signature
from cuvil.stages import COMPILE_STAGES
from cuvil.verify import OutputError, compare_outputs, worst_relative_error

log = logging.getLogger("cuvil.pipeline")

STAGES = COMPILE_STAGES
PassFunction = Callable[[Program], Program]
# The passes every target gets, in order; the backend's lowering follows them.
NEUTRAL_PASSES: tuple[tuple[str, PassFunction], ...] = (
    ("dead_code", lambda program: replace(program, graph=eliminate_dead_code(program.graph))),
    ("identities", remove_identities),
    ("canonicalize_activations", canonicalize_activations),
    ("cse", eliminate_common_subexpressions),
    ("constant_fold", fold_constants),
    ("fold_batch_norm", fold_batch_norm),
    ("fuse_transformer_blocks", fuse_transformer_blocks),
    ("attention_masks", share_attention_mask_bias),
)
# Every pass name a compile may run (what ``disable_passes`` may name).
PASS_NAMES = (
    *(name for name, _ in NEUTRAL_PASSES),
    "fuse_epilogues",
    "sibling_linears",
    "layout",
    "precision",
    "low_activations",
)

tracer = trace.get_tracer("cuvil.pipeline")


@dataclass
class CompileOptions:
    target: str = "cpu"
    precision: str = "fp32"
    name: str | None = None
    dump_dir: Path | None = None
    on_stage: Callable[[str], None] | None = None
    disable_passes: tuple[str, ...] = ()
    patterns: tuple[Rule, ...] = ()  # user rewrite rules (see cuvil.patterns)
    tolerance: float = 1e-4  # max error relative to the output scale, else bisect
    on_mismatch: str = "fallback"  # "fallback": compile without the culprit pass; "raise"
    choose_kernels: bool = True  # time kernel choices now and carry them (kernel_choices.py)
    memory: MemoryPolicy = field(default_factory=MemoryPolicy)


@dataclass
class _Run:
    options: CompileOptions
    stages: list[dict[str, Any]] = field(default_factory=list)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self.options.on_stage is not None:
            self.options.on_stage(name)
        start = time.perf_counter()
        with tracer.start_as_current_span(f"cuvil.{name}"):
            yield
        self.stages.append({"name": name, "seconds": round(time.perf_counter() - start, 4)})

    def dump(self, name: str, graph: Graph) -> None:
        if self.options.dump_dir is not None:
            self.options.dump_dir.mkdir(parents=True, exist_ok=True)
            index = STAGES.index(name) if name in STAGES else len(STAGES)
            (self.options.dump_dir / f"{index}-{name}.ir").write_text(print_graph(graph))


def check_options(options: CompileOptions) -> Backend:
    """The target's backend, once the options are known to be ones it can compile."""
    backend = backend_for(options.target)
    backend.check_compile()
    unknown = set(options.disable_passes) - set(PASS_NAMES)
    if unknown:
        raise ValueError(f"unknown pass(es) {sorted(unknown)}; passes: {list(PASS_NAMES)}")
    if options.on_mismatch not in ("fallback", "raise"):
        raise ValueError(f"on_mismatch must be 'fallback' or 'raise', not {options.on_mismatch!r}")
    supported = [name for name in PRECISIONS if name in backend.lowering.precisions]
    if options.precision not in supported:
        raise ValueError(
            f"precision {options.precision!r} is not supported for {options.target}; "
            f"choose from {supported}"
        )
    return backend


def lowering_passes(lowering: Lowering, precision: str) -> tuple[tuple[str, PassFunction], ...]:
    """The backend's part of the pass list, in order."""
    passes: list[tuple[str, PassFunction]] = [("fuse_epilogues", epilogue_pass(lowering))]
    if lowering.sibling_linears:
        passes.append(("sibling_linears", fuse_sibling_linears))
    if lowering.channels_last:
        passes.append(("layout", to_channels_last))
    if precision in LOW_PRECISIONS:
        passes.append(("precision", low_precision_pass(precision)))
    if precision in ("bf16", "int8") and lowering.low_activations:
        passes.append(("low_activations", keep_low_activations))
    return tuple(passes)


def passes_for(options: CompileOptions) -> tuple[tuple[str, PassFunction], ...]:
    """The pass list: the neutral passes with the user's patterns (if any) right before the
    built-in fusions, then the target backend's lowering."""
    passes = NEUTRAL_PASSES
    if options.patterns:
        user = ("user_patterns", partial(apply_rules, rules=tuple(options.patterns)))
        index = [name for name, _ in NEUTRAL_PASSES].index("fold_batch_norm")
        passes = (*NEUTRAL_PASSES[:index], user, *NEUTRAL_PASSES[index:])
    lowering = backend_for(options.target).lowering
    return (*passes, *lowering_passes(lowering, options.precision))


def run_passes(
    program: Program, run: _Run, passes: tuple[tuple[str, PassFunction], ...]
) -> tuple[Program, list[dict[str, Any]]]:
    applied = []
    for name, apply in passes:
        before, hits_before = len(program.graph.nodes), dict(program.hits)
        start = time.perf_counter()
        program = apply(program)
        verify_graph(program.graph)
        hits = {
            k: v - hits_before.get(k, 0)
            for k, v in program.hits.items()
            if v - hits_before.get(k, 0)
        }
        applied.append(
            {
                "name": name,
                "ops_before": before,
                "ops_after": len(program.graph.nodes),
                "hits": hits,
                "seconds": round(time.perf_counter() - start, 4),
            }
        )
        run.dump(f"pass-{name}", program.graph)
    return program, applied


def eager_outputs(model: torch.nn.Module, exported: ExportedModel) -> tuple[list[Any], Any]:
    with torch.no_grad():
        result = model(*exported.args, **exported.kwargs)
    flat, spec = pytree.tree_flatten(result)
    return flat, spec


class VerificationError(AssertionError):
    """Compiled outputs differ from eager beyond the tolerance; names the pass responsible."""


def lower(
    program: Program, run: _Run, disabled: frozenset[str]
) -> tuple[Program, list[dict[str, Any]]]:
    """The passes the options ask for, minus ``disabled``; the result may hold only allowlisted
    ops, so a model needing another op fails here rather than on the node that loads it."""
    active = tuple((name, apply) for name, apply in passes_for(run.options) if name not in disabled)
    lowered, applied = run_passes(program, run, active)
    check_allowed_ops(lowered.graph)
    return lowered, applied


def build(
    program: Program, config: dict[str, Any], output_spec: Any, kernels: bytes | None = None
) -> CompiledModel:
    contents = ArtifactContents(config, program.graph, dict(program.weights), kernels=kernels)
    return CompiledModel(contents, output_spec=output_spec)


def measure(compiled: CompiledModel, inputs: dict, expected: dict) -> list[OutputError]:
    return compare_outputs(compiled.run(inputs), expected)


def failed_run(name: str, error: Exception) -> list[OutputError]:
    """A compiled model that raises on the examples: infinitely wrong, so bisection starts."""
    log.warning("compiled %s raised on the examples: %s: %s", name, type(error).__name__, error)
    message = f"raised {type(error).__name__}: {error}"[:300]
    return [OutputError(message, math.inf, math.inf, 0.0, None)]


def measure_built(
    build_model: Callable[[], CompiledModel], inputs: dict, expected: dict, name: str
) -> list[OutputError]:
    try:
        return measure(build_model(), inputs, expected)
    except Exception as error:  # any failure of the lowered program counts against its passes
        return failed_run(name, error)


def bisect_passes(program: Program, run: _Run, check: Callable[[Program], float]) -> str | None:
    """The first pass whose addition pushes the error over the tolerance (passes run in order)."""
    names = [name for name, _ in passes_for(run.options)]
    for count in range(1, len(names) + 1):
        disabled = frozenset(names[count:])
        candidate, _ = lower(program, _Run(run.options), disabled)
        if check(candidate) > run.options.tolerance:
            return names[count - 1]
    return None


def compile_model(
    model: torch.nn.Module, example_inputs: Any, dynamic_shapes: Any, options: CompileOptions
) -> CompiledModel:
    backend = check_options(options)
    run = _Run(options)
    started = time.perf_counter()
    with tracer.start_as_current_span("cuvil.compile"):
        with run.stage("export"):
            exported = export_model(model, example_inputs, dynamic_shapes)
        with run.stage("import"):
            name = options.name or type(model).__name__
            frontend = convert_exported_program(exported.program, name, exported.dim_names)
        with run.stage("verify_ir"):
            imported = Program(verify_graph(frontend.graph), frontend.weights)
            run.dump("import", imported.graph)
        with run.stage("passes"):
            program, applied = lower(imported, run, frozenset(options.disable_passes))
            run.dump("passes", program.graph)
        signature = Signature.of_graph(program.graph)
        config = {
            "name": name,
            "cuvil_version": cuvil.__version__,
            "torch_version": torch.__version__,
            "target": options.target,
            "precision": options.precision,
            "signature": signature.to_json(),
            "passes": [entry["name"] for entry in applied],
            "memory_policy": options.memory.to_json(),
        }
        inputs = _named_inputs(signature, exported)
        check_budget(
            program.graph, signature.symbols, _symbol_values(signature, inputs), options.memory
        )
        with run.stage("codegen"):
            kernels = pack_kernels(backend.codegen(program.graph, program.weights))
        with run.stage("plan"):
            flat_reference, output_spec = eager_outputs(model, exported)
            expected = dict(zip(signature.output_names, flat_reference, strict=True))
            compiled = build(program, config, output_spec, kernels)
        with run.stage("verify"):
            errors = measure_built(lambda: compiled, inputs, expected, name)
            bisection = None
            if worst_relative_error(errors) > options.tolerance:

                def check(candidate: Program) -> float:
                    layer = pack_kernels(backend.codegen(candidate.graph, candidate.weights))
                    built = partial(build, candidate, config, None, layer)
                    return worst_relative_error(measure_built(built, inputs, expected, name))

                culprit = bisect_passes(imported, run, check)
                worst = worst_relative_error(errors)
                bisection = {"error": worst if math.isfinite(worst) else None, "culprit": culprit}
                if options.on_mismatch == "raise" or culprit is None:
                    raise VerificationError(
                        f"compiled {name} differs from eager by {worst:.3g} of the "
                        f"output scale (tolerance {options.tolerance}); responsible pass: "
                        f"{culprit}; outputs: {[e.name for e in errors]}"
                    )
                disabled = frozenset(options.disable_passes) | {culprit}
                program, applied = lower(imported, run, disabled)
                config["passes"] = [entry["name"] for entry in applied]
                kernels = pack_kernels(backend.codegen(program.graph, program.weights))
                compiled = build(program, config, output_spec, kernels)
                errors = measure(compiled, inputs, expected)
            # kernel choices are made here, not on the first calls (the artifact carries them)
            choosing = time.perf_counter()
            if options.choose_kernels:
                config.update(backend.choose_kernels(compiled, inputs))
            tactics_seconds = round(time.perf_counter() - choosing, 3)
    compiled.contents.golden = {f"input.{k}": v for k, v in inputs.items()} | {
        f"output.{k}": v for k, v in expected.items()
    }
    config["report"] = {
        "compile_seconds": round(time.perf_counter() - started, 3),
        "stages": run.stages,
        "ops_before": len(imported.graph.nodes),
        "ops_after": len(program.graph.nodes),
        "op_histogram": program.graph.op_histogram(),
        "passes": applied,
        "notes": exported.notes + _precision_notes(options, program),
        "verification": {
            "outputs": [error.to_json() for error in errors],
            "max_relative_to_scale": worst_relative_error(errors),
            "tolerance": options.tolerance,
            "method": backend.verified_by,
        },
        "bisection": bisection,
        "memory_plan": plan_memory(
            program.graph, _symbol_values(signature, inputs), planner=options.memory.planner
        ).summary(),
        "fusions": dict(program.hits),
        "kernel_choice_seconds": tactics_seconds,
        "weights_bytes": sum(t.numel() * t.element_size() for t in program.weights.values()),
    }
    return compiled


def _precision_notes(options: CompileOptions, program: Program) -> list[str]:
    """Say so when a low precision was asked for but nothing could run in it (no GEMM-like
    op)."""
    low = options.precision
    if low not in LOW_PRECISIONS or program.hits.get(f"{low}_weights"):
        return []
    return [
        f"precision {low} requested, but the model has no linear, convolution or SwiGLU to run "
        f"in {low}: it runs in fp32"
    ]


def _symbol_values(signature: Signature, inputs: dict[str, torch.Tensor]) -> dict[str, int]:
    """The symbol values of the example inputs (the shapes the memory plan is reported at)."""
    return InputBinder(signature).bind(inputs)


def _named_inputs(signature: Signature, exported: ExportedModel) -> dict[str, torch.Tensor]:
    """The example inputs by signature name (export names user inputs after the parameters)."""
    by_name = dict(zip(exported.arg_names, exported.args, strict=False)) | exported.kwargs
    if all(isinstance(by_name.get(name), torch.Tensor) for name in signature.input_names):
        return {name: by_name[name] for name in signature.input_names}
    flat = [
        leaf
        for leaf in pytree.tree_leaves((exported.args, exported.kwargs))
        if isinstance(leaf, torch.Tensor)
    ]
    return dict(zip(signature.input_names, flat, strict=True))

"""The compile pipeline: the one place that fixes the order of stages.

    export -> import -> verify_ir -> passes -> plan -> verify

Each stage name is also its OpenTelemetry span name, its key in ``report["stages"]`` and, with a
dump directory, the file its IR is dumped to (``<n>-<stage>.ir``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from opentelemetry import trace
from torch.utils import _pytree as pytree

import cuvil
from cuvil.artifact.files import ArtifactContents
from cuvil.frontend.convert import convert_exported_program
from cuvil.frontend.export import ExportedModel, export_model
from cuvil.ir import Graph
from cuvil.ir_text import print_graph
from cuvil.ir_verify import verify_graph
from cuvil.passes.cleanup import (
    eliminate_common_subexpressions,
    fold_constants,
    remove_identities,
)
from cuvil.passes.dead_code import eliminate_dead_code
from cuvil.passes.fusion import (
    canonicalize_activations,
    fold_batch_norm,
    fuse_epilogues,
    fuse_transformer_blocks,
)
from cuvil.passes.layout import to_channels_last
from cuvil.passes.program import Program
from cuvil.runtime.model import CompiledModel, target_device
from cuvil.runtime.signature import Signature
from cuvil.verify import compare_outputs, worst_relative_error

STAGES = ("export", "import", "verify_ir", "passes", "plan", "verify")
PRECISIONS = ("fp32",)
PASSES: tuple[tuple[str, Callable[[Program], Program]], ...] = (
    ("dead_code", lambda program: replace(program, graph=eliminate_dead_code(program.graph))),
    ("identities", remove_identities),
    ("canonicalize_activations", canonicalize_activations),
    ("cse", eliminate_common_subexpressions),
    ("constant_fold", fold_constants),
    ("fold_batch_norm", fold_batch_norm),
    ("fuse_transformer_blocks", fuse_transformer_blocks),
    ("fuse_epilogues", fuse_epilogues),
    ("layout", to_channels_last),
)

tracer = trace.get_tracer("cuvil.pipeline")


@dataclass
class CompileOptions:
    target: str = "cpu"
    precision: str = "fp32"
    name: str | None = None
    dump_dir: Path | None = None
    on_stage: Callable[[str], None] | None = None


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


def check_options(options: CompileOptions) -> None:
    device = target_device(options.target)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"target {options.target!r} needs a CUDA device; none is visible here")
    if options.precision not in PRECISIONS:
        raise ValueError(
            f"precision {options.precision!r} is not supported; choose from {PRECISIONS}"
        )


def run_passes(program: Program, run: _Run) -> tuple[Program, list[dict[str, Any]]]:
    applied = []
    for name, apply in PASSES:
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


def compile_model(
    model: torch.nn.Module, example_inputs: Any, dynamic_shapes: Any, options: CompileOptions
) -> CompiledModel:
    check_options(options)
    run = _Run(options)
    started = time.perf_counter()
    with tracer.start_as_current_span("cuvil.compile"):
        with run.stage("export"):
            exported = export_model(model, example_inputs, dynamic_shapes)
        with run.stage("import"):
            name = options.name or type(model).__name__
            frontend = convert_exported_program(exported.program, name, exported.dim_names)
        with run.stage("verify_ir"):
            graph = verify_graph(frontend.graph)
            run.dump("import", graph)
        ops_before = len(graph.nodes)
        with run.stage("passes"):
            program, applied = run_passes(Program(graph, frontend.weights), run)
            graph = program.graph
            run.dump("passes", graph)
        signature = Signature.of_graph(graph)
        config = {
            "name": name,
            "cuvil_version": cuvil.__version__,
            "torch_version": torch.__version__,
            "target": options.target,
            "precision": options.precision,
            "signature": signature.to_json(),
            "passes": [entry["name"] for entry in applied],
        }
        inputs = _named_inputs(signature, exported)
        with run.stage("plan"):
            contents = ArtifactContents(config, graph, dict(program.weights))
            flat_reference, output_spec = eager_outputs(model, exported)
            compiled = CompiledModel(contents, output_spec=output_spec)
        with run.stage("verify"):
            actual = compiled.run(inputs)
            expected = dict(zip(signature.output_names, flat_reference, strict=True))
            errors = compare_outputs(actual, expected)
    contents.golden = {f"input.{k}": v for k, v in inputs.items()} | {
        f"output.{k}": v for k, v in expected.items()
    }
    config["report"] = {
        "compile_seconds": round(time.perf_counter() - started, 3),
        "stages": run.stages,
        "ops_before": ops_before,
        "ops_after": len(graph.nodes),
        "op_histogram": graph.op_histogram(),
        "passes": applied,
        "notes": exported.notes,
        "verification": {
            "outputs": [error.to_json() for error in errors],
            "max_relative_to_scale": worst_relative_error(errors),
        },
        "fusions": dict(program.hits),
        "weights_bytes": sum(t.numel() * t.element_size() for t in program.weights.values()),
    }
    return compiled


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

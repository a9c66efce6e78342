"""``cuvil compile SPEC [-o PATH_OR_REF]``: compile a model with a live stage display.

A ModelCompilation YAML goes through the worker's own per-target pipeline
(``cuvil_cli.compilation``): its validation, benchmark and gates hold as on the cluster (a failed
gate exits 1 naming its measured value and threshold), every target is compiled, and without
``-o`` the result goes where ``spec.output`` says. A Python ``module:factory`` is compiled with
``cuvil.jit`` for one target.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cuvil.api import jit
from cuvil.artifact import push_artifact
from cuvil.artifact.reference import is_oci_reference
from cuvil.pipeline import STAGES
from cuvil_cli.console import stage_progress, stderr_console
from cuvil_cli.oci_commands import add_registry_arguments, registry_config_from
from cuvil_cli.spec import SpecError, load_factory_spec


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compile", help="compile a model (SPEC: a ModelCompilation YAML or module:factory)"
    )
    parser.add_argument(
        "spec", help="a ModelCompilation YAML, or a Python 'module:factory' (cuvil.models:mlp)"
    )
    parser.add_argument(
        "-o",
        "--output",
        help="artifact path, or a registry/oci: REF to push to (default: the YAML's spec.output)",
    )
    parser.add_argument(
        "--target", help="cpu-x86_64, cuda-sm_90, … (default: the YAML's targets, else cpu)"
    )
    parser.add_argument(
        "--bench-iterations", type=int, default=20, help="a YAML's benchmark: timed runs each"
    )
    parser.add_argument(
        "--precision",
        help="fp32, bf16, fp16 or tf32 (last two: CUDA; default: the YAML's, else fp32)",
    )
    parser.add_argument("--dir", action="store_true", help="write the directory form, not one file")
    parser.add_argument(
        "--dump-ir", type=Path, help="dump the IR after each stage into this folder"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_registry_arguments(parser)
    parser.set_defaults(handler=run_compile)


def run_compile(args: argparse.Namespace) -> int:
    if args.spec.endswith((".yaml", ".yml")):
        from cuvil_cli.compile_spec import compile_yaml

        return compile_yaml(args)
    if not args.output:
        raise SpecError("-o PATH_OR_REF is needed for a module:factory SPEC")
    console = stderr_console()
    spec = load_factory_spec(args.spec)
    targets = spec.metadata.get("targets") or []
    args.target = args.target or (targets[0] if targets else "cpu")
    args.precision = args.precision or spec.metadata.get("precision") or "fp32"
    with stage_progress(console) as progress:
        task = progress.add_task(f"compiling {spec.name}", total=len(STAGES))

        def on_stage(stage: str) -> None:
            progress.update(task, description=f"compiling {spec.name}: {stage}", advance=1)

        compiled = jit(
            spec.model,
            spec.example_inputs,
            target=args.target,
            precision=args.precision,
            dynamic_shapes=spec.dynamic_shapes,
            name=spec.name,
            dump_dir=args.dump_ir,
            on_stage=on_stage,
        )
    if is_oci_reference(args.output):
        config = registry_config_from(args)
        path: str | Path = push_artifact(compiled.contents, args.output, registry_config=config).ref
    else:
        path = compiled.save(args.output, directory=args.dir)
    report = compiled.report
    if args.json:
        print(json.dumps({"artifact": str(path), "report": report}, indent=2))
        return 0
    verification = report["verification"]["max_relative_to_scale"]
    console.print(
        f"[green]compiled[/] {spec.name} for {args.target} in {report['compile_seconds']:.2f}s: "
        f"{report['ops_before']} -> {report['ops_after']} ops, "
        f"max error {verification:.2e} of output scale -> {path}"
    )
    print(compiled.signature.describe())
    return 0

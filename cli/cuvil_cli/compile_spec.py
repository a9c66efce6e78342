"""``cuvil compile SPEC.yaml``: a ModelCompilation compiled as the cluster would compile it.

Every target through the worker's per-target pipeline (``cuvil_cli.compilation``), with a live
stage display; then one artifact written to ``-o PATH``, or every target pushed with an index to
``-o REF`` (default: the spec's ``output``). A model the worker refuses, a failed validation or a
failed gate exits 1 with the worker's message (a gate's measured value and threshold).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from cuvil.artifact.reference import is_oci_reference
from cuvil.artifact.registry_config import ENV_CA_BUNDLE, ENV_PLAIN_HTTP, ENV_REGISTRY_CONFIG
from cuvil_cli.compilation import (
    Compilation,
    CompilationSpecError,
    Compiled,
    build_targets,
    gate_lines,
    push_targets,
    read_compilation,
    write_target,
)
from cuvil_cli.console import stage_progress, stderr_console


def compile_yaml(args: argparse.Namespace) -> int:
    from cuvil_worker.errors import CompileFailed

    console = stderr_console()
    compilation = _with_overrides(read_compilation(args.spec), args)
    output = args.output or compilation.output
    if not output:
        raise CompilationSpecError(f"{args.spec} has no spec.output: pass -o PATH_OR_REF")
    with (
        tempfile.TemporaryDirectory(prefix="cuvil-compile-") as work,
        stage_progress(console) as progress,
    ):
        task = progress.add_task(f"compiling {compilation.name}")

        def on_stage(stage: str) -> None:
            progress.update(task, description=f"compiling {compilation.name}: {stage}")

        try:
            compiled = build_targets(
                compilation,
                work_dir=Path(work),
                bench_iterations=args.bench_iterations,
                on_stage=on_stage,
            )
        except CompileFailed as error:
            progress.stop()
            console.print(f"[red]{error.reason}[/]: {error}")
            return 1
        if is_oci_reference(output):
            _registry_environment(args)
            push_targets(compiled, compilation, output, on_stage=on_stage)
            stored = f"{compiled.reference}@{compiled.index_digest}"
        else:
            stored = str(write_target(compiled, Path(output), directory=args.dir))
    if args.json:
        reports = {target: compiled.report(target) for target in compiled.packaged}
        print(json.dumps({"artifact": stored, "pushed": compiled.pushed, "report": reports}))
        return 0
    for line in _summary(compiled, stored):
        console.print(line, highlight=False)
    return 0


def _with_overrides(compilation: Compilation, args: argparse.Namespace) -> Compilation:
    """``--target`` and ``--precision`` over the spec's own."""
    spec = dict(compilation.spec)
    if args.target:
        spec["targets"] = [args.target]
    if args.precision:
        spec["precision"] = args.precision
    return Compilation(compilation.name, spec)


def _registry_environment(args: argparse.Namespace) -> None:
    """The registry flags, for the worker's push (which reads the shared environment)."""
    if getattr(args, "registry_config", None):
        os.environ[ENV_REGISTRY_CONFIG] = str(Path(args.registry_config).resolve())
    if getattr(args, "ca_bundle", None):
        os.environ[ENV_CA_BUNDLE] = str(args.ca_bundle)
    if getattr(args, "plain_http", False):
        os.environ[ENV_PLAIN_HTTP] = "true"


def _summary(compiled: Compiled, stored: str) -> list[str]:
    lines = []
    for target in compiled.packaged:
        report: dict[str, Any] = compiled.report(target)
        validation, bench = report.get("validation") or {}, report.get("benchmark") or {}
        p50 = bench.get("compiled_p50_ms", 0.0)
        speed = (
            f"{bench.get('speedup', 0.0):.2f}x eager (p50 {p50:.3f} ms)"
            if bench.get("measured", True)
            else "speed not measured here"
        )
        lines.append(
            f"[green]compiled[/] {compiled.name} for {target}: max error "
            f"{validation.get('max_relative_to_scale', 0.0):.2e} of output scale over "
            f"{validation.get('samples', 0)} samples, {speed}, {report.get('size', 0)} bytes"
        )
        if not bench.get("measured", True):
            lines.append(f"  {bench.get('reason', '')}")
        lines += [f"  gate {line}" for line in gate_lines(report)]
    lines.append(f"-> {stored}")
    return lines

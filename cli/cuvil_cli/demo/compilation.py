"""The demo's compile step: one model through the worker's own per-target pipeline, in process.

What the ``cuvil.compile`` Celery task does for one target (``cuvil_worker.target_pipeline``:
load -> cuvil.jit -> validate -> benchmark -> gates -> package -> publish), then what the
``cuvil.push_index`` task does (an OCI index tagged with the model's name), only with a local OCI
image layout standing in for the registry and no broker: the same functions, called directly
through ``cuvil_cli.compilation``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cuvil_cli.compilation import (
    DEFAULT_TARGET,
    Compilation,
    CompilationSpecError,
    build_targets,
    push_targets,
    read_compilation,
)
from cuvil_cli.spec import SpecError

BUILTIN_MODULE = "cuvil.models"


@dataclass(frozen=True)
class DemoModel:
    """A ``--models`` entry as the spec a ModelCompilation would carry."""

    name: str
    spec: dict[str, Any]

    @property
    def target(self) -> str:
        return str((self.spec.get("targets") or [DEFAULT_TARGET])[0])


@dataclass
class Compiled:
    """One model compiled, validated, benchmarked and stored in the layout under its tag."""

    name: str
    reference: str  # oci:LAYOUT:tag (the index), what the sidecar's CUVIL_MODEL takes
    manifest_digest: str
    index_digest: str
    target: str
    report: dict[str, Any]  # the worker's per-target report
    seconds: float


def demo_model(text: str) -> DemoModel:
    """``cuvil.models:NAME`` (a bundled model) or a ModelCompilation YAML file -> its spec.

    The worker compiles what a spec names, not arbitrary Python: other ``module:factory``
    strings are refused (``cuvil compile`` takes those).
    """
    if text.endswith((".yaml", ".yml")) or Path(text).is_file():
        try:
            compilation = read_compilation(text)
        except CompilationSpecError as error:
            raise SpecError(str(error)) from None
        return DemoModel(compilation.name, compilation.spec)
    module, _, factory = text.partition(":")
    if module != BUILTIN_MODULE or not factory:
        raise SpecError(
            f"--models {text!r}: the demo compiles through the worker, which takes "
            f"{BUILTIN_MODULE}:NAME (a bundled model) or a ModelCompilation YAML file"
        )
    spec = {"source": {"builtin": {"name": factory}}, "targets": [DEFAULT_TARGET]}
    return DemoModel(factory, spec)


def compile_to_layout(
    model: DemoModel, layout: Path, *, bench_iterations: int, on_stage: Any
) -> Compiled:
    """The worker's build + publish for the model's first target, then the index under its tag
    (``cuvil_cli.compilation``, which ``cuvil compile SPEC.yaml`` runs too).

    Raises the worker's own errors (``cuvil_worker.errors.CompileFailed`` and subclasses) when
    the model does not compile, validate or pass its gates.
    """
    import time

    from cuvil_worker import telemetry

    started = time.perf_counter()
    reference = f"oci:{layout.resolve()}:{model.name}"
    compilation = Compilation(model.name, dict(model.spec) | {"targets": [model.target]})
    parent = telemetry.current_traceparent()
    with telemetry.continued(parent, "cuvil.compile_target", target=model.target) as span:
        compiled = build_targets(
            compilation, work_dir=layout.parent / "work", bench_iterations=bench_iterations,
            on_stage=on_stage,
        )  # fmt: skip
    with telemetry.continued(parent, "cuvil.push_index"):
        push_targets(
            compiled, compilation, reference, on_stage=on_stage,
            trace_id=telemetry.trace_id_of(span),
        )  # fmt: skip
    (pushed,) = compiled.pushed
    return Compiled(
        name=model.name,
        reference=reference,
        manifest_digest=pushed["digest"],
        index_digest=str(compiled.index_digest),
        target=model.target,
        report=compiled.report(model.target),
        seconds=time.perf_counter() - started,
    )

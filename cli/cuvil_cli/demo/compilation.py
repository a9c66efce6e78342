"""The demo's compile step: one model through the worker's own per-target pipeline, in process.

What the ``cuvil.compile`` Celery task does for one target (``cuvil_worker.target_pipeline``:
load -> cuvil.jit -> validate -> benchmark -> gates -> package -> publish), then what the
``cuvil.push_index`` task does (an OCI index tagged with the model's name), only with a local OCI
image layout standing in for the registry and no broker: the same functions, called directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cuvil_cli.spec import COMPILATION_KIND, SpecError

DEFAULT_TARGET = "cpu-x86_64"
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
    path = Path(text)
    if text.endswith((".yaml", ".yml")) or path.is_file():
        try:
            documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
        except (OSError, yaml.YAMLError) as error:
            raise SpecError(f"cannot read {text}: {error}") from None
        manifest = next(
            (d for d in documents if isinstance(d, dict) and d.get("kind") == COMPILATION_KIND),
            None,
        )
        if manifest is None:
            raise SpecError(f"{text} holds no {COMPILATION_KIND}")
        name = str((manifest.get("metadata") or {}).get("name") or path.stem)
        return DemoModel(name, dict(manifest.get("spec") or {}))
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
    """The worker's build + publish for the model's first target, then the index under its tag.

    Raises the worker's own errors (``cuvil_worker.errors.CompileFailed`` and subclasses) when
    the model does not compile, validate or pass its gates.
    """
    import time

    from cuvil_worker import telemetry
    from cuvil_worker.config import WorkerConfig
    from cuvil_worker.target_pipeline import (
        annotations_for,
        build,
        publish,
        push_compilation_index,
    )

    started = time.perf_counter()
    repository = f"oci:{layout.resolve()}"
    spec = dict(model.spec) | {"output": {"repository": repository, "tag": model.name}}
    config = WorkerConfig(work_dir=layout.parent / "work", bench_iterations=bench_iterations)
    target = model.target
    parent = telemetry.current_traceparent()
    with telemetry.continued(parent, "cuvil.compile_target", target=target) as span:
        annotations = annotations_for(f"demo/{model.name}", telemetry.trace_id_of(span))
        packaged = build(spec, target, config, on_stage)
        pushed = publish(packaged, spec, target, on_stage, annotations)
    with telemetry.continued(parent, "cuvil.push_index"):
        on_stage("index")
        index = push_compilation_index(f"{repository}:{model.name}", [pushed], annotations)
    return Compiled(
        name=model.name,
        reference=f"{repository}:{model.name}",
        manifest_digest=pushed["digest"],
        index_digest=index.digest,
        target=target,
        report=packaged.report,
        seconds=time.perf_counter() - started,
    )

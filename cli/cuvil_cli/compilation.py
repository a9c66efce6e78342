"""A ModelCompilation without a cluster: the worker's own per-target pipeline, called in process.

``cuvil compile SPEC.yaml`` and ``cuvil demo`` both come here, so a spec behaves the same with
and without the operator: the same model name, validation (``spec.validation``), benchmark,
gates (``spec.gates``) and packaging per target (``cuvil_worker.target_pipeline.build``), then
either one artifact written to a path, or every target pushed by digest and one index tagged
over them (``publish`` and ``push_compilation_index``, as the Celery tasks do) — to a registry
or a local OCI layout.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

COMPILATION_KIND = "ModelCompilation"
DEFAULT_TARGET = "cpu-x86_64"


class CompilationSpecError(ValueError):
    """The file holds no ModelCompilation, or the command line asks for what it cannot do."""


@dataclass(frozen=True)
class Compilation:
    """A ModelCompilation's name and spec, as ``kubectl apply`` would send them."""

    name: str
    spec: dict[str, Any]

    @property
    def targets(self) -> list[str]:
        return [str(target) for target in self.spec.get("targets") or [DEFAULT_TARGET]]

    @property
    def output(self) -> str | None:
        """``spec.output`` as a reference (``repository:tag``), when the spec names one."""
        output = self.spec.get("output") or {}
        repository = str(output.get("repository") or "")
        return f"{repository}:{output.get('tag') or 'latest'}" if repository else None


@dataclass
class Compiled:
    """Every target of a compilation, packaged; and where they went, once stored."""

    name: str
    packaged: dict[str, Any]  # target -> cuvil_worker.target_pipeline.Packaged
    pushed: list[dict[str, Any]] = field(default_factory=list)  # publish()'s results
    index_digest: str | None = None
    reference: str | None = None  # the tagged index, when pushed

    def report(self, target: str) -> dict[str, Any]:
        return dict(self.packaged[target].report)


def read_compilation(path: str | Path) -> Compilation:
    """The first ModelCompilation of a YAML file."""
    try:
        documents = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    except (OSError, yaml.YAMLError) as error:
        raise CompilationSpecError(f"cannot read {path}: {error}") from None
    manifest = next(
        (d for d in documents if isinstance(d, dict) and d.get("kind") == COMPILATION_KIND), None
    )
    if manifest is None:
        raise CompilationSpecError(f"{path} holds no {COMPILATION_KIND}")
    name = str((manifest.get("metadata") or {}).get("name") or Path(path).stem)
    return Compilation(name, dict(manifest.get("spec") or {}))


def build_targets(
    compilation: Compilation,
    *,
    work_dir: Path,
    bench_iterations: int,
    on_stage: Callable[[str], None],
) -> Compiled:
    """The worker's build for every target: load, cuvil.jit, validate, benchmark, gates,
    package. Raises the worker's errors (``cuvil_worker.errors.CompileFailed`` and its kinds:
    a failed gate names its measured value and threshold)."""
    from cuvil_worker.config import WorkerConfig
    from cuvil_worker.target_pipeline import build

    config = WorkerConfig(work_dir=work_dir, bench_iterations=bench_iterations)
    fetch = _fetched_once(work_dir / "sources")
    packaged = {
        target: build(compilation.spec, target, config, on_stage, fetch)
        for target in compilation.targets
    }
    return Compiled(compilation.name, packaged)


def _fetched_once(folder: Path) -> Callable[[str], Path]:
    """The worker's source fetch (``oci`` and ``url`` bundles), once per reference for all
    targets. No allowlist here: the cluster's ``pushPolicy`` guards what its workers reach,
    and this machine is the user's own."""
    from cuvil.frontend.sources import fetch_bundle

    fetched: dict[str, Path] = {}

    def fetch(ref: str) -> Path:
        if ref not in fetched:
            fetched[ref] = fetch_bundle(ref, folder / str(len(fetched)))
        return fetched[ref]

    return fetch


def push_targets(
    compiled: Compiled,
    compilation: Compilation,
    reference: str,
    *,
    on_stage: Callable[[str], None],
    trace_id: str | None = None,
) -> Compiled:
    """Every target pushed by digest, then one index over them tagged at ``reference``
    (``REPOSITORY:TAG``, a registry or ``oci:DIR:TAG``), as the worker's tasks push them;
    signed as the worker signs them when ``CUVIL_SIGNING_KEY`` is set."""
    from cuvil_worker.target_pipeline import annotations_for, publish, push_compilation_index

    from cuvil.artifact.reference import parse_target_reference
    from cuvil.artifact.trust import Signer

    location = parse_target_reference(reference)
    if location.digest:
        raise CompilationSpecError(f"{reference}: push to a tag, not a digest")
    tag = location.tag or "latest"
    spec = dict(compilation.spec) | {"output": {"repository": location.name, "tag": tag}}
    annotations = annotations_for(f"local/{compilation.name}", trace_id)
    signer = Signer.from_env(os.environ)
    compiled.pushed = [
        publish(packaged, spec, target, on_stage, annotations, signer=signer)
        for target, packaged in compiled.packaged.items()
    ]
    on_stage("index")
    index = push_compilation_index(f"{location.name}:{tag}", compiled.pushed, annotations)
    compiled.index_digest, compiled.reference = index.digest, f"{location.name}:{tag}"
    return compiled


def write_target(compiled: Compiled, path: Path, *, directory: bool = False) -> Path:
    """The one target's artifact as a file (or a directory): every digest checked on the way."""
    from cuvil.artifact.files import decode_files, write_artifact

    if len(compiled.packaged) != 1:
        raise CompilationSpecError(
            f"{len(compiled.packaged)} targets ({', '.join(compiled.packaged)}) make one artifact "
            "each: pass --target, or -o a registry or oci: reference for an index over them"
        )
    (packaged,) = compiled.packaged.values()
    return write_artifact(decode_files(packaged.files, origin=str(path)), path, directory=directory)


def gate_lines(report: Mapping[str, Any]) -> list[str]:
    """``gate: measured <= limit`` for every gate a target passed (its report's ``gates``)."""
    return [
        f"{gate}: {entry['measured']:.4g} (limit {entry['limit']:.4g})"
        for gate, entry in (report.get("gates") or {}).items()
    ]

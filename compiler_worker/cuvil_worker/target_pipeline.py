"""One target of a compilation, start to finish:

    load -> [cuvil.jit: export, import, verify_ir, passes, codegen, plan, verify]
         -> validate (vs eager fp32 on golden inputs) -> benchmark -> gates -> package -> push

``build`` does everything up to ``package`` (all failures permanent: ``CompileFailed``);
``publish`` pushes the manifest by digest and attaches the report as a referrer (registry faults
are transient and surface as ``cuvil.artifact.RegistryError``). Nothing is pushed under the
requested tag here: only the index task tags, and only when every target succeeded.
Each stage is a span and a progress report (``on_stage``).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from cuvil.stages import COMPILE_STAGES
from cuvil_worker import checks
from cuvil_worker.config import WorkerConfig
from cuvil_worker.contract import STATE_COMPILING, STATE_PUSHING, STATE_VALIDATING
from cuvil_worker.errors import InvalidSpec, ModelNotCompilable, caused_by

if TYPE_CHECKING:
    from cuvil.artifact.trust import Signer

STAGES = ("load", *COMPILE_STAGES, "validate", "benchmark", "gates", "package", "push")
STATE_OF_STAGE = {
    **dict.fromkeys(("load", *COMPILE_STAGES[: COMPILE_STAGES.index("verify")]), STATE_COMPILING),
    **dict.fromkeys(("verify", "validate", "benchmark", "gates"), STATE_VALIDATING),
    **dict.fromkeys(("package", "push", "index"), STATE_PUSHING),
}
ANNOTATION_TRACE_ID = "dev.cuvil.trace-id"
ANNOTATION_COMPILATION = "dev.cuvil.compilation"

tracer = trace.get_tracer("cuvil.worker")
StageFn = Callable[[str], None]


@dataclass
class Packaged:
    """The artifact's files and report, kept in the work dir so a retried push skips compiling."""

    files: dict[str, bytes]
    report: dict[str, Any]

    def save(self, directory: Path) -> None:
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        (partial / "files").mkdir(parents=True)
        for name, data in self.files.items():
            (partial / "files" / name).write_bytes(data)
        (partial / "report.json").write_text(json.dumps(self.report))
        shutil.rmtree(directory, ignore_errors=True)
        partial.rename(directory)

    @classmethod
    def load(cls, directory: Path) -> Packaged | None:
        if not (directory / "report.json").is_file():
            return None
        files = {p.name: p.read_bytes() for p in sorted((directory / "files").iterdir())}
        return cls(files, json.loads((directory / "report.json").read_text()))


@contextlib.contextmanager
def stage_span(
    name: str, on_stage: StageFn, seconds: dict[str, float] | None = None
) -> Iterator[trace.Span]:
    """Report the stage, open its span (``cuvil.<stage>``), and time it into ``seconds``."""
    on_stage(name)
    started = time.perf_counter()
    with tracer.start_as_current_span(f"cuvil.{name}") as span:
        yield span
    if seconds is not None:
        seconds[name] = round(time.perf_counter() - started, 4)


def _compile(loaded: Any, target: str, precision: str, on_stage: StageFn) -> Any:
    from celery.exceptions import SoftTimeLimitExceeded

    import cuvil
    from cuvil.frontend.export import ExportError

    try:
        return cuvil.jit(
            loaded.model,
            loaded.example_inputs,
            target=target,
            precision=precision,
            dynamic_shapes=loaded.dynamic_shapes,
            name=loaded.name,
            on_stage=on_stage,
        )
    except ExportError as error:
        if caused_by(error, SoftTimeLimitExceeded):
            raise SoftTimeLimitExceeded() from None
        raise ModelNotCompilable(str(error)) from None
    except SoftTimeLimitExceeded:
        raise
    except ValueError as error:  # unsupported target or precision: the spec asks too much
        raise InvalidSpec(str(error)) from None
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as error:  # lowering refused the model: same answer on every retry
        raise ModelNotCompilable(f"{type(error).__name__}: {error}") from None


INTERPRETED_DIM_LIMIT = 16


def build(
    spec: Mapping[str, Any],
    target: str,
    config: WorkerConfig,
    on_stage: StageFn,
    bundle_fetcher: Callable[[str], Path] | None = None,
) -> Packaged:
    """Load, compile, validate, benchmark, gate and package one target."""
    from cuvil.artifact.files import encode_files
    from cuvil.frontend.sources import load_source

    seconds: dict[str, float] = {}
    with stage_span("load", on_stage, seconds):
        try:
            loaded = load_source(spec, bundle_fetcher=bundle_fetcher)
        except ValueError as error:  # SourceError, ModelSourceError: the spec names no model
            raise InvalidSpec(str(error)) from None
    precision = str(spec.get("precision") or "fp32")
    compiled = _compile(loaded, target, precision, on_stage)
    validation = dict(spec.get("validation") or {})
    # A CUDA plan run by Triton's interpreter costs ~1 ms per program instance: its samples
    # keep every dynamic dim small, or one sample at the ranges' top takes minutes.
    interpreted = compiled.backend.target.family == "cuda" and compiled.device.type == "cpu"
    largest = INTERPRETED_DIM_LIMIT if interpreted else None
    count = int(validation.get("samples", checks.DEFAULT_SAMPLES))
    samples = loaded.sample_inputs(count, largest=largest)
    report: dict[str, Any] = {"target": target, "compile": compiled.report}
    with stage_span("validate", on_stage, seconds):
        output_names = list(compiled.signature.output_names)
        report["validation"] = checks.validate(
            compiled, loaded.model, samples, output_names, validation, precision
        )
        if interpreted:
            report["validation"]["note"] = (
                f"samples drawn with each dynamic dim at most {largest}: the CUDA plan runs "
                "by interpretation on this machine"
            )
    with stage_span("benchmark", on_stage, seconds):
        if compiled.backend.speed_measured:
            report["benchmark"] = checks.benchmark(
                compiled, loaded.model, loaded.example_inputs, config.bench_iterations
            )
        else:
            report["benchmark"] = checks.not_measured(compiled.backend.verified_by)
    with stage_span("gates", on_stage, seconds):
        report["gates"] = checks.check_gates(dict(spec.get("gates") or {}), report)
    with stage_span("package", on_stage, seconds):
        contents = compiled.contents
        contents.config["report"] = dict(contents.config["report"]) | {
            "validation": report["validation"],
            "benchmark": report["benchmark"],
            "gates": report["gates"],
        }
        files = encode_files(contents)
    report["size"] = sum(len(data) for data in files.values())
    report["stage_seconds"] = seconds
    return Packaged(files, report)


def build_cached(
    spec: Mapping[str, Any],
    target: str,
    config: WorkerConfig,
    on_stage: StageFn,
    cache_key: str,
    bundle_fetcher: Callable[[str], Path] | None = None,
) -> Packaged:
    directory = config.work_dir / "packaged" / cache_key
    packaged = Packaged.load(directory)
    if packaged is None:
        packaged = build(spec, target, config, on_stage, bundle_fetcher)
        # A full scratch disk costs a recompile on retry, nothing more.
        with contextlib.suppress(OSError):
            packaged.save(directory)
    return packaged


def forget_cached(config: WorkerConfig, cache_key: str) -> None:
    shutil.rmtree(config.work_dir / "packaged" / cache_key, ignore_errors=True)


def publish(
    packaged: Packaged,
    spec: Mapping[str, Any],
    target: str,
    on_stage: StageFn,
    annotations: Mapping[str, str],
    registry_config: Any = None,
    signer: Signer | None = None,
) -> dict[str, Any]:
    """Push the artifact by digest (untagged), attach its report as a referrer and, with a
    ``signer``, sign both manifests (``registry_config``: the compilation's own push
    credentials; None: the worker's)."""
    from cuvil.artifact import attach_referrer, push_artifact
    from cuvil.artifact.media_types import REPORT

    output = spec.get("output") or {}
    repository = str(output.get("repository") or "")
    if not repository:
        raise InvalidSpec("spec.output.repository is empty")
    seconds: dict[str, float] = {}
    with stage_span("push", on_stage, seconds):
        pushed = push_artifact(
            packaged.files,
            repository,
            annotations=dict(annotations),
            registry_config=registry_config,
        )
        report_bytes = json.dumps(packaged.report, sort_keys=True).encode()
        referrer = attach_referrer(
            pushed.ref,
            report_bytes,
            media_type=REPORT,
            artifact_type=REPORT,
            annotations=dict(annotations),
            registry_config=registry_config,
        )
        if signer is not None:
            repository_ref = pushed.ref.rpartition("@")[0]
            for signed in (pushed.ref, f"{repository_ref}@{referrer}"):
                signer.sign(signed, registry_config=registry_config)
    return {
        "target": target,
        "ref": pushed.ref,
        "digest": pushed.digest,
        "size": pushed.size,
        "mediaType": pushed.media_type,
        "precision": pushed.precision,
        "reportReferrer": referrer,
        "signedBy": signer.name if signer is not None else None,
        "pushSeconds": seconds["push"],
        "report": packaged.report,
    }


def annotations_for(compilation: str, trace_id: str | None) -> dict[str, str]:
    """The annotations every manifest, referrer and index of a compilation carries:
    ``namespace/name`` (or the demo's ``demo/<model>``) and the trace that made it."""
    annotations = {ANNOTATION_COMPILATION: compilation}
    if trace_id:
        annotations[ANNOTATION_TRACE_ID] = trace_id
    return annotations


def push_compilation_index(
    reference: str,
    results: list[dict[str, Any]],
    annotations: Mapping[str, str],
    registry_config: Any = None,
) -> Any:
    """The OCI index over every target's pushed manifest (``publish``'s results), tagged at
    ``reference``: the only push under the requested tag, once every target succeeded."""
    from cuvil.artifact import PushResult, push_index

    entries = [
        PushResult(r["ref"], r["digest"], r["size"], r["mediaType"], r["target"], r["precision"])
        for r in results
    ]
    return push_index(
        reference, entries, annotations=dict(annotations), registry_config=registry_config
    )

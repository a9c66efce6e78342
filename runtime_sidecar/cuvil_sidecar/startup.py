"""Start-up checks, run on a background thread before a model may serve (initially and on every
reload): fetch the artifact, verify every file's digest while reading it, load it, warm up every
shape bucket (until the kernel choices it meets are made: then served results are bit-stable),
and compare the outputs on the artifact's golden inputs with the golden outputs
recorded at compile time; for an artifact whose speed gates were left to the node that runs it,
time the golden inputs too (``measurement.py``). Any failure raises StartupError saying which
step failed and why; the caller keeps the model not ready (first load) or keeps serving the old
one (reload).

Shape buckets: the sizes the sidecar will actually run. Each symbol takes its golden value; an
artifact may list more in ``config["shape_buckets"]`` (symbol -> size maps), and so may the
operator (``CUVIL_WARMUP_SHAPES``). Over each of these the batch symbol takes every power of two
up to the largest joined batch (and that size itself): these buckets are settled. The batch sizes
in between (up to ``PRIMED_UP_TO``) then run once each: their kernel choices are those of the
next power of two, already made, so one run only builds their oneDNN primitives (the costly
part of a shape's first call), which the first joined batch of that size would otherwise wait
for.

The kernel choices warm-up makes are kept in the tactics cache (``CUVIL_TACTICS_CACHE``), and a
later load of the same artifact on the same machine takes them instead of timing again: a
restarted sidecar runs the kernels its predecessor ran.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sympy
import torch

from cuvil.artifact import media_types as mt
from cuvil.artifact.files import ArtifactError, decode_files, read_files
from cuvil.artifact.limits import DEFAULT_LIMITS, LoadLimits
from cuvil.artifact.trust import TrustSettings, UntrustedArtifactError
from cuvil.backends.base import TargetUnavailableError
from cuvil.backends.cpu import tactics_cache
from cuvil.backends.cuda.backend import EXECUTOR_SETTING
from cuvil.dtypes import torch_dtype
from cuvil.runtime.model import CompiledModel
from cuvil.runtime.signature import InputBinder, InputError, Signature
from cuvil.shape_expr import compile_expr
from cuvil_sidecar.heap import resident_mib, trim_heap
from cuvil_sidecar.measurement import deferred_gates, measure
from cuvil_sidecar.source import ModelSource

log = logging.getLogger("cuvil_sidecar.startup")

MANIFEST_FILE = "manifest.json"  # written by cuvil.artifact's node cache beside the files


class StartupError(RuntimeError):
    """A step of start-up failed; the message names the step and the cause."""


@dataclass(frozen=True)
class LoadedModel:
    model: CompiledModel
    digest: str  # sha256 of the loaded config.json
    source_digest: str  # what the source reported before fetching (reload compares this)
    path: Path
    batch_symbol: str | None
    buckets: tuple[dict[str, int], ...]
    seconds: float
    fastest_run_ms: float  # quickest warm-up run (smallest bucket): how heavy one call is
    manifest_digest: str | None = None  # the OCI manifest served (None: a local artifact)
    index_digest: str | None = None  # the index it was picked from, when the reference named one
    deferred: Mapping[str, float] | None = None  # gates its report left to this node: limits
    measured: Mapping[str, Any] | None = None  # what warm-up measured for them (measurement.py)

    @property
    def served_digest(self) -> str:
        """What the sidecar reports it serves: the manifest digest status.artifacts[] shows,
        else (a local artifact) its config.json's."""
        return self.manifest_digest or self.digest


Progress = Callable[[str], None]


def load_checked(
    source: ModelSource,
    *,
    source_digest: str,
    max_rows: int,
    warmup_runs: int,
    golden_tolerance: float,
    progress: Progress = lambda message: None,
    warmup_shapes: tuple[Mapping[str, int], ...] = (),
    tactics_cache_dir: Path | None = None,
    limits: LoadLimits = DEFAULT_LIMITS,
    time_limit_s: float = 0.0,
    trust: TrustSettings | None = None,
    measure_runs: int = 0,
) -> LoadedModel:
    started = time.perf_counter()
    in_time = _time_keeper(started, time_limit_s)

    def step(message: str) -> None:
        in_time()
        progress(message)

    step(f"fetching {source}")
    try:
        path, manifest_digest = source.fetch_resolved(trust)
    except UntrustedArtifactError as error:
        raise StartupError(f"trust check of {source} failed: {error}") from error
    except Exception as error:
        raise StartupError(f"fetching {source} failed: {error}") from error
    step(f"verifying and loading {path}")
    try:
        files = read_files(path)
        model = CompiledModel(decode_files(files, origin=str(path), limits=limits))
    except (ArtifactError, OSError, ValueError, KeyError, TargetUnavailableError) as error:
        raise StartupError(f"loading {path} failed: {error}") from error
    digest = "sha256:" + hashlib.sha256(files[mt.CONFIG_FILE]).hexdigest()
    annotations = manifest_annotations(path)
    if annotations:
        model.config["annotations"] = annotations | dict(model.config.get("annotations") or {})
    check_device(model, path)
    cached = tactics_cache.take_cached(model, digest, tactics_cache_dir)
    symbol = batch_symbol(model.signature)
    buckets = shape_buckets(model, symbol, max_rows, warmup_shapes)
    fastest = float("inf")
    for index, bucket in enumerate(buckets, 1):
        step(f"warming up bucket {index}/{len(buckets)} {bucket}")
        inputs = bucket_inputs(model, bucket)
        try:
            for _ in range(warmup_runs):
                in_time()
                run_started = time.perf_counter()
                model.run(inputs)
                fastest = min(fastest, (time.perf_counter() - run_started) * 1e3)
            model.prepare(inputs)  # kernel choices made: served results are bit-stable
        except StartupError:
            raise
        except Exception as error:
            raise StartupError(f"warm-up at {bucket} failed: {error}") from error
    for bucket in primed_buckets(model, symbol, buckets):
        in_time()
        try:
            model.run(bucket_inputs(model, bucket))
        except Exception as error:
            raise StartupError(f"warm-up at {bucket} failed: {error}") from error
    step("checking golden outputs")
    check_golden(model, golden_tolerance)
    deferred = deferred_gates(model.report)
    measured = None
    if deferred and measure_runs:
        step(f"measuring {measure_runs} runs for the deferred gates {sorted(deferred)}")
        inputs = golden_inputs(model)
        if len(inputs) != len(model.signature.inputs):
            inputs = bucket_inputs(model, buckets[0])
        try:
            measured = measure(model.run, inputs, model.contents.golden, measure_runs)
        except Exception as error:
            raise StartupError(f"measuring the deferred gates failed: {error}") from error
    tactics_cache.keep(model, digest, tactics_cache_dir, cached)
    before = resident_mib()
    if trim_heap():  # what loading and warm-up freed goes back to the OS
        log.info("resident %.0f MiB after warm-up, %.0f MiB trimmed", before, resident_mib())
    seconds = time.perf_counter() - started
    index_digest = source_digest if manifest_digest and source_digest != manifest_digest else None
    log.info(
        "loaded %s (manifest %s%s) in %.2f s, buckets %s, fastest warm-up run %.2f ms",
        model.name,
        manifest_digest or f"none, config {digest}",
        f", index {index_digest}" if index_digest else "",
        seconds,
        buckets,
        fastest,
    )
    return LoadedModel(
        model, digest, source_digest, path, symbol, tuple(buckets), seconds, fastest,
        manifest_digest, index_digest, deferred or None, measured,
    )  # fmt: skip


def _time_keeper(started: float, limit_s: float) -> Callable[[], None]:
    """A check to call between steps: raises StartupError once ``limit_s`` has passed (0: no
    limit), so a load past the limit ends its thread instead of warming up on."""

    def in_time() -> None:
        if limit_s and time.perf_counter() - started > limit_s:
            raise StartupError(
                f"loading and warming up took longer than CUVIL_LOAD_TIMEOUT_S={limit_s:g} s"
            )

    return in_time


def check_device(model: CompiledModel, path: Path) -> None:
    """A CUDA artifact is served from a GPU: on a node without one it is refused, unless
    ``CUVIL_CUDA_EXECUTOR=interpreter`` asks for Triton's interpreter on the CPU (for checks;
    it is far too slow to serve). An artifact built for another GPU architecture was refused
    while loading, naming both."""
    if model.backend.target.family != "cuda" or model.device.type == "cuda":
        return
    if os.environ.get(EXECUTOR_SETTING) == "interpreter":
        log.warning("%s runs by Triton's interpreter on the CPU (%s)", path, EXECUTOR_SETTING)
        return
    raise StartupError(
        f"{path} targets {model.config.get('target')}: it is served from a CUDA GPU and none is "
        f"visible ({EXECUTOR_SETTING}=interpreter runs it on the CPU, for checks only)"
    )


def manifest_annotations(path: Path) -> dict[str, str]:
    """The OCI manifest's annotations, when the artifact came through the node cache (which keeps
    the verified manifest.json beside the files)."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return {}
    annotations = manifest.get("annotations") if isinstance(manifest, dict) else None
    return {str(k): str(v) for k, v in (annotations or {}).items()}


def batch_symbol(signature: Signature) -> str | None:
    """The symbol that is dim 0 of every input and output, if there is one: requests can then be
    joined along it."""
    specs = signature.inputs + signature.outputs
    firsts = {spec.shape[0] if spec.shape else None for spec in specs}
    if len(firsts) != 1:
        return None
    (first,) = firsts
    return first.name if isinstance(first, sympy.Symbol) else None


def golden_inputs(model: CompiledModel) -> dict[str, torch.Tensor]:
    golden = model.contents.golden
    return {
        spec.name: golden[f"input.{spec.name}"]
        for spec in model.signature.inputs
        if f"input.{spec.name}" in golden
    }


def shape_buckets(
    model: CompiledModel,
    symbol: str | None,
    max_rows: int,
    warmup_shapes: tuple[Mapping[str, int], ...] = (),
) -> list[dict[str, int]]:
    signature = model.signature
    inputs = golden_inputs(model)
    if len(inputs) == len(signature.inputs):
        base = InputBinder(signature).bind(inputs)
    else:
        base = {s.name: max(s.min, 1) for s in signature.symbols}
    known = {spec.name for spec in signature.symbols}
    extras = [*model.config.get("shape_buckets", []), *warmup_shapes]
    bases = [base]
    for extra in extras:
        unknown = sorted(set(map(str, dict(extra))) - known)
        if unknown:
            raise StartupError(f"warm-up shape {dict(extra)} names {unknown}; the model has "
                               f"{sorted(known)}")  # fmt: skip
        bases.append(base | {str(k): int(v) for k, v in dict(extra).items()})
    buckets = []
    for start in bases:
        buckets.append(start)
        if symbol is not None:
            spec = signature.symbol(symbol)
            top = max(1, min(max_rows, spec.max if spec.max is not None else max_rows))
            sizes = sorted({1 << k for k in range(top.bit_length()) if 1 << k <= top} | {top})
            buckets += [start | {symbol: size} for size in sizes if size >= spec.min]
    unique: list[dict[str, int]] = []
    for bucket in buckets:
        if bucket not in unique:
            unique.append(bucket)
    return unique


PRIMED_UP_TO = 16  # batch sizes past this are built on first use rather than at start-up


def primed_buckets(
    model: CompiledModel, symbol: str | None, buckets: list[dict[str, int]]
) -> list[dict[str, int]]:
    """The batch sizes up to each shape's largest settled one (and ``PRIMED_UP_TO``) that were
    not settled themselves. Each shares its kernel choices with a settled size: a choice is made
    per power-of-two bucket of rows, and every such bucket up to the largest has a settled size.
    """
    if symbol is None:
        return []
    low = model.signature.symbol(symbol).min
    settled: dict[tuple[tuple[str, int], ...], set[int]] = {}
    for bucket in buckets:
        rest = tuple(sorted((k, v) for k, v in bucket.items() if k != symbol))
        settled.setdefault(rest, set()).add(bucket[symbol])
    return [
        dict(rest) | {symbol: size}
        for rest, sizes in settled.items()
        for size in range(max(1, low), min(max(sizes), PRIMED_UP_TO) + 1)
        if size not in sizes
    ]


def bucket_inputs(model: CompiledModel, sizes: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """Inputs of the bucket's shape: golden data tiled or cut to size (so token ids and masks
    stay realistic), zeros where there is no golden input."""
    golden = golden_inputs(model)
    inputs = {}
    for spec in model.signature.inputs:
        shape = [int(compile_expr(dim)(dict(sizes))) for dim in spec.shape]
        source = golden.get(spec.name)
        if source is None or source.dim() != len(shape) or source.numel() == 0:
            inputs[spec.name] = torch.zeros(shape, dtype=torch_dtype(spec.dtype))
            continue
        tensor = source
        for axis, size in enumerate(shape):
            repeats = -(-size // tensor.shape[axis])
            if repeats > 1:
                tensor = torch.cat([tensor] * repeats, dim=axis)
            tensor = tensor.narrow(axis, 0, size)
        inputs[spec.name] = tensor.contiguous()
    return inputs


def check_golden(model: CompiledModel, tolerance: float) -> None:
    golden = model.contents.golden
    inputs = golden_inputs(model)
    if not golden or len(inputs) != len(model.signature.inputs):
        log.warning("%s has no golden inputs: start-up cannot check its outputs", model.name)
        return
    recorded = model.report.get("verification", {}).get("max_relative_to_scale") or 0.0
    allowed = max(tolerance, 4 * float(recorded))
    try:
        outputs = model.run(inputs)
    except (InputError, RuntimeError) as failure:
        raise StartupError(
            f"golden check: running the golden inputs failed: {failure}"
        ) from failure
    for name in model.signature.output_names:
        expected = golden.get(f"output.{name}")
        if expected is None:
            continue
        actual = outputs[name]
        if actual.shape != expected.shape:
            raise StartupError(
                f"golden check: output {name!r} has shape {list(actual.shape)}, "
                f"the artifact recorded {list(expected.shape)}"
            )
        difference = _relative_error(actual, expected)
        if not difference <= allowed:
            raise StartupError(
                f"golden check: output {name!r} differs from the recorded golden output by "
                f"{difference:.3g} of its scale (allowed {allowed:.3g}); refusing this artifact"
            )


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if e.numel() == 0:
        return 0.0
    scale = max(float(e.abs().max()), 1e-12)
    return float((a - e).abs().max()) / scale

"""``cuvil demo``: the main job on embedded defaults (no cluster, no Redis, no registry).

For each model: compile it through the worker's own per-target pipeline (load, cuvil.jit,
validation and benchmark against eager, gates, package, push) into a local OCI image layout
(``oci:OUT/layout:<model>``); then start one ``cuvil-sidecar`` per model with ``CUVIL_MODEL``
pointing at that reference, send requests with NVIDIA's ``tritonclient.grpc``, check every
answer against eager PyTorch, and print the fusion report, the latencies and the trace that
joins the compile spans (this process) to the serving spans (the sidecar, over OTLP).
Exits 1 when any check fails. The steps live in ``cuvil_cli.demo``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

DEFAULT_MODELS = ("cuvil.models:minilm", "cuvil.models:resnet50")
SIDECAR_ENV = {
    "CUVIL_MAX_BATCH_SIZE": "4",  # warm-up covers batches 1, 2, 4
    "OTEL_EXPORTER_OTLP_INSECURE": "true",
    "OTEL_BSP_SCHEDULE_DELAY": "100",
    "OTEL_SERVICE_NAME": "cuvil-sidecar",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="compile the bundled models through the worker pipeline, serve them, check them",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(DEFAULT_MODELS),
        metavar="SPEC",
        help="cuvil.models:NAME or a ModelCompilation YAML (default: minilm and resnet50)",
    )
    parser.add_argument("--out", type=Path, default=Path("out"), help="layout, cache and logs")
    parser.add_argument("--requests", type=int, default=20, help="ModelInfer calls per model")
    parser.add_argument(
        "--bench-iterations",
        type=int,
        default=12,
        help="the worker's benchmark: timed runs each of eager and cuvil",
    )
    parser.add_argument("--no-serve", action="store_true", help="compile and store only")
    parser.add_argument(
        "--ready-timeout", type=float, default=180.0, help="seconds a sidecar may take to be ready"
    )
    parser.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from opentelemetry import trace

    from cuvil.otlp_receiver import OtlpReceiver
    from cuvil_cli.demo import report
    from cuvil_cli.demo.compilation import demo_model
    from cuvil_cli.demo.traces import LocalSpans, render_tree

    started = time.perf_counter()
    models = [demo_model(text) for text in args.models]  # bad --models fail before any work
    _quiet_progress_bars()
    local = LocalSpans().install()
    out: Path = args.out
    layout = out / "layout"
    out.mkdir(parents=True, exist_ok=True)
    tracer = trace.get_tracer("cuvil_cli.demo")
    runs: list[report.ModelRun] = []
    roots: dict[str, Any] = {}
    receiver = None if args.no_serve else OtlpReceiver().start()
    sidecars: dict[str, Any] = {}
    try:
        for model in models:
            root = tracer.start_span(f"cuvil_cli.demo {model.name}")
            roots[model.name] = root
            run = report.ModelRun(model.name, format(root.get_span_context().trace_id, "032x"))
            runs.append(run)
            print(f"== {model.name}: compiling ({model.target})", flush=True)
            with trace.use_span(root, end_on_exit=False):
                _compile(run, model, layout, args.bench_iterations)
            if receiver is not None and run.compiled is not None:
                # Its start-up (imports, pull, warm-up) overlaps the next model's compile.
                sidecars[run.name] = _start_sidecar(run, out, receiver.endpoint)
        if receiver is not None and sidecars:
            specs = {model.name: model.spec for model in models}
            _serve(runs, sidecars, specs, roots, args, tracer)
            wanted = {run.trace_id: args.requests + 1 for run in runs if run.served}
            receiver.wait_for(
                lambda spans: all(_server_spans(spans).get(t, 0) >= n for t, n in wanted.items())
            )
    finally:
        for sidecar in sidecars.values():
            sidecar.stop()
        if receiver is not None:
            receiver.stop()
    for root in roots.values():
        if root.is_recording():
            root.end()
    spans = local.records() + (receiver.spans if receiver else [])
    for run in runs:
        _check_trace(run, spans, serve=not args.no_serve)
        print(f"== trace {run.trace_id} ({run.name})")
        print("\n".join(render_tree(spans, run.trace_id)))
    seconds = time.perf_counter() - started
    print("\n".join(report.summary_lines(runs, seconds, f"oci:{layout}", not args.no_serve)))
    return 0 if runs and all(run.ok for run in runs) else 1


def _quiet_progress_bars() -> None:
    """transformers' weight-loading bars would interleave with the report."""
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        return
    transformers_logging.disable_progress_bar()


def _compile(run: Any, model: Any, layout: Path, bench_iterations: int) -> None:
    from cuvil_worker.errors import CompileFailed

    from cuvil_cli.demo import report
    from cuvil_cli.demo.compilation import compile_to_layout

    try:
        run.compiled = compile_to_layout(
            model, layout, bench_iterations=bench_iterations, on_stage=lambda stage: None
        )
    except CompileFailed as error:  # the worker's verdict: bad model, failed check or gate
        run.failures.append(f"{type(error).__name__}: {error}")
        print(f"  FAILED: {run.failures[-1]}", flush=True)
        return
    print("\n".join(report.compile_lines(run.compiled)), flush=True)


def _start_sidecar(run: Any, out: Path, otlp_endpoint: str) -> Any:
    from cuvil_cli.demo.serving import SidecarProcess

    env = SIDECAR_ENV | {
        "CUVIL_CACHE_DIR": str((out / "cache").resolve()),
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint,
    }
    log = out / "logs" / f"sidecar-{run.name}.log"
    return SidecarProcess(run.compiled.reference, run.name, log, env)


def _serve(
    runs: list[Any],
    sidecars: dict[str, Any],
    specs: dict[str, dict[str, Any]],
    roots: dict[str, Any],
    args: Any,
    tracer: Any,
) -> None:
    """Wait until every sidecar is ready, then query them one at a time (so that no start-up
    competes with the requests being timed)."""
    from cuvil_worker import telemetry
    from opentelemetry import trace

    from cuvil.frontend.sources import load_source
    from cuvil_cli.demo import report
    from cuvil_cli.demo.serving import send_requests

    # The eager references, loaded as the worker loaded them (seeded: the same weights).
    sources = {name: load_source(specs[name]) for name in sidecars}
    ready = []
    for run in runs:
        if run.name not in sidecars:
            continue
        try:
            sidecars[run.name].wait_ready(args.ready_timeout)
            ready.append(run)
        except RuntimeError as error:
            run.failures.append(str(error).splitlines()[0])
            print(f"== {run.name}: sidecar FAILED: {error}", flush=True)
    for run in ready:
        print(f"== {run.name}: served by cuvil-sidecar from {run.compiled.reference}", flush=True)
        source = sources[run.name]
        vocab = int(getattr(getattr(source.model, "config", None), "vocab_size", 0) or 2)
        context = trace.set_span_in_context(roots[run.name])
        with tracer.start_as_current_span("cuvil_cli.demo.requests", context=context):
            run.served = send_requests(
                sidecars[run.name],
                source.model,
                source.example_inputs,
                count=args.requests,
                vocab=vocab,
                traceparent=telemetry.current_traceparent(),
            )
        roots[run.name].end()
        run.failures += run.served.failures
        print("\n".join(report.serve_lines(run.served)), flush=True)


def _server_spans(spans: list[Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for span in spans:
        if span.name.endswith("/ModelInfer"):
            counts[span.trace_id] = counts.get(span.trace_id, 0) + 1
    return counts


def _check_trace(run: Any, spans: list[Any], *, serve: bool) -> None:
    """The model's trace holds the worker's compile spans and, when served, the sidecar's."""
    mine = [span for span in spans if span.trace_id == run.trace_id]
    for span in mine:
        run.spans[span.service] = run.spans.get(span.service, 0) + 1
    names = {span.name for span in mine}
    if run.compiled is not None and not {"cuvil.compile_target", "cuvil.export"} <= names:
        run.failures.append("trace lacks the compile spans")
    if serve and run.served is not None and "cuvil.infer" not in names:
        run.failures.append("trace lacks the sidecar's serving spans")

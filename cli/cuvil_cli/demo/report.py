"""What the demo prints: per model the fusion report, validation and latency from the worker's
report, the serving figures, the trace tree, and one summary table with the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cuvil_cli.demo.compilation import Compiled
from cuvil_cli.demo.serving import Served


@dataclass
class ModelRun:
    """Everything the demo learned about one model; ``failures`` empty means every check held."""

    name: str
    trace_id: str
    compiled: Compiled | None = None
    served: Served | None = None
    spans: dict[str, int] = field(default_factory=dict)  # service -> spans in the model's trace
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if value >= 1 else f"{value * 1e3:.0f} µs"


def fusion_lines(report: dict[str, Any]) -> list[str]:
    compile_report = report["compile"]
    fusions = compile_report.get("fusions") or {}
    fired = ", ".join(f"{name}={count}" for name, count in fusions.items()) or "none"
    lines = [
        f"  ops: {compile_report['ops_before']} -> {compile_report['ops_after']} "
        f"after {len(compile_report.get('passes') or [])} passes; patterns fired: {fired}"
    ]
    for entry in compile_report.get("passes") or []:
        if entry["ops_before"] != entry["ops_after"] or entry.get("hits"):
            hits = ", ".join(f"{k}={v}" for k, v in (entry.get("hits") or {}).items())
            before, after = entry["ops_before"], entry["ops_after"]
            lines.append(f"    {entry['name']:<24} {before:>4} -> {after:<4} {hits}")
    return lines


def compile_lines(compiled: Compiled) -> list[str]:
    report = compiled.report
    worker = dict(report.get("stage_seconds") or {})
    stages = {"load": worker.pop("load", 0.0)}
    stages |= {s["name"]: s["seconds"] for s in report["compile"].get("stages") or []} | worker
    timing = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in stages.items())
    validation, bench = report["validation"], report["benchmark"]
    return [
        f"  compiled for {compiled.target} by the worker pipeline in {compiled.seconds:.1f} s "
        f"({timing})",
        f"  stored: {compiled.reference} (index {compiled.index_digest[:19]}…, "
        f"manifest {compiled.manifest_digest[:19]}…, {report.get('size', 0) / 2**20:.1f} MiB)",
        *fusion_lines(report),
        f"  validation vs eager fp32 ({validation['samples']} samples): max abs error "
        f"{validation['max_abs_error']:.2e}, {validation['max_relative_to_scale']:.2e} of scale, "
        f"min cosine {validation['min_cosine']:.6f}",
        f"  latency in process ({bench['iterations']} runs, {bench['threads']} threads): "
        f"eager p50 {_ms(bench['eager_p50_ms'])} p99 {_ms(bench['eager_p99_ms'])}; "
        f"cuvil p50 {_ms(bench['compiled_p50_ms'])} p99 {_ms(bench['compiled_p99_ms'])}; "
        f"speedup {bench['speedup']:.2f}x",
    ]


def serve_lines(served: Served) -> list[str]:
    shapes = ", ".join(f"{k} {v}" for k, v in served.input_shapes.items())
    return [
        f"  sidecar ready in {served.ready_seconds:.1f} s (pull from the layout, verify digests, "
        f"load, warm up, golden check), serving on the {served.frontend} gRPC front end",
        f"  {served.requests} tritonclient ModelInfer requests ({shapes}): sidecar p50 "
        f"{_ms(served.percentile('sidecar', 50))} p99 {_ms(served.percentile('sidecar', 99))} "
        f"(gRPC round trip); eager p50 {_ms(served.percentile('eager', 50))} "
        f"p99 {_ms(served.percentile('eager', 99))} on the same inputs",
        f"  the same requests with tensors in shared memory (Triton's system shared-memory "
        f"extension): sidecar p50 {_ms(served.percentile('shared_memory', 50))} "
        f"p99 {_ms(served.percentile('shared_memory', 99))}",
        f"  answers vs eager: max error {served.max_relative_error:.2e} of the output scale "
        f"({'ok' if served.ok else 'FAILED'})",
    ]


def summary_lines(runs: list[ModelRun], seconds: float, layout: str, serve: bool) -> list[str]:
    header = (
        f"{'model':<10} {'compile':>8} {'ops':>9} {'fused':>5} {'eager':>9} {'cuvil':>9} "
        f"{'speedup':>7} {'sidecar p50/p99':>17} {'eager':>9} {'error':>7} {'trace':>7}  check"
    )
    lines = [
        "== summary",
        f"{'':<36}{'(in process, p50)':^27}{'(served, batch 1)':^37}",
        header,
    ]
    for run in runs:
        compiled, served = run.compiled, run.served
        if compiled is None:
            lines.append(f"{run.name:<10} {'-':>8}  FAILED: {'; '.join(run.failures)}")
            continue
        report = compiled.report
        bench = report["benchmark"]
        ops = f"{report['compile']['ops_before']}->{report['compile']['ops_after']}"
        fused = sum((report["compile"].get("fusions") or {}).values())
        sidecar, eager, error = "-", "-", "-"
        if served is not None:
            sidecar = (
                f"{served.percentile('sidecar', 50):.1f}/{served.percentile('sidecar', 99):.1f} ms"
            )
            eager = f"{served.percentile('eager', 50):.1f} ms"
            error = f"{served.max_relative_error:.0e}"
        spans = "+".join(str(n) for n in run.spans.values()) or "-"
        verdict = "ok" if run.ok else "FAILED: " + "; ".join(run.failures)
        lines.append(
            f"{run.name:<10} {compiled.seconds:>6.1f} s {ops:>9} {fused:>5} "
            f"{bench['eager_p50_ms']:>6.1f} ms {bench['compiled_p50_ms']:>6.1f} ms "
            f"{bench['speedup']:>6.2f}x {sidecar:>17} {eager:>9} {error:>7} {spans:>7}  {verdict}"
        )
    lines.append(
        "fused: pattern rewrites; error: served answers vs eager, max abs / output scale; "
        "trace: spans from this process + the sidecar"
    )
    ok = all(run.ok for run in runs) and bool(runs)
    what = "served by cuvil-sidecar over gRPC, " if serve else ""
    verdict = "ok" if ok else "FAILED"
    lines.append(
        f"demo: {verdict}: {len(runs)} model(s) compiled through the worker pipeline into "
        f"{layout}, {what}checked against eager PyTorch in {seconds:.0f} s"
    )
    return lines

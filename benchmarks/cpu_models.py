"""CPU benchmark: Cuvil against eager, torch.compile, ONNX Runtime and OpenVINO, side by side.

    .venv/bin/python -m benchmarks.cpu_models --runs 50 --warmup 10 --out bench.json

For each bundled model at batch 1 (MiniLM also at batch 8), in one process and with the same
thread count, every peer is prepared (compile / export / convert, timed) and warmed up, then all
are timed interleaved, round by round, over ``--runs`` calls each (a host that slows down mid-run
slows every row alike). Prints one JSON document: per model the rows (median and p90 ms, error
against eager fp32, setup seconds), the best fp32 peer and Cuvil's ratios. A peer that fails
records its error in its row; the others go on. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.host import cpu_name
from benchmarks.peers import FP32_PEERS, PEERS, Case, Prepared, first_tensor, scratch_dir
from cuvil.models import catalog
from cuvil.models.catalog import ModelSpec


def _image(batch: int) -> Callable[[torch.Generator], dict[str, torch.Tensor]]:
    return lambda g: {"pixel_values": torch.randn(batch, 3, 224, 224, generator=g)}


def _text(batch: int, seq: int, high: int) -> Callable[[torch.Generator], dict[str, torch.Tensor]]:
    def build(g: torch.Generator) -> dict[str, torch.Tensor]:
        ids = torch.randint(1000, high, (batch, seq), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.int64)}

    return build


def _tokens(batch: int, seq: int, vocab: int) -> Callable[[torch.Generator], dict[str, Any]]:
    return lambda g: {"input_ids": torch.randint(0, vocab, (batch, seq), generator=g)}


# case name -> (catalog factory, inputs at the benchmark shape)
CASES: dict[str, tuple[str, Callable[[torch.Generator], dict[str, torch.Tensor]]]] = {
    "resnet18": ("resnet18", _image(1)),
    "resnet50": ("resnet50", _image(1)),
    "minilm_b1_s128": ("minilm", _text(1, 128, 20000)),
    "minilm_b8_s128": ("minilm", _text(8, 128, 20000)),
    "mlp": ("mlp", lambda g: {"x": torch.randn(1, 784, generator=g)}),
    "tiny_llama_s128": ("tiny_llama", _tokens(1, 128, 2048)),
}

# Cuvil's ratios: (name, numerator row, denominator row; "best_fp32_peer" is the best fp32 peer)
RATIOS = (
    ("cuvil_fp32 / best_fp32_peer", "cuvil_fp32", "best_fp32_peer"),
    ("cuvil_fp32 / torch_compile_fp32", "cuvil_fp32", "torch_compile_fp32"),
    ("cuvil_fp32 / onnxruntime", "cuvil_fp32", "onnxruntime"),
    ("cuvil_bf16 / openvino_bf16", "cuvil_bf16", "openvino_bf16"),
)


def select(names: Sequence[str], wanted: str | None, what: str) -> list[str]:
    """Comma-separated names; ``minilm`` picks every ``minilm_*``, ``cuvil`` every ``cuvil_*``."""
    if not wanted:
        return list(names)
    chosen: list[str] = []
    for item in (part.strip() for part in wanted.split(",") if part.strip()):
        matches = [n for n in names if n == item or n.startswith(item + "_")]
        if not matches:
            raise SystemExit(f"unknown {what} {item!r}; choose from {', '.join(names)}")
        chosen += [n for n in matches if n not in chosen]
    return chosen


@functools.cache
def load_spec(factory: str) -> ModelSpec:
    spec: ModelSpec = getattr(catalog, factory)()
    return spec


BURST_MS = 20.0  # one peer's turn in a round of interleaved timing
# full bursts a peer fast enough for several calls a burst gets at least, its ``--runs`` raised
# to match: its calls then come from several rounds and shuffled positions, not from one turn
# that a peer's lingering threads may all slow
MIN_TURNS = 5


def percentile(sorted_ms: list[float], q: float) -> float:
    index = min(len(sorted_ms) - 1, max(0, round(q * (len(sorted_ms) - 1))))
    return sorted_ms[index]


def warm(prepared: Prepared, warmup: int) -> float:
    """The first call (torch.compile compiles there) plus ``warmup - 1`` more; returns the median
    ms of the warm-up calls after the first, for sizing bursts."""
    prepared.call()
    times = []
    for _ in range(max(1, warmup - 1)):
        start = time.perf_counter()
        prepared.call()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def time_interleaved(
    prepared: dict[str, Prepared], warm_ms: dict[str, float], options: argparse.Namespace
) -> dict[str, list[float]]:
    """Round robin: each round times one burst of every peer in turn, so a machine that slows
    down or speeds up mid-run (shared hosts do) moves every row alike and the ratios hold.
    A burst lasts about BURST_MS (fast models run several calls per turn, so no peer's timing
    is dominated by another's cache footprint). The order is shuffled each round (seeded): a
    peer that leaves threads spinning or caches cold slows whichever row follows it, and that
    must not always be the same row. Each turn starts with one untimed call, so what is timed
    is the peer's steady state rather than its recovery from the previous peer (two consecutive
    ResNet-50 runs of ONNX Runtime, OpenVINO and Cuvil, without and with it: every median 8-12 %
    lower, Cuvil/ORT 1.21 -> 1.19; a drifting host makes that a rough comparison). Stops after
    ``runs`` calls per peer or once ``max_seconds`` times the peer count are spent (every peer
    still gets >= 1 call). A peer whose burst holds several calls times at least ``MIN_TURNS``
    full bursts (its ``runs`` raised to that), each a steady run of calls as a busy server
    makes them."""
    times: dict[str, list[float]] = {name: [] for name in prepared}
    bursts = {name: max(1, int(BURST_MS / max(warm_ms[name], 1e-3))) for name in prepared}
    wanted = {
        name: options.runs if burst == 1 else max(options.runs, MIN_TURNS * burst)
        for name, burst in bursts.items()
    }
    deadline = time.perf_counter() + options.max_seconds * max(1, len(prepared))
    names, shuffler = list(prepared), random.Random(0)
    gc.disable()
    try:
        while any(len(times[name]) < wanted[name] for name in names):
            shuffler.shuffle(names)  # no peer always follows the same one
            for name in names:
                peer = prepared[name]
                peer.call()  # untimed: each turn starts from this peer's own threads and caches
                for _ in range(min(bursts[name], wanted[name] - len(times[name]))):
                    start = time.perf_counter()
                    peer.call()
                    times[name].append((time.perf_counter() - start) * 1000.0)
            if time.perf_counter() > deadline:
                break
    finally:
        gc.enable()
    return times


def row_of(prepared: Prepared, times: list[float], reference: torch.Tensor) -> dict[str, Any]:
    """Median/p90 of the timed calls and the error of one more call against eager fp32."""
    output = prepared.output(prepared.call())
    row: dict[str, Any] = {
        "precision": prepared.precision,
        "median_ms": round(statistics.median(times), 4),
        "p90_ms": round(percentile(sorted(times), 0.9), 4),
        "runs": len(times),
        "setup_seconds": round(prepared.setup_seconds, 3),
    }
    if output.shape != reference.shape:
        row["error"] = f"output shape {list(output.shape)} != eager {list(reference.shape)}"
    else:
        max_abs = float((output - reference).abs().max())
        scale = float(reference.abs().max()) or 1.0
        row["max_abs_err"] = max_abs
        row["rel_err"] = max_abs / scale  # relative to the output's scale (max |eager|)
    row.update(prepared.info)
    return row


def summarise(rows: dict[str, dict]) -> tuple[dict | None, dict[str, float | None]]:
    """The best fp32 peer (lowest median) and Cuvil's ratios; None where a side is missing."""
    medians = {name: row["median_ms"] for name, row in rows.items() if "median_ms" in row}
    fp32 = {name: medians[name] for name in FP32_PEERS if name in medians}
    best = None
    if fp32:
        name = min(fp32, key=fp32.__getitem__)
        best = {"name": name, "median_ms": fp32[name]}
        medians["best_fp32_peer"] = fp32[name]
    ratios: dict[str, float | None] = {}
    for label, top, bottom in RATIOS:
        if top in medians and bottom in medians and medians[bottom] > 0:
            ratios[label] = round(medians[top] / medians[bottom], 4)
        else:
            ratios[label] = None
    return best, ratios


def run_case(name: str, peers: list[str], options: argparse.Namespace, workdir: Path) -> dict:
    factory, build_inputs = CASES[name]
    spec = load_spec(factory)
    inputs = build_inputs(torch.Generator().manual_seed(0))
    case = Case(name, spec, inputs, options.threads, workdir)
    with torch.inference_mode():
        reference = first_tensor(spec.model(**inputs))
    rows: dict[str, dict] = {}
    prepared: dict[str, Prepared] = {}
    warm_ms: dict[str, float] = {}
    for peer in peers:
        print(f"[{name}] preparing {peer} ...", file=sys.stderr, flush=True)
        try:
            prepared[peer] = PEERS[peer](case)
            warm_ms[peer] = warm(prepared[peer], options.warmup)
        except Exception as error:  # one failing peer must not stop the others
            prepared.pop(peer, None)
            rows[peer] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    print(f"[{name}] timing {', '.join(prepared)} interleaved ...", file=sys.stderr, flush=True)
    times = time_interleaved(prepared, warm_ms, options)
    for peer in peers:
        if peer in prepared:
            try:
                rows[peer] = row_of(prepared[peer], times[peer], reference)
            except Exception as error:
                rows[peer] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    prepared.clear()
    gc.collect()
    rows = merge_reused(rows, options.reused.get("models", {}).get(name, {}).get("rows", {}))
    best, ratios = summarise(rows)
    shapes = {key: list(tensor.shape) for key, tensor in inputs.items()}
    return {"inputs": shapes, "rows": rows, "best_fp32_peer": best, "ratios": ratios}


def merge_reused(rows: dict[str, dict], reused: dict[str, dict]) -> dict[str, dict]:
    """Rows measured now, plus those of an earlier run (``--reuse``) for peers not run now."""
    merged = {}
    for peer in PEERS:
        if peer in rows:
            merged[peer] = rows[peer]
        elif peer in reused:
            merged[peer] = {**reused[peer], "reused": True}
    return merged


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Exporters print graphs to stdout (Python and C++): keep stdout for the JSON alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def environment(options: argparse.Namespace) -> dict[str, Any]:
    versions: dict[str, str | None] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    for module in ("onnxruntime", "openvino", "onnx"):
        try:
            versions[module] = __import__(module).__version__
        except Exception:
            versions[module] = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "threads": options.threads,
        "runs": options.runs,
        "warmup": options.warmup,
        "max_seconds": options.max_seconds,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "versions": versions,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--peers", help=f"comma-separated, of: {', '.join(PEERS)}")
    parser.add_argument("--threads", type=int, default=2, help="torch/ORT/OpenVINO threads")
    parser.add_argument("--runs", type=int, default=50, help="timed runs per peer")
    parser.add_argument("--warmup", type=int, default=10, help="untimed runs first")
    parser.add_argument(
        "--max-seconds", type=float, default=120.0, help="cap on timed seconds per peer"
    )
    parser.add_argument(
        "--reuse",
        type=Path,
        help="an earlier run's JSON: its rows fill in peers not run now (marked reused)",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    options = parser.parse_args(argv)
    if options.runs < 1 or options.warmup < 0 or options.threads < 1:
        parser.error("--runs and --threads must be >= 1, --warmup >= 0")
    options.reused = json.loads(options.reuse.read_text()) if options.reuse else {}
    return options


def benchmark(options: argparse.Namespace) -> dict[str, Any]:
    models = select(list(CASES), options.models, "model")
    peers = select(list(PEERS), options.peers, "peer")
    torch.set_num_threads(options.threads)
    document: dict[str, Any] = {"environment": environment(options), "models": {}}
    if options.reuse:
        earlier = options.reused.get("environment", {})
        document["environment"]["reused"] = {
            "file": str(options.reuse),
            "date": earlier.get("date"),
        }
    with scratch_dir() as workdir:
        for name in models:
            document["models"][name] = run_case(name, peers, options, Path(workdir))
    return document


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    with stdout_to_stderr():
        document = benchmark(options)
    text = json.dumps(document, indent=2, default=str)
    print(text)
    if options.out is not None:
        options.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

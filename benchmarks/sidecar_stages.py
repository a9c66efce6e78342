"""Where a concurrency-1 ModelInfer's time goes, stage by stage, inside the sidecar and outside
it. Prints one JSON document.

    .venv/bin/python benchmarks/sidecar_stages.py --models mlp,minilm,resnet50 --calls 150

Each model's sidecar (native front end, no batching) runs in a child process started through
this module (``--serve``), which wraps the functions a ModelInfer passes through so that each
records when it starts and ends (``time.perf_counter_ns``: CLOCK_MONOTONIC, the client's clock
too). tritonclient's sync client then sends ``--calls`` requests one at a time, 2 ms apart, and
every server timestamp is matched to the call whose send and next send bracket it. Per model,
the p50 in microseconds of each stage, in the order a call passes through them:

- ``request_in``: the client builds and sends the request, gRPC C++ receives it (and, for a
  large one, cuts its tensors out: ``frontend.cc``);
- ``parse``: Python parses it on gRPC's thread;
- ``to_loop``: the wait for the event loop to take the call;
- ``to_data_plane``: the servicer, up to the request in neutral types (``from_pb``);
- ``decode``: tensors from the request and their checks;
- ``to_worker``: the batcher, and the hand-over to the model's worker thread;
- ``model``: ``CompiledModel.run``;
- ``response``: outputs encoded, metrics, the response message serialized;
- ``response_out``: gRPC C++ sends it, the client receives and parses it.

``sidecar_us`` sums the sidecar's own stages (parse to response, the model excluded) and
``transport_us`` the two outside it; ``total_us`` is the client's p50. Each stage's p50 is taken
on its own, so the parts need not add up to the total exactly. The wrapping costs ~1-2 us a
stage. After a long model run every stage runs with cold caches, which is most of their cost.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import logging
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MARKS_FILE = "SIDECAR_STAGES_FILE"  # where the serving child writes its timestamps
GAP_S = 0.002  # between calls, as a client with some work of its own
# stage -> (its start mark, its end mark); "send" and "receive" are the client's
STAGES = {
    "request_in": ("send", "on_call"),
    "parse": ("on_call", "parse_end"),
    "to_loop": ("parse_end", "begin"),
    "to_data_plane": ("begin", "decode"),
    "decode": ("decode", "decode_end"),
    "to_worker": ("decode_end", "execute"),
    "model": ("execute", "execute_end"),
    "response": ("execute_end", "finish"),
    "response_out": ("finish", "receive"),
}
OUTSIDE = ("request_in", "response_out", "model")


def _timed(record: Callable[[str], None], name: str, function: Callable[..., Any]) -> Any:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        record(name)
        try:
            return function(*args, **kwargs)
        finally:
            record(f"{name}_end")

    return wrapper


def serve() -> int:
    """The sidecar, with its ModelInfer path timestamped; the marks are written at exit."""
    from cuvil_sidecar import main

    main.set_omp_spin(logging.getLogger("cuvil_sidecar"))  # as the sidecar: before torch loads
    from cuvil_sidecar import batcher, dataplane, native_frontend

    marks: list[tuple[str, int]] = []

    def record(name: str) -> None:
        marks.append((name, time.perf_counter_ns()))  # list.append: atomic under the GIL

    frontend = native_frontend.NativeFrontend
    for owner, attribute, name in (
        (frontend, "_on_call", "on_call"),
        (frontend, "_begin", "begin"),
        (native_frontend.NativeCall, "finish", "finish"),
        (dataplane.DataPlane, "_decode", "decode"),
        (batcher.Batcher, "_execute", "execute"),
    ):
        setattr(owner, attribute, _timed(record, name, getattr(owner, attribute)))
    frontend._parse = staticmethod(_timed(record, "parse", frontend._parse))  # type: ignore[method-assign]
    atexit.register(lambda: Path(os.environ[MARKS_FILE]).write_text(json.dumps(marks)))
    return main.main([])  # its own argv (--serve) is not the sidecar's


def stages_of(calls: list[tuple[int, int]], marks: list[tuple[str, int]]) -> list[dict]:
    """Per call (send, receive), its stages in us, from the first of each mark after its send
    and before the next call's; calls whose marks are incomplete (readiness checks) are left out."""
    marks = sorted(marks, key=lambda mark: mark[1])
    found = []
    at = 0
    for index, (send, receive) in enumerate(calls):
        until = calls[index + 1][0] if index + 1 < len(calls) else receive + 10**9
        times = {"send": send, "receive": receive}
        while at < len(marks) and marks[at][1] < send:
            at += 1
        scan = at
        while scan < len(marks) and marks[scan][1] < until:
            times.setdefault(marks[scan][0], marks[scan][1])
            scan += 1
        if all(start in times and end in times for start, end in STAGES.values()):
            found.append({s: (times[e] - times[b]) / 1e3 for s, (b, e) in STAGES.items()})
            found[-1]["total"] = (receive - send) / 1e3
    return found


def measure(name: str, artifacts: Path, calls: int) -> dict[str, Any]:
    import tritonclient.grpc as syncclient
    from sidecar_load import WARMUP_SHAPES, compiled_artifact, example, infer_inputs, start_sidecar

    path = compiled_artifact(name, artifacts)
    marks_file = artifacts / f"{name}-stages.json"
    marks_file.unlink(missing_ok=True)
    os.environ[MARKS_FILE] = str(marks_file)
    process, url = start_sidecar(
        path,
        1,
        0,
        artifacts / f"{name}-stages.log",
        warmup_shapes=WARMUP_SHAPES.get(name, ""),
        command=(__file__, "--serve"),
    )
    timed: list[tuple[int, int]] = []
    try:
        client = syncclient.InferenceServerClient(url)
        items = infer_inputs(syncclient.InferInput, example(name))
        for _ in range(calls // 5):  # warm-up, not counted
            client.infer(name, items)
        for _ in range(calls):
            time.sleep(GAP_S)
            sent = time.perf_counter_ns()
            client.infer(name, items)
            timed.append((sent, time.perf_counter_ns()))
        client.close()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    rows = stages_of(timed, json.loads(marks_file.read_text()))
    if not rows:
        raise RuntimeError(f"{name}: no call had all its timestamps (see {marks_file})")
    p50 = {stage: round(statistics.median(r[stage] for r in rows), 1) for stage in rows[0]}
    own = [sum(v for s, v in r.items() if s not in (*OUTSIDE, "total")) for r in rows]
    return {
        "calls": len(rows),
        "stages_p50_us": {stage: p50[stage] for stage in STAGES},
        "sidecar_us": round(statistics.median(own), 1),
        "transport_us": round(
            statistics.median(r["request_in"] + r["response_out"] for r in rows), 1
        ),
        "model_us": p50["model"],
        "total_us": p50["total"],
    }


def main() -> int:
    if sys.argv[1:] == ["--serve"]:
        return serve()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,minilm,resnet50")
    parser.add_argument("--calls", type=int, default=150)
    parser.add_argument("--artifacts", type=Path, default=Path("/tmp/cuvil-bench-artifacts"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report: dict[str, Any] = {"cpu_count": os.cpu_count(), "load_average": os.getloadavg()}
    for name in args.models.split(","):
        report[name] = measure(name, args.artifacts, args.calls)
        print(json.dumps({name: report[name]}), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Load test of the sidecar with NVIDIA's tritonclient (aio): QPS and latency percentiles
against concurrency, dynamic batching on vs off, over gRPC and over REST (``batching_off_http``,
``batching_on_http``: the same sidecar's REST port, binary tensors), and the sidecar's overhead
over calling the compiled model in process. Prints one JSON document.

    .venv/bin/python benchmarks/sidecar_load.py --models mlp,minilm,resnet50 --duration 3

The in-process runs and every sidecar share one tactics cache (``tactics/`` beside the
artifacts), so all of them run the same kernels. Each model is compiled once per version of the
compiler's sources (kept in --artifacts, default /tmp/cuvil-bench-artifacts, named by a digest of
cuvil/**/*.py, so that an artifact compiled by older code is never measured as if it were
current), then served by a sidecar subprocess per batching mode on loopback ports. Requests are
batch 1 (MiniLM: sequence 128, warmed up through CUVIL_WARMUP_SHAPES). ``overhead_ms`` = sidecar
p50 at concurrency 1 without batching minus the in-process ``CompiledModel.run`` p50 on the same
input;
``rpc_floor_p50_ms`` is a bare ServerLive round trip through the same client, the part of the
overhead that is gRPC and the Python client rather than the sidecar's data path. The client runs on
the same machine and competes with the server for its cores, so the figures overstate the sidecar's
own cost.
``in_process_idle_p50_ms`` is the in-process p50 again with the process idle for one client round
trip before each call, as the sidecar is between requests at concurrency 1: on this host a model
called after an idle gap runs several times slower than back to back (the MLP: 95 us back to
back, 206 us after 1 ms of sleep, 550 us after 5 ms, at one thread as at two), and
``overhead_vs_idle_ms`` sets the sidecar's p50 against that. Every run is served by the first of
``--frontends`` (``CUVIL_GRPC_FRONTEND``, default native). ``sync_client`` repeats concurrency 1
unbatched with tritonclient's synchronous client (what most callers use; no event loop on the
client side) once per front end, an unbatched sidecar each, their calls interleaved with each
other and with in-process runs of the model in the benchmark's own process
(``sync_client_in_process_p50_ms``): ``p50_ms``, ``rpc_floor_p50_ms``, and ``overhead_ms``
against those in-process runs, measured in the same stretch of time (the fairest of these
figures on a noisy host); ``transport_floor_p50_ms`` is the same ModelInfer (same tensors, same
response bytes) answered by ``echo_server.py`` on the same native front end, interleaved too:
what gRPC, protobuf and tritonclient cost for a call of this size with no sidecar work at all,
and ``beyond_transport_floor_ms`` = ``p50_ms`` minus that floor minus the in-process run: what
the sidecar itself adds (decoding, dispatch to the model, encoding);
``model_floor_p50_ms`` is the same call answered by an echo server that first runs the model
itself on the same tensors (loaded from the same artifact and tactics cache), and
``beyond_model_floor_ms`` = ``p50_ms`` minus it: what the sidecar's decoding, dispatch and
encoding add to a call that has gRPC and the model's run in it anyway. A call that waits for a
model costs more than one answered at once where idle threads wake slowly and a run leaves the
caches cold (a VM's halted vCPUs; MiniLM here: ~1 ms more), which the in-process baseline
cannot show; and
``shared_memory_p50_ms`` / ``shared_memory_overhead_ms`` with every input and output in system
shared memory (Triton's extension, for a client in the same pod; each call copies the inputs
into the segment and the outputs out of it, as a caller with fresh data would, so only the
tensors' references travel through gRPC). All are measured in alternating blocks, so that
a slow phase of the host hits them alike.
``server_c1`` splits the concurrency-1 unbatched run from the sidecar's own ``/metrics``:
``request_mean_ms`` (decode, run, encode), ``compute_mean_ms`` (the model run alone, to set
against ``in_process_p50_ms``) and ``outside_ms`` = client p50 minus ``request_mean_ms``
(gRPC both ways, protobuf, the servicer and the client library).
``kserve_peer`` (``--peers kserve``, the default) is the same model run eagerly by KServe's
Python model server (kserve_peer.py), loaded after the sidecar with the same client, requests,
concurrencies and duration over gRPC and REST (``grpc``, ``http``); ``sidecar_vs_peer`` sets
each of the sidecar's runs beside it, per concurrency: ``qps_ratio`` (sidecar QPS over the
peer's), ``p50_ratio`` and ``p99_ratio`` (the peer's latency over the sidecar's), all above 1
where the sidecar is ahead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import kserve_peer
from benchmarks.oip_load import DATATYPES, free_port, infer_inputs, load, rpc_floor

REPO = Path(__file__).resolve().parents[1]
# the sizes the load sends, beyond the golden inputs' (which are sequence 16 for MiniLM): warmed
# up before the sidecar is ready, as an operator would configure it
WARMUP_SHAPES = {"minilm": "seq=128"}


def example(name: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    if name == "mlp":
        return {"x": rng.standard_normal((1, 784), dtype=np.float32)}
    if name == "minilm":
        ids = rng.integers(1000, 30000, (1, 128), dtype=np.int64)
        return {"input_ids": ids, "attention_mask": np.ones((1, 128), np.int64)}
    return {"pixel_values": rng.standard_normal((1, 3, 224, 224), dtype=np.float32)}


def compiler_digest() -> str:
    """A digest of the compiler's sources: what a cached artifact was built by."""
    digest = hashlib.sha256()
    for source in sorted((REPO / "cuvil").rglob("*.py")):
        digest.update(source.relative_to(REPO).as_posix().encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


def compiled_artifact(name: str, folder: Path) -> Path:
    path = folder / f"{name}-{compiler_digest()}.cuvil"
    if path.exists():
        return path
    import cuvil
    from cuvil.models import catalog

    spec = getattr(catalog, name)()
    model = cuvil.jit(
        spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes, name=spec.name
    )
    folder.mkdir(parents=True, exist_ok=True)
    return model.save(path)


def in_process_call(path: Path, inputs: dict[str, np.ndarray]) -> Callable[[], object]:
    """``CompiledModel.run`` on ``inputs`` in this process, warmed up, running the kernels the
    sidecars run (the same tactics cache)."""
    import torch

    from cuvil.artifact import media_types
    from cuvil.artifact.files import read_files
    from cuvil.backends.cpu import tactics_cache
    from cuvil.runtime.model import load

    model = load(path)
    digest = "sha256:" + hashlib.sha256(read_files(path)[media_types.CONFIG_FILE]).hexdigest()
    cached = tactics_cache.take_cached(model, digest, tactics_folder(path))
    tensors = {name: torch.from_numpy(array) for name, array in inputs.items()}
    model.prepare(tensors)
    tactics_cache.keep(model, digest, tactics_folder(path), cached)
    warm_until = time.perf_counter() + 1.0  # time, not runs: a fresh process starts slow here
    while time.perf_counter() < warm_until:
        model.run(tensors)
    return functools.partial(model.run, tensors)


def in_process_p50(
    path: Path, inputs: dict[str, np.ndarray], runs: int, idle_s: float = 0.0
) -> float:
    """``CompiledModel.run`` p50 back to back, or with the process idle ``idle_s`` before each
    call, as a server is between one client's requests at concurrency 1."""
    run = in_process_call(path, inputs)
    times: list[float] = []
    give_up = time.perf_counter() + 3.0  # at most ~3 s per model, at least 10 runs
    while len(times) < runs and (len(times) < 10 or time.perf_counter() < give_up):
        if idle_s:
            time.sleep(idle_s)
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def tactics_folder(artifact: Path) -> Path:
    """The tactics cache the in-process runs and every sidecar share: all run the same kernels,
    so that the overhead measured is the serving's, not a different kernel choice's (on this
    host two loads' choices can differ by a few percent of a run)."""
    return artifact.parent / "tactics"


def start_sidecar(
    path: Path,
    batch: int,
    delay_us: int,
    log: Path,
    metrics_port: int = 0,
    threads: int = 0,
    warmup_shapes: str = "",
    frontend: str = "native",
    command: Sequence[str] = ("-m", "cuvil_sidecar.main"),
    http_port: int = 0,
) -> tuple[subprocess.Popen, str]:
    """A ready sidecar and its gRPC address; with ``http_port`` its REST port there too."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("CUVIL_", "OTEL_"))}
    environ |= {
        "CUVIL_MODEL": str(path),
        "CUVIL_GRPC_HOST": "127.0.0.1",
        "CUVIL_GRPC_PORT": str(port),
        "CUVIL_METRICS_PORT": str(metrics_port),
        "CUVIL_HTTP_PORT": str(http_port),
        "CUVIL_MAX_BATCH_SIZE": str(batch),
        "CUVIL_MAX_QUEUE_DELAY_US": str(delay_us),
        "CUVIL_TORCH_THREADS": str(threads),
        "CUVIL_WARMUP_SHAPES": warmup_shapes,
        "CUVIL_GRPC_FRONTEND": frontend,
        "CUVIL_TACTICS_CACHE": str(tactics_folder(path)),
        "PYTHONPATH": os.pathsep.join([str(REPO / "runtime_sidecar"), str(REPO)]),
    }
    process = subprocess.Popen(
        [sys.executable, *command],
        env=environ,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sidecar exited: {log.read_text()[-2000:]}")
        try:
            if client.is_server_ready():
                client.close()
                return process, f"127.0.0.1:{port}"
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"sidecar not ready: {log.read_text()[-2000:]}")


SERVER_COUNTERS = (
    "nv_inference_request_success",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_compute_infer_duration_us",
)


def server_counters(metrics_port: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    values = dict.fromkeys(SERVER_COUNTERS, 0.0)
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in values:
            values[name] += float(rest.rsplit(" ", 1)[1])
    return values


def server_split(before: dict[str, float], after: dict[str, float], p50_ms: float) -> dict:
    """Mean server-side times per request between two scrapes (see the module docstring)."""
    delta = {name: after[name] - before[name] for name in SERVER_COUNTERS}
    requests = max(1.0, delta["nv_inference_request_success"])
    request_ms = delta["nv_inference_request_duration_us"] / requests / 1e3
    executions = max(1.0, delta["nv_inference_exec_count"])
    return {
        "request_mean_ms": round(request_ms, 3),
        "compute_mean_ms": round(
            delta["nv_inference_compute_infer_duration_us"] / executions / 1e3, 3
        ),
        "outside_ms": round(p50_ms - request_ms, 3),
    }


def interleaved_p50(calls: dict[str, Callable[[], object]], budget_s: float = 6.0) -> dict:
    """Median wall time in ms of each call, measured in alternating blocks of 10 so that every
    call sees the same phases of a noisy host; up to 400 runs each, fewer past the budget."""
    for call in calls.values():
        for _ in range(3):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    give_up = time.perf_counter() + budget_s
    while len(times[next(iter(calls))]) < 400 and time.perf_counter() < give_up:
        for name, call in calls.items():
            for _ in range(10):
                started = time.perf_counter()
                call()
                times[name].append((time.perf_counter() - started) * 1e3)
    return {name: round(statistics.median(values), 3) for name, values in times.items()}


def sync_client_c1(
    urls: dict[str, str],
    model: str,
    inputs: dict[str, np.ndarray],
    in_process: Callable[[], object],
    floors: dict[str, str],
) -> dict[str, dict[str, float]]:
    """Concurrency-1 p50s through the synchronous client, per front end (``urls``: front end ->
    its unbatched sidecar): ModelInfer with raw tensors, the same with every tensor in shared
    memory, and ServerLive, all interleaved across the front ends, with ``in_process`` runs of
    the same model in this process (under ``"in_process"``) and with the same ModelInfer
    answered by each ``echo_server.py`` in ``floors`` (name -> its address; under its name)."""
    import tritonclient.grpc as syncclient

    calls: dict[str, Callable[[], object]] = {"in_process/p50_ms": in_process}
    with contextlib.ExitStack() as stack:
        for floor, url in floors.items():
            echo = syncclient.InferenceServerClient(url)
            stack.callback(echo.close)
            items = infer_inputs(syncclient.InferInput, inputs)
            calls[f"{floor}/p50_ms"] = functools.partial(echo.infer, model, items)
        for frontend, url in urls.items():
            client = syncclient.InferenceServerClient(url)
            stack.callback(client.close)
            items = infer_inputs(syncclient.InferInput, inputs)
            in_shared_memory = stack.enter_context(shared_memory_infer(client, model, inputs))
            calls[f"{frontend}/p50_ms"] = functools.partial(client.infer, model, items)
            calls[f"{frontend}/shared_memory_p50_ms"] = in_shared_memory
            calls[f"{frontend}/rpc_floor_p50_ms"] = client.is_server_live
        medians = interleaved_p50(calls, budget_s=6.0 * (len(urls) + len(floors)))
    split: dict[str, dict[str, float]] = {
        frontend: {} for frontend in [*urls, "in_process", *floors]
    }
    for key, value in medians.items():
        frontend, _, name = key.partition("/")
        split[frontend][name] = value
    return split


@contextlib.contextmanager
def shared_memory_infer(
    client: Any, model: str, inputs: dict[str, np.ndarray]
) -> Iterator[Callable[[], dict[str, np.ndarray]]]:
    """A ModelInfer call with every input and output in one system shared memory segment; each
    call copies the inputs in and the outputs out, as a caller with fresh data would."""
    import tritonclient.grpc as syncclient
    from cuvil_cli.demo.shared_tensors import SharedTensors

    first = client.infer(model, infer_inputs(syncclient.InferInput, inputs))
    outputs = {o.name: first.as_numpy(o.name) for o in first.get_response().outputs}
    specs = [(name, DATATYPES[array.dtype], array) for name, array in inputs.items()]
    arrays = list(inputs.values())
    with SharedTensors(client, "bench", specs, outputs) as shared:
        for name, got in shared.infer(model, arrays).items():
            assert np.array_equal(got, outputs[name]), "the shared memory output differs from raw"
        yield lambda: shared.infer(model, arrays)


def record_response(url: str, model: str, inputs: dict[str, np.ndarray], folder: Path) -> Path:
    """The sidecar at ``url``'s serialized answer to ``inputs``, in a file for the echo server."""
    import tritonclient.grpc as syncclient

    client = syncclient.InferenceServerClient(url)
    answer = client.infer(model, infer_inputs(syncclient.InferInput, inputs))
    client.close()
    recorded = folder / f"{model}-response.bin"
    recorded.write_bytes(answer.get_response().SerializeToString())
    return recorded


def start_echo_server(
    recorded: Path, processes: list[subprocess.Popen], model: tuple[Path, Path] | None = None
) -> str:
    """``echo_server.py`` answering with ``recorded``, after running ``model`` (its artifact and
    saved inputs) when given; appended to ``processes`` (stopped with them)."""
    import tritonclient.grpc as syncclient

    port = free_port()
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "runtime_sidecar"), str(REPO)])
    script = str(REPO / "benchmarks" / "echo_server.py")
    command = [sys.executable, script, str(port), str(recorded)]
    command += [str(path) for path in model or ()]
    process = subprocess.Popen(command, env=environ)
    processes.append(process)
    echo = syncclient.InferenceServerClient(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if echo.is_server_live():
                echo.close()
                return f"127.0.0.1:{port}"
        if process.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError("echo_server.py did not start")


def compare_frontends(
    url: str,
    frontends: list[str],
    path: Path,
    name: str,
    inputs: dict[str, np.ndarray],
    args: argparse.Namespace,
) -> dict[str, dict[str, float]]:
    """``sync_client_c1`` on the running unbatched sidecar (the first front end) and one more
    unbatched sidecar for each other front end, side by side, with both echo servers."""
    urls = {frontends[0]: url}
    others = []
    try:
        for frontend in frontends[1:]:
            log = args.artifacts / f"{name}-batching_off-{frontend}.log"
            process, urls[frontend] = start_sidecar(
                path,
                1,
                args.queue_delay_us,
                log,
                0,
                args.torch_threads,
                WARMUP_SHAPES.get(name, ""),
                frontend,
            )
            others.append(process)
        recorded = record_response(urls[frontends[0]], name, inputs, args.artifacts)
        saved = args.artifacts / f"{name}-inputs.npz"
        np.savez(saved, allow_pickle=False, **inputs)
        floors = {
            "transport_floor": start_echo_server(recorded, others),
            "model_floor": start_echo_server(recorded, others, (path, saved)),
        }
        return sync_client_c1(urls, name, inputs, in_process_call(path, inputs), floors)
    finally:
        for process in others:
            process.send_signal(signal.SIGTERM)
            process.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,minilm,resnet50")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per setting")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--queue-delay-us", type=int, default=2000)
    parser.add_argument("--artifacts", type=Path, default=Path("/tmp/cuvil-bench-artifacts"))
    parser.add_argument(
        "--torch-threads", type=int, default=0, help="the sidecar's CUVIL_TORCH_THREADS (0: all)"
    )
    parser.add_argument(
        "--frontends",
        default="native,grpcio",
        help="CUVIL_GRPC_FRONTEND values: the first serves every run, all are in sync_client",
    )
    parser.add_argument(
        "--peers",
        default="kserve",
        help="peers loaded alike after the sidecar: kserve (KServe's model server), or none",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    levels = [int(c) for c in args.concurrency.split(",")]
    frontends = args.frontends.split(",")
    models: dict[str, dict[str, object]] = {}
    for name in args.models.split(","):
        path = compiled_artifact(name, args.artifacts)
        inputs = example(name)
        # Measured before and after the sidecar runs; the lower median is the baseline (on a
        # shared machine a neighbour's burst can inflate one of them many times over).
        before = in_process_p50(path, inputs, 200)
        entry: dict[str, object] = {"frontend": frontends[0]}
        for mode, batch in (("batching_off", 1), ("batching_on", args.max_batch_size)):
            log = args.artifacts / f"{name}-{mode}.log"
            metrics_port, http_port = free_port(), free_port()
            process, url = start_sidecar(
                path,
                batch,
                args.queue_delay_us,
                log,
                metrics_port,
                args.torch_threads,
                WARMUP_SHAPES.get(name, ""),
                frontends[0],
                http_port=http_port,
            )
            try:
                if mode == "batching_off":
                    entry["rpc_floor_p50_ms"] = round(asyncio.run(rpc_floor(url)), 3)
                    entry["sync_client"] = compare_frontends(
                        url, frontends, path, name, inputs, args
                    )
                rows = []
                for c in levels:
                    counted = server_counters(metrics_port)
                    rows.append(asyncio.run(load(url, name, inputs, c, args.duration)))
                    if mode == "batching_off" and c == 1:
                        now = server_counters(metrics_port)
                        entry["server_c1"] = server_split(counted, now, rows[-1]["p50_ms"])
                rest = f"127.0.0.1:{http_port}"
                entry[f"{mode}_http"] = [
                    asyncio.run(load(rest, name, inputs, c, args.duration, "http")) for c in levels
                ]
            finally:
                process.send_signal(signal.SIGTERM)
                process.wait(30)
            entry[mode] = rows
        in_process = min(before, in_process_p50(path, inputs, 200))
        entry["in_process_p50_ms"] = round(in_process, 3)
        off = entry["batching_off"]
        assert isinstance(off, list)
        entry["overhead_ms"] = round(off[0]["p50_ms"] - in_process, 3)
        by_frontend = entry["sync_client"]
        assert isinstance(by_frontend, dict)
        beside = by_frontend.pop("in_process")["p50_ms"]  # measured in the same blocks
        entry["sync_client_in_process_p50_ms"] = beside
        floor = by_frontend.pop("transport_floor")["p50_ms"]
        entry["transport_floor_p50_ms"] = floor
        model_floor = by_frontend.pop("model_floor")["p50_ms"]
        entry["model_floor_p50_ms"] = model_floor
        for sync in by_frontend.values():
            sync["overhead_ms"] = round(sync["p50_ms"] - beside, 3)
            sync["beyond_transport_floor_ms"] = round(sync["p50_ms"] - floor - beside, 3)
            sync["beyond_model_floor_ms"] = round(sync["p50_ms"] - model_floor, 3)
            sync["shared_memory_overhead_ms"] = round(sync["shared_memory_p50_ms"] - beside, 3)
        # The same runs with the client's round trip as idle time before each: what the model
        # itself costs when called as the sidecar calls it (caches and cores gone cold)
        idle = float(entry["rpc_floor_p50_ms"]) / 1e3  # type: ignore[arg-type]
        idle_p50 = in_process_p50(path, inputs, 200, idle_s=idle)
        entry["in_process_idle_p50_ms"] = round(idle_p50, 3)
        entry["overhead_vs_idle_ms"] = round(off[0]["p50_ms"] - idle_p50, 3)
        if "kserve" in args.peers.split(","):
            entry["kserve_peer"] = kserve_peer.measure(
                name,
                inputs,
                levels,
                args.duration,
                args.artifacts / f"{name}-kserve.log",
                entry,
                args.torch_threads,
            )
        models[name] = entry
        print(json.dumps({name: entry}), file=sys.stderr, flush=True)
    report = {"cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "models": models}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

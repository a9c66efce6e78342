"""The load benchmark's peer: a catalog model run eagerly by KServe's Python model server
(``kserve.Model`` + ``ModelServer``, REST and gRPC), as a KServe user serves a PyTorch model.
benchmarks/sidecar_load.py loads it with the same client, requests and concurrencies as the
sidecar and reports both side by side (``kserve_peer``).

    .venv/bin/python benchmarks/kserve_peer.py MODEL THREADS --http_port P --grpc_port Q

MODEL is a ``cuvil.models.catalog`` name (mlp, minilm, resnet50), THREADS torch's intra-op
threads (0: its default, every core, as the sidecar's CUVIL_TORCH_THREADS=0); every other
argument is the model server's own (``ModelServer`` reads them). The model's ``predict`` runs
the module under ``torch.no_grad`` on the request's tensors and answers its first output tensor
as ``output``, in binary when the request asks for binary outputs. KServe runs a synchronous
``predict`` where the request arrives (its REST event loop, a gRPC worker thread), one at a time
on REST; it has no dynamic batching of its own. Per-request latency logging is off
(``--enable_latency_logging false``), as the sidecar logs no request; its gRPC interceptor still
logs each call's method, as it always does.

Run in a process of its own: KServe's protobuf module and tritonclient's register the same
names (benchmarks/kserve_sdk.py). ``measure`` starts it (``start_peer``), loads it and sets
the figures beside the sidecar's; this module imports KServe only in the peer's own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.oip_load import free_port, load

REPO = Path(__file__).resolve().parents[1]


def measure(
    name: str,
    inputs: dict[str, np.ndarray],
    levels: list[int],
    duration_s: float,
    log: Path,
    sidecar: dict[str, Any],
    torch_threads: int = 0,
) -> dict[str, Any]:
    """The closed-loop load of ``oip_load.load`` on the peer serving ``name``, over gRPC and REST
    at each concurrency of ``levels``, and beside each of the sidecar's runs (``sidecar``: its
    rows per mode, as sidecar_load.py reports them) the ratios of ``side_by_side``."""
    grpc_port, http_port = free_port(), free_port()
    process = start_peer(name, log, grpc_port, http_port, torch_threads)
    try:
        rows = {
            protocol: [
                asyncio.run(load(f"127.0.0.1:{port}", name, inputs, c, duration_s, protocol))
                for c in levels
            ]
            for protocol, port in (("grpc", grpc_port), ("http", http_port))
        }
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    versus = {
        mode: side_by_side(sidecar[mode], rows["http" if mode.endswith("_http") else "grpc"])
        for mode in ("batching_off", "batching_on", "batching_off_http", "batching_on_http")
        if mode in sidecar
    }
    return {"grpc": rows["grpc"], "http": rows["http"], "sidecar_vs_peer": versus}


def start_peer(
    model: str, log: Path, grpc_port: int, http_port: int, torch_threads: int = 0
) -> subprocess.Popen:
    """The peer serving ``model``, ready on its ports (checked with tritonclient's gRPC
    client, which then loads it); ``torch_threads`` as the sidecar's CUVIL_TORCH_THREADS (0:
    torch's default, every core)."""
    import tritonclient.grpc as grpcclient

    command = [sys.executable, str(Path(__file__).resolve()), model, str(torch_threads)]
    command += ["--http_port", str(http_port), "--grpc_port", str(grpc_port)]
    command += ["--enable_latency_logging", "false"]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("CUVIL_", "OTEL_"))}
    environ["PYTHONPATH"] = str(REPO)
    with log.open("wb") as output:
        process = subprocess.Popen(command, env=environ, stdout=output, stderr=subprocess.STDOUT)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the KServe peer exited: {log.read_text()[-2000:]}")
            with contextlib.suppress(Exception):
                if client.is_model_ready(model):
                    return process
            time.sleep(0.2)
    finally:
        client.close()
    process.kill()
    raise RuntimeError(f"the KServe peer was not ready: {log.read_text()[-2000:]}")


def side_by_side(sidecar: list[dict], peer: list[dict]) -> list[dict[str, float]]:
    """Per concurrency: the sidecar's QPS over the peer's, and the peer's p50 and p99 over the
    sidecar's; above 1 wherever the sidecar is ahead."""
    rows = []
    for ours, theirs in zip(sidecar, peer, strict=True):
        assert ours["concurrency"] == theirs["concurrency"]
        rows.append(
            {
                "concurrency": ours["concurrency"],
                "qps_ratio": round(ours["qps"] / theirs["qps"], 2),
                "p50_ratio": round(theirs["p50_ms"] / ours["p50_ms"], 2),
                "p99_ratio": round(theirs["p99_ms"] / ours["p99_ms"], 2),
            }
        )
    return rows


def eager_model(name: str) -> Any:
    """KServe's ``Model`` running the catalog's ``name`` eagerly."""
    import numpy as np
    import torch

    from benchmarks.kserve_sdk import sdk
    from benchmarks.peers import first_tensor
    from cuvil.models import catalog

    kserve = sdk()
    module = getattr(catalog, name)().model.eval()

    class EagerModel(kserve.Model):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__(name)
            self.ready = True

        def predict(self, payload: Any, headers: Any = None) -> Any:
            tensors = {item.name: torch.from_numpy(item.as_numpy()) for item in payload.inputs}
            with torch.no_grad():
                result = np.ascontiguousarray(first_tensor(module(**tensors)).numpy())
            output = kserve.InferOutput("output", list(result.shape), "FP32")
            output.set_data_from_numpy(result, binary_data=payload.use_binary_outputs)
            return kserve.InferResponse(
                response_id=payload.id or "",
                model_name=name,
                infer_outputs=[output],
                use_binary_outputs=payload.use_binary_outputs,
            )

    return EagerModel()


def main() -> int:
    # MODEL THREADS, then the model server's own arguments (read when it is imported)
    name, threads = sys.argv.pop(1), int(sys.argv.pop(1))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if threads:
        import torch

        torch.set_num_threads(threads)
    model = eager_model(name)
    from benchmarks.kserve_sdk import sdk

    sdk().ModelServer().start([model])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The load benchmarks' client side (sidecar_load.py, sidecar_ab.py, sidecar_stages.py): NVIDIA's
tritonclient (aio) driving an Open Inference Protocol server in a closed loop over gRPC or REST,
the request inputs it sends, and a free loopback port for each server a benchmark starts. The
same code loads the sidecar and its peers (kserve_peer.py), so that they are measured alike.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def rpc_floor(url: str, calls: int = 300) -> float:
    """p50 of ServerLive, the smallest round trip through the same client and server."""
    import tritonclient.grpc.aio as aioclient

    client = aioclient.InferenceServerClient(url)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        await client.is_server_live()
        times.append((time.perf_counter() - started) * 1e3)
    await client.close()
    return statistics.median(times)


def infer_inputs(kind: Callable[..., Any], inputs: dict[str, np.ndarray]) -> list[Any]:
    """tritonclient's request inputs (``kind``: the sync or the aio ``InferInput``)."""
    items = []
    for name, array in inputs.items():
        item = kind(name, list(array.shape), DATATYPES[array.dtype])
        item.set_data_from_numpy(array)
        items.append(item)
    return items


async def load(
    url: str,
    model: str,
    inputs: dict[str, np.ndarray],
    concurrency: int,
    duration_s: float,
    protocol: str = "grpc",
) -> dict[str, float]:
    """Closed loop: ``concurrency`` callers on one aio client, each sending its next request
    when its last is answered; over REST (``protocol="http"``) with binary tensors."""
    if protocol == "http":
        import tritonclient.http.aio as aioclient
    else:
        import tritonclient.grpc.aio as aioclient

    client = aioclient.InferenceServerClient(url)
    items = infer_inputs(aioclient.InferInput, inputs)
    for _ in range(2):
        await client.infer(model, items)
    latencies: list[float] = []
    stop = time.perf_counter() + duration_s

    async def worker() -> None:
        while time.perf_counter() < stop:
            started = time.perf_counter()
            await client.infer(model, items)
            latencies.append((time.perf_counter() - started) * 1e3)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await client.close()
    ordered = sorted(latencies)

    def percentile(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {
        "concurrency": concurrency,
        "requests": len(ordered),
        "qps": round(len(ordered) / elapsed, 1),
        "p50_ms": percentile(0.50),
        "p95_ms": percentile(0.95),
        "p99_ms": percentile(0.99),
    }

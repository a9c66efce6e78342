"""Worker scaling: N queued compiles on one worker vs two, on real Redis, registry and workers.

    .venv/bin/python -m benchmarks.worker_scaling --compiles 4 --rounds 2

Starts Redis and the Debian docker-registry on loopback, two ``cuvil-worker`` processes (one
listening on both queues, one only on the parallel one), warms both up, then times N MLP
compiles sent to the one-worker queue and N sent to the two-worker queue. Prints JSON with the
wall times, their ratio against the goal (<= 0.65: two workers on two cores should nearly halve
the time) and how much CPU sat idle meanwhile.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from cuvil_worker import contract

from tests.cuvil_worker.workers import (
    compilation_request,
    idle_cpu_seconds,
    start_worker,
    wait_done,
    worker_env,
)
from tests.fixtures.redis import RedisServer, free_port
from tests.fixtures.registry import RunningRegistry


def mlp_spec(registry: RunningRegistry, queue: str) -> dict[str, Any]:
    return {
        "source": {"builtin": {"name": "mlp"}},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 784]}],
        "dynamicDims": {"batch": {"min": 1, "max": 64}},
        "targets": ["cpu-x86_64"],
        "precision": "fp32",
        "output": {"repository": f"{registry.host}/models/mlp-{uuid.uuid4().hex[:8]}", "tag": "v1"},
        "queue": queue,
    }


def timed(
    app: Any, registry: RunningRegistry, queue: str, count: int, workers: list
) -> dict[str, float]:
    requests = [compilation_request(mlp_spec(registry, queue)) for _ in range(count)]
    idle, started = idle_cpu_seconds(), time.monotonic()
    for request in requests:
        contract.submit_compilation(app, request)
    for request in requests:
        progress = wait_done(app, request, timeout=600, workers=workers)
        if progress.phase != contract.PHASE_SUCCEEDED:
            raise RuntimeError(f"compile failed: {progress.error}")
    wall = time.monotonic() - started
    return {"seconds": round(wall, 3), "idle_cores": round((idle_cpu_seconds() - idle) / wall, 3)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compiles", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="cuvil-scaling-"))
    redis = RedisServer(free_port(), root / "redis")
    (root / "redis").mkdir()
    registry = RunningRegistry(root / "registry")
    redis.start()
    registry.start()
    env = worker_env(redis.url(0), redis.url(1), root / "work")
    one = start_worker(env, root, queues="bench.seq,bench.par", name="one")
    two = start_worker(env, root, queues="bench.par", name="two")
    try:
        one.wait_ready()
        two.wait_ready()
        app = contract.create_app(redis.url(0), redis.url(1))
        timed(app, registry, "bench.par", 2, [one, two])  # one warm-up compile per worker
        rounds: list[dict[str, Any]] = []
        for _ in range(args.rounds):
            single = timed(app, registry, "bench.seq", args.compiles, [one, two])
            double = timed(app, registry, "bench.par", args.compiles, [one, two])
            ratio = round(double["seconds"] / single["seconds"], 3)
            rounds.append({"one_worker": single, "two_workers": double, "ratio": ratio})
        result = {
            "compiles": args.compiles,
            "rounds": rounds,
            "best_ratio": min(entry["ratio"] for entry in rounds),
            "goal": 0.65,
        }
        print(json.dumps(result, indent=2))
        return result
    finally:
        one.stop()
        two.stop()
        registry.stop()
        redis.stop()


if __name__ == "__main__":
    main()

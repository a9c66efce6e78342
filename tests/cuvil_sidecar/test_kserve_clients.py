"""KServe's Python SDK (PyPI ``kserve``) infers unchanged against the sidecar, on both gRPC front
ends: ``InferenceRESTClient`` over the v2 REST protocol (JSON tensors, and binary tensors with
``Inference-Header-Content-Length``) and ``InferenceGRPCClient`` over gRPC, with their readiness
calls, and errors raised as each client raises them (``httpx.HTTPStatusError`` 400,
``grpc.RpcError`` INVALID_ARGUMENT). The clients run in a process of their own
(kserve_clients.py): KServe's protobuf module and tritonclient's cannot share one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from tests.cuvil_sidecar.conftest import REPO, Sidecar, eager


def test_kserve_clients_infer(mlp_sidecar: Sidecar, mlp_spec, tmp_path: Path) -> None:
    x = np.random.default_rng(21).standard_normal((3, 784), dtype=np.float32)
    saved = tmp_path / "inputs.npz"
    np.savez(saved, x=x)
    done = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("kserve_clients.py")),
            f"http://{mlp_sidecar.http_url}",
            mlp_sidecar.url,
            "mlp",
            str(saved),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    expected = eager(mlp_spec.model, {"x": torch.from_numpy(x)}).numpy()
    rest, over_grpc = report["rest"], report["grpc"]
    for answers in (rest, over_grpc):
        assert answers["server_live"] is True and answers["server_ready"] is True
        assert answers["model_ready"] is True
    answered = {"json": rest["json"], "binary": rest["binary"], "grpc": over_grpc["infer"]}
    ids = {"json": "kserve-rest-json", "binary": "kserve-rest-binary", "grpc": "kserve-grpc"}
    for way, answer in answered.items():
        assert answer["id"] == ids[way] and answer["model_name"] == "mlp", way
        output = answer["outputs"]["output"]
        assert output["shape"] == [3, 10], way
        got = np.asarray(output["data"], dtype=np.float32)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=way)
    assert rest["wrong_shape"]["status"] == 400 and "784" in rest["wrong_shape"]["message"]
    assert over_grpc["wrong_shape"]["status"] == "INVALID_ARGUMENT"
    assert "784" in over_grpc["wrong_shape"]["message"]

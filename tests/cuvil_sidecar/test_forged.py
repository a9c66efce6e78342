"""Forged artifacts at the sidecar: on a first load, readiness answers 503 naming the op or the
expression while health keeps answering; on a hot reload, the refusal comes in under a second
and the running model keeps serving right answers."""

from __future__ import annotations

import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from tests.cuvil_sidecar.conftest import Sidecar, eager
from tests.cuvil_sidecar.test_reload import replace_atomically, wait_for_log
from tests.fixtures.forged import FORGERIES, forge


def readiness(sidecar: Sidecar) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(sidecar.metrics_url + "/v2/health/ready") as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_forgery_never_becomes_ready_and_health_keeps_answering(
    forgery: str, mlp_artifact: Path, tmp_path: Path
) -> None:
    edit, named = FORGERIES[forgery]
    forged = forge(mlp_artifact, tmp_path / f"{forgery}.cuvil", edit)
    sidecar = Sidecar(forged, tmp_path / "sidecar.log", CUVIL_GRPC_FRONTEND="grpcio")
    try:
        sidecar.wait_until(lambda: "failed" in readiness(sidecar)[1], timeout_s=120)
        status, reason = readiness(sidecar)
        assert status == 503 and named in reason, reason
        client = grpcclient.InferenceServerClient(sidecar.url)
        assert client.is_server_live() and not client.is_server_ready()
        client.close()
    finally:
        assert sidecar.stop() == 0, sidecar.log()[-3000:]


def test_the_running_model_keeps_serving_through_reloads_of_forgeries(
    mlp_artifact: Path, mlp_spec, tmp_path: Path
) -> None:
    served = tmp_path / "served.cuvil"
    shutil.copyfile(mlp_artifact, served)
    x = np.random.default_rng(3).standard_normal((2, 784), dtype=np.float32)
    expected = eager(mlp_spec.model, {"x": torch.from_numpy(x)}).numpy()
    sidecar = Sidecar(served, tmp_path / "sidecar.log", CUVIL_GRPC_FRONTEND="grpcio")
    client = grpcclient.InferenceServerClient(sidecar.url)
    item = grpcclient.InferInput("x", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    try:
        sidecar.wait_ready(client)
        for count, (forgery, (edit, named)) in enumerate(FORGERIES.items(), 1):
            replace_atomically(forge(mlp_artifact, tmp_path / f"{forgery}.cuvil", edit), served)
            signalled = time.monotonic()
            sidecar.hangup()
            wait_for_log(sidecar, "refused the new artifact", count, timeout_s=30)
            assert time.monotonic() - signalled < 1.0, sidecar.log()[-2000:]
            last = sidecar.log().strip().splitlines()[-1]
            assert re.search(re.escape(named), last), last
            assert readiness(sidecar)[0] == 200
            answer = client.infer("mlp", [item])
            assert [output.name for output in answer.get_response().outputs] == ["output"]
            np.testing.assert_allclose(answer.as_numpy("output"), expected, rtol=1e-4, atol=1e-5)
    finally:
        client.close()
        assert sidecar.stop() == 0, sidecar.log()[-3000:]


def test_a_load_past_the_time_limit_fails_readiness_with_the_reason(
    mlp_artifact: Path, tmp_path: Path
) -> None:
    sidecar = Sidecar(
        mlp_artifact,
        tmp_path / "sidecar.log",
        CUVIL_GRPC_FRONTEND="grpcio",
        CUVIL_LOAD_TIMEOUT_S="0.5",
        CUVIL_WARMUP_RUNS="100000",  # warm-up alone would take minutes
    )
    try:
        sidecar.wait_until(lambda: "LOAD_TIMEOUT" in readiness(sidecar)[1], timeout_s=120)
        status, reason = readiness(sidecar)
        assert status == 503 and "longer than CUVIL_LOAD_TIMEOUT_S=0.5 s" in reason, reason
    finally:
        assert sidecar.stop() == 0, sidecar.log()[-3000:]

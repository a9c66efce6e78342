"""CUVIL_TRUST_POLICY=require at the sidecar, with the real Debian docker-registry: a signed
push becomes ready; an unsigned one never does (readiness says why); hot reloads of the tag to
an unsigned or wrongly signed artifact are refused while the running model keeps serving, and
the same artifact signed by the trusted key then swaps in."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as grpcclient

from cuvil.artifact import push_artifact
from cuvil.artifact.signing import load_private_key
from cuvil.artifact.trust import sign_reference
from cuvil.models import catalog
from tests.cuvil_sidecar.conftest import Sidecar, eager
from tests.cuvil_sidecar.test_forged import readiness
from tests.cuvil_sidecar.test_reload import wait_for_log
from tests.fixtures.keys import make_key_pair
from tests.fixtures.registry import RunningRegistry, registry  # noqa: F401 (a fixture)


def _answer(client: grpcclient.InferenceServerClient, x: np.ndarray) -> np.ndarray:
    item = grpcclient.InferInput("x", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    return np.asarray(client.infer("mlp", [item]).as_numpy("output"))


def test_require_serves_only_what_a_trusted_key_signed(
    registry: RunningRegistry,  # noqa: F811
    mlp_artifact: Path,
    mlp_artifact_v2: Path,
    mlp_spec,
    tmp_path: Path,
) -> None:
    trusted, trusted_pub = make_key_pair(tmp_path / "keys", "trusted")
    stranger, _ = make_key_pair(tmp_path / "keys", "stranger")
    ref = f"{registry.host}/trust/mlp:v1"
    x = np.random.default_rng(2).standard_normal((2, 784), dtype=np.float32)
    old = eager(mlp_spec.model, {"x": torch.from_numpy(x)}).numpy()
    new = eager(catalog.mlp(seed=1).model, {"x": torch.from_numpy(x)}).numpy()
    environment = {
        "CUVIL_TRUST_POLICY": "require",
        "CUVIL_TRUSTED_KEYS": str(trusted_pub),
        "CUVIL_REGISTRY_CONFIG": str(tmp_path / "none.json"),
        "CUVIL_GRPC_FRONTEND": "grpcio",
    }

    push_artifact(mlp_artifact, f"{registry.host}/trust/unsigned:v1")
    refused = Sidecar(
        f"{registry.host}/trust/unsigned:v1",
        tmp_path / "refused.log",
        CUVIL_CACHE_DIR=str(tmp_path / "cache-refused"),
        **environment,
    )
    try:
        refused.wait_until(lambda: "failed" in readiness(refused)[1])
        assert "is not signed by a trusted key: it has no signature" in readiness(refused)[1]
    finally:
        assert refused.stop() == 0, refused.log()[-3000:]

    push_artifact(mlp_artifact, ref)
    sign_reference(ref, load_private_key(trusted), "cuvil-worker")
    sidecar = Sidecar(
        ref, tmp_path / "sidecar.log", CUVIL_CACHE_DIR=str(tmp_path / "c"), **environment
    )
    client = grpcclient.InferenceServerClient(sidecar.url)
    try:
        sidecar.wait_ready(client)
        np.testing.assert_allclose(_answer(client, x), old, rtol=1e-4, atol=1e-5)

        v2 = push_artifact(mlp_artifact_v2, ref).ref  # unsigned, at the served tag
        sidecar.hangup()
        wait_for_log(sidecar, "refused the new artifact", 1)
        assert "it has no signature" in sidecar.log().splitlines()[-1]
        np.testing.assert_allclose(_answer(client, x), old, rtol=1e-4, atol=1e-5)

        sign_reference(v2, load_private_key(stranger), "someone")
        sidecar.hangup()
        wait_for_log(sidecar, "refused the new artifact", 2)
        assert "no trusted key verifies it" in sidecar.log().splitlines()[-1]
        np.testing.assert_allclose(_answer(client, x), old, rtol=1e-4, atol=1e-5)

        sign_reference(v2, load_private_key(trusted), "cuvil-worker")
        sidecar.hangup()
        wait_for_log(sidecar, "serving mlp", 2)
        np.testing.assert_allclose(_answer(client, x), new, rtol=1e-4, atol=1e-5)
    finally:
        client.close()
        assert sidecar.stop() == 0, sidecar.log()[-3000:]

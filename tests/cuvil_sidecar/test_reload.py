"""Hot reload under load: while client threads keep calling, a new artifact at CUVIL_MODEL plus
SIGHUP swaps the model with zero failed requests and answers switch to the new model; a corrupt
artifact and one whose golden outputs do not hold are refused while the old model keeps
serving."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from cuvil.artifact.files import read_artifact, write_artifact
from cuvil.models import catalog
from tests.cuvil_sidecar.conftest import Sidecar, eager


def replace_atomically(source: Path, target: Path) -> None:
    staging = target.with_name(target.name + ".staging")
    shutil.copyfile(source, staging)
    os.replace(staging, target)


class ClientLoop:
    """Threads calling the model until stopped; each answer is classified old/new/wrong."""

    def __init__(self, url: str, x: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        self.url, self.x, self.old, self.new = url, x, old, new
        self.answers: list[list[str]] = [[], []]
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(2)]

    def _run(self, index: int) -> None:
        client = grpcclient.InferenceServerClient(self.url)
        item = grpcclient.InferInput("x", list(self.x.shape), "FP32")
        item.set_data_from_numpy(self.x)
        while not self._stop.is_set():
            try:
                y = client.infer("mlp", [item]).as_numpy("output")
            except Exception as error:
                self.failures.append(repr(error))
                continue
            if np.allclose(y, self.old, rtol=1e-4, atol=1e-5):
                self.answers[index].append("old")
            elif np.allclose(y, self.new, rtol=1e-4, atol=1e-5):
                self.answers[index].append("new")
            else:
                self.failures.append(f"an answer from neither model: {y[0, :3]}")
        client.close()

    def count(self, kind: str) -> int:
        return sum(answers.count(kind) for answers in self.answers)

    def wait_for(self, kind: str, more: int, timeout_s: float = 120.0) -> None:
        target = self.count(kind) + more
        deadline = time.monotonic() + timeout_s
        while self.count(kind) < target:
            assert time.monotonic() < deadline, (kind, self.count(kind), self.failures[:3])
            time.sleep(0.05)

    def __enter__(self) -> ClientLoop:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


def wait_for_log(sidecar: Sidecar, pattern: str, count: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(re.findall(pattern, sidecar.log())) < count:
        assert time.monotonic() < deadline, sidecar.log()[-3000:]
        time.sleep(0.1)


def test_hot_reload_under_load(
    mlp_artifact: Path, mlp_artifact_v2: Path, mlp_spec, tmp_path: Path
) -> None:
    served = tmp_path / "served.cuvil"
    shutil.copyfile(mlp_artifact, served)
    corrupt = tmp_path / "corrupt.cuvil"
    data = bytearray(mlp_artifact.read_bytes())  # a config that differs from the served one
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(255 - b for b in data[middle : middle + 16])
    corrupt.write_bytes(bytes(data))
    contents = read_artifact(mlp_artifact)
    contents.golden["output.output"] = contents.golden["output.output"] + 1.0
    wrong_golden = write_artifact(contents, tmp_path / "wrong-golden.cuvil")

    x = np.random.default_rng(5).standard_normal((2, 784), dtype=np.float32)
    old = eager(mlp_spec.model, {"x": torch.from_numpy(x)}).numpy()
    new = eager(catalog.mlp(seed=1).model, {"x": torch.from_numpy(x)}).numpy()
    assert not np.allclose(old, new, atol=1e-3)

    sidecar = Sidecar(served, tmp_path / "sidecar.log", CUVIL_MAX_QUEUE_DELAY_US="200")
    try:
        client = grpcclient.InferenceServerClient(sidecar.url)
        sidecar.wait_ready(client)
        first = client.get_model_metadata("mlp").versions[1]  # the digest served
        with ClientLoop(sidecar.url, x, old, new) as loop:
            loop.wait_for("old", 20)
            replace_atomically(mlp_artifact_v2, served)
            sidecar.hangup()
            loop.wait_for("new", 20)
            second = client.get_model_metadata("mlp").versions[1]
            assert second != first and client.is_model_ready("mlp", second)
            with pytest.raises(InferenceServerException, match=f"has no version '{first}'"):
                client.get_model_metadata("mlp", first)  # pinned to what no longer serves
            for bad, reason in ((corrupt, r"refused the new artifact"), (wrong_golden, "golden")):
                refused_before = len(re.findall("refused the new artifact", sidecar.log()))
                replace_atomically(bad, served)
                sidecar.hangup()
                wait_for_log(sidecar, "refused the new artifact", refused_before + 1)
                assert re.search(reason, sidecar.log())
                loop.wait_for("new", 20)
        assert loop.failures == []
        for answers in loop.answers:  # per client: old answers, then only new ones
            assert "old" not in answers[answers.index("new") :] if "new" in answers else True
        assert loop.count("old") >= 20 and loop.count("new") >= 60
        with urllib.request.urlopen(sidecar.metrics_url + "/metrics") as response:
            text = response.read().decode()
        assert 'cuvil_model_reloads{result="ok"} 2' in text
        assert 'cuvil_model_reloads{result="refused"} 2' in text
        assert (
            "nv_inference_request_failure"
            not in text.split("# TYPE nv_inference_count")[0].split(
                "# TYPE nv_inference_request_failure counter"
            )[1]
        )
    finally:
        assert sidecar.stop() == 0, sidecar.log()[-3000:]


def test_a_rewritten_model_file_moves_the_sidecar_without_failed_requests(
    mlp_artifact: Path, mlp_artifact_v2: Path, mlp_spec, tmp_path: Path
) -> None:
    """CUVIL_MODEL_FILE, as the injection webhook mounts the pod's cuvil.dev/injected
    annotation: the file names a new artifact, the poll loads it under load; a file naming a
    corrupt one is refused and the model it moved to keeps serving."""
    corrupt = tmp_path / "corrupt.cuvil"
    data = bytearray(mlp_artifact.read_bytes())  # a config that differs from the one moved to
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(255 - b for b in data[middle : middle + 16])
    corrupt.write_bytes(bytes(data))
    named = tmp_path / "serve" / "ref"  # absent at first: CUVIL_MODEL serves
    x = np.random.default_rng(7).standard_normal((2, 784), dtype=np.float32)
    old = eager(mlp_spec.model, {"x": torch.from_numpy(x)}).numpy()
    new = eager(catalog.mlp(seed=1).model, {"x": torch.from_numpy(x)}).numpy()
    sidecar = Sidecar(
        mlp_artifact, tmp_path / "sidecar.log",
        CUVIL_MODEL_FILE=str(named), CUVIL_POLL_INTERVAL_S="0.2",
    )  # fmt: skip
    try:
        sidecar.wait_ready(grpcclient.InferenceServerClient(sidecar.url))
        with ClientLoop(sidecar.url, x, old, new) as loop:
            loop.wait_for("old", 20)
            named.parent.mkdir()
            (tmp_path / "ref.staging").write_text(f"{mlp_artifact_v2}\n")
            os.replace(tmp_path / "ref.staging", named)  # as the kubelet swaps the projection
            loop.wait_for("new", 20)
            (tmp_path / "ref.staging").write_text(str(corrupt))
            os.replace(tmp_path / "ref.staging", named)
            wait_for_log(sidecar, "refused the new artifact", 1)
            loop.wait_for("new", 20)
        assert loop.failures == []
        for answers in loop.answers:
            assert "old" not in answers[answers.index("new") :] if "new" in answers else True
    finally:
        assert sidecar.stop() == 0, sidecar.log()[-3000:]

"""A generation sidecar stopped (SIGTERM) while streams run far from their ends: within the
stop's grace each stream ends with the shutdown error in the stream (a REST error event, a gRPC
``UNAVAILABLE`` answer), not a cut connection, and the process exits 0; once on each gRPC front
end, with the default grace (5 s) and a shorter ``CUVIL_EXIT_TIMEOUT_S``."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient

from tests.cuvil_sidecar.conftest import Sidecar
from tests.cuvil_sidecar.generation.checkpoints import tiny_llama_checkpoint
from tests.cuvil_sidecar.generation.clients import WAIT_S, EventStream, grpc_stream

# (the gRPC front end, CUVIL_EXIT_TIMEOUT_S, how long the stop takes at least and at most)
STOPS = [("native", None, 3.5, 15.0), ("grpcio", "1.5", 0.5, 4.0)]


@pytest.fixture(scope="module")
def ids_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-ids", tokenizer=False)


@pytest.mark.parametrize(("frontend", "exit_timeout", "least_s", "most_s"), STOPS)
def test_a_stopped_sidecar_ends_running_streams_with_a_shutdown_error(
    ids_checkpoint: Path,
    tmp_path: Path,
    frontend: str,
    exit_timeout: str | None,
    least_s: float,
    most_s: float,
) -> None:
    """SIGTERM while a REST and a gRPC stream run far from their ends: within the stop's grace
    each ends with the shutdown error in its stream (an error event; an UNAVAILABLE answer),
    not a cut connection, and the process exits 0, the streams having run most of the grace."""
    timeout = {"CUVIL_EXIT_TIMEOUT_S": exit_timeout} if exit_timeout else {}
    sidecar = Sidecar(
        ids_checkpoint, tmp_path / "sidecar.log", CUVIL_GRPC_FRONTEND=frontend,
        CUVIL_GENERATION_SLOTS="2", CUVIL_GENERATION_MAX_SEQ="16384", **timeout,
    )  # fmt: skip
    client = grpcclient.InferenceServerClient(sidecar.url)
    try:
        sidecar.wait_ready(client)
    finally:
        client.close()
    long = {"input_ids": [7, 8, 9], "parameters": {"max_tokens": 16000, "ignore_eos": True}}
    events: list[dict[str, Any]] = []
    answered = threading.Event()
    ended: dict[str, BaseException | None] = {}

    def read_events() -> None:
        events.extend(EventStream(sidecar, "tiny-ids", long))

    def read_answers() -> None:
        try:
            grpc_stream(sidecar, long, first=answered.set, model="tiny-ids")
        except BaseException as error:  # the stream's end, as the client saw it
            ended["grpc"] = error

    readers = [threading.Thread(target=read_events), threading.Thread(target=read_answers)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + WAIT_S
    while not (events and answered.is_set()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert events and answered.is_set()
    started = time.monotonic()
    code = sidecar.stop()
    took = time.monotonic() - started
    for reader in readers:
        reader.join(WAIT_S)
    assert code == 0 and least_s <= took < most_s, (code, took, sidecar.log())
    assert events[-1] == {"error": "the sidecar is stopping; the generation ended early"}
    assert all("output_ids" in event for event in events[:-1]) and len(events) < 16000
    assert "UNAVAILABLE: the sidecar is stopping" in str(ended.get("grpc")), ended

"""Clients of a sidecar serving a generation model, for the tests: Triton's generate extension
over REST (a JSON answer, or server-sent events read one by one), ModelStreamInfer through
NVIDIA's tritonclient, and the metrics page."""

from __future__ import annotations

import http.client
import json
import queue
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from tests.cuvil_sidecar.conftest import Sidecar

WAIT_S = 120.0


def post(sidecar: Sidecar, path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
    host, port = sidecar.http_url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, body=data, headers=headers or {})
    response = connection.getresponse()
    answer = json.loads(response.read() or b"null")
    connection.close()
    return response.status, answer


class EventStream:
    """POST .../generate_stream, read event by event."""

    def __init__(self, sidecar: Sidecar, model: str, body: dict[str, Any]) -> None:
        host, port = sidecar.http_url.split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
        self.connection.request("POST", f"/v2/models/{model}/generate_stream", json.dumps(body))
        self.response = self.connection.getresponse()
        assert self.response.status == 200, self.response.read()
        assert self.response.headers["Content-Type"] == "text/event-stream"

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for line in self.response:
            if line.startswith(b"data: "):
                yield json.loads(line[len(b"data: ") :])

    def close(self) -> None:
        self.connection.close()


def http_stream(
    sidecar: Sidecar, body: dict[str, Any], first: Callable[[], None] = lambda: None
) -> list[int]:
    stream = EventStream(sidecar, "tiny", body)
    tokens: list[int] = []
    try:
        for event in stream:
            tokens += event["output_ids"]
            first()
            if event["finish_reason"] is not None:
                return tokens
    finally:
        stream.close()
    raise AssertionError("the stream ended without a finish_reason")


def grpc_stream(
    sidecar: Sidecar,
    body: dict[str, Any],
    first: Callable[[], None] = lambda: None,
    model: str = "tiny",
) -> list[int]:
    """The tokens of one ``input_ids`` request over ModelStreamInfer; ``first`` is called on
    every answer."""
    ids = np.asarray(body["input_ids"], dtype=np.int64)
    item = grpcclient.InferInput("input_ids", list(ids.shape), "INT64")
    item.set_data_from_numpy(ids)
    answers = grpc_answers(sidecar, [item], body["parameters"], model=model, on_answer=first)
    return [token for answer in answers for token in answer.as_numpy("output_ids").tolist()]


def grpc_answers(
    sidecar: Sidecar,
    inputs: list[Any],
    parameters: dict[str, Any] | None = None,
    empty_final: bool = False,
    model: str = "tiny",
    on_answer: Callable[[], None] = lambda: None,
) -> list[Any]:
    """Every answer (InferResult) to one ModelStreamInfer request, up to its final one."""
    client = grpcclient.InferenceServerClient(sidecar.url)
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    answers = []
    try:
        client.async_stream_infer(
            model, inputs, parameters=parameters, enable_empty_final_response=empty_final
        )
        while True:
            result, error = results.get(timeout=WAIT_S)
            if error is not None:
                raise AssertionError(str(error))
            answers.append(result)
            on_answer()
            if result.get_response().parameters["triton_final_response"].bool_param:
                return answers
    finally:
        client.stop_stream()
        client.close()


def metric(sidecar: Sidecar, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"{sidecar.metrics_url}/metrics", timeout=WAIT_S).read()
    found = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text.decode(), re.MULTILINE)
    return float(found.group(1)) if found else 0.0

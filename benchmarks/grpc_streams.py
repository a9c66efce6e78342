"""Many generation requests over one gRPC ``ModelStreamInfer`` stream: the gRPC load generator
of ``generate_streams.py``.

Every request goes out on one bidirectional stream (as Triton's decoupled models are driven:
each request carries its ``id``, the answers come back interleaved, one per token), read by
this thread through the KServe v2 stub that ``tritonclient.grpc`` ships, and each answer is
stamped with ``time.perf_counter()`` as it is read. The raw stub, not ``tritonclient``'s
callback client: that one wraps every answer in an ``InferResult`` on a thread of its own, about
four times the client CPU per token, taken from the cores the served model shares. The answers
are those of ``sse_streams.read_streams``: per request, its tokens and the times they arrived.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

STREAM_TIMEOUT_S = 600
FINAL = "triton_final_response"


def read_streams(
    url: str, model: str, requests: list[dict[str, Any]]
) -> list[tuple[list[int], list[float]]]:
    """Send ``requests`` (``{"input_ids": [...], "parameters": {...}}``) on one stream and read
    every answer; raises on an answer carrying an error."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    tokens: list[list[int]] = [[] for _ in requests]
    times: list[list[float]] = [[] for _ in requests]
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answers = stub.ModelStreamInfer(
            iter([_message(pb, model, str(i), r) for i, r in enumerate(requests)]),
            timeout=STREAM_TIMEOUT_S,
        )
        open_requests = len(requests)
        for answer in answers:
            now = time.perf_counter()
            if answer.error_message:
                raise RuntimeError(f"a generation stream failed: {answer.error_message}")
            response = answer.infer_response
            index = int(response.id)
            if response.raw_output_contents:
                ids = np.frombuffer(response.raw_output_contents[0], dtype="<i8")
                tokens[index].extend(ids.tolist())
                times[index].extend([now] * len(ids))
            if response.parameters[FINAL].bool_param:
                open_requests -= 1
                if not open_requests:
                    answers.cancel()
                    break
    return list(zip(tokens, times, strict=True))


def _message(pb: Any, model: str, request_id: str, request: dict[str, Any]) -> Any:
    ids = np.asarray(request["input_ids"], dtype="<i8")
    message = pb.ModelInferRequest(model_name=model, id=request_id)
    message.inputs.add(name="input_ids", datatype="INT64", shape=[1, len(ids)])
    message.raw_input_contents.append(ids.tobytes())
    for key, value in request["parameters"].items():
        parameter = message.parameters[key]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, int):
            parameter.int64_param = value
        elif isinstance(value, float):
            parameter.double_param = value
        else:
            parameter.string_param = str(value)
    return message

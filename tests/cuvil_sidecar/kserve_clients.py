"""KServe's Python SDK clients, as a KServe user calls them, against a running sidecar: run by
test_kserve_clients.py in a process of its own (KServe's protobuf module and tritonclient's
register the same names, see benchmarks/kserve_sdk.py).

    python tests/cuvil_sidecar/kserve_clients.py REST_BASE_URL GRPC_ADDRESS MODEL INPUTS.npz

Every input of INPUTS.npz goes into each request (the array's name is the input's). Prints one
JSON document: per way of asking, the readiness answers, the response's id and its outputs
(name -> shape and values), and for a request with a tensor of the wrong shape the status the
client raised and its message.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import grpc
import httpx
import numpy as np

from benchmarks.kserve_sdk import sdk

DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}


def request(
    kserve: Any, model: str, arrays: dict[str, np.ndarray], request_id: str, binary: bool
) -> Any:
    inputs = []
    for name, array in arrays.items():
        item = kserve.InferInput(name, list(array.shape), DATATYPES[array.dtype])
        item.set_data_from_numpy(array, binary_data=binary)
        inputs.append(item)
    return kserve.InferRequest(model_name=model, infer_inputs=inputs, request_id=request_id)


def outputs(response: Any) -> dict[str, Any]:
    return {
        "id": response.id,
        "model_name": response.model_name,
        "outputs": {
            output.name: {"shape": list(output.shape), "data": output.as_numpy().tolist()}
            for output in response.outputs
        },
    }


def wrong_shape(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs with the first one's last dim one short."""
    name, array = next(iter(arrays.items()))
    return {**arrays, name: array[..., :-1].copy()}


async def over_rest(kserve: Any, base: str, model: str, arrays: dict[str, np.ndarray]) -> dict:
    client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", timeout=60))
    try:
        found: dict[str, Any] = {
            "server_live": await client.is_server_live(base),
            "server_ready": await client.is_server_ready(base),
            "model_ready": await client.is_model_ready(base, model),
        }
        for binary, way in ((False, "json"), (True, "binary")):
            asked = request(kserve, model, arrays, f"kserve-rest-{way}", binary)
            found[way] = outputs(await client.infer(base, asked, model_name=model))
        try:
            await client.infer(
                base, request(kserve, model, wrong_shape(arrays), "bad", False), model
            )
        except httpx.HTTPStatusError as error:
            found["wrong_shape"] = {"status": error.response.status_code, "message": str(error)}
        return found
    finally:
        await client.close()


async def over_grpc(kserve: Any, address: str, model: str, arrays: dict[str, np.ndarray]) -> dict:
    client = kserve.InferenceGRPCClient(address, timeout=60)
    try:
        found: dict[str, Any] = {
            "server_live": await client.is_server_live(),
            "server_ready": await client.is_server_ready(),
            "model_ready": await client.is_model_ready(model),
        }
        found["infer"] = outputs(
            await client.infer(request(kserve, model, arrays, "kserve-grpc", True))
        )
        try:
            await client.infer(request(kserve, model, wrong_shape(arrays), "bad", True))
        except grpc.RpcError as error:
            found["wrong_shape"] = {"status": error.code().name, "message": error.details()}
        return found
    finally:
        await client.close()


def main() -> int:
    base, address, model, saved = sys.argv[1:5]
    with np.load(saved) as archive:
        arrays = {name: archive[name] for name in archive.files}
    kserve = sdk()
    report = {
        "rest": asyncio.run(over_rest(kserve, base, model, arrays)),
        "grpc": asyncio.run(over_grpc(kserve, address, model, arrays)),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A server that answers every ModelInfer with the same recorded response, on the sidecar's own
native gRPC front end: what a call of a model's size costs through gRPC, protobuf and the
client with no decoding, no model and no encoding at all (``sidecar_load.py``'s
``transport_floor_p50_ms``).

    python benchmarks/echo_server.py PORT RESPONSE_FILE [ARTIFACT INPUTS_NPZ]

RESPONSE_FILE holds a serialized ``ModelInferResponse`` (the real sidecar's answer to the same
request). Every other method answers UNIMPLEMENTED, except ServerLive and ServerReady.

With ARTIFACT and INPUTS_NPZ (the request's tensors, saved by numpy without pickles), each
ModelInfer first runs the compiled model on those tensors, on a worker thread, and answers from
that thread as the sidecar answers after a long run (``handoff.py``): the same call with the
model's run in it but none of the sidecar's decoding and encoding (``model_floor_p50_ms``).
The run leaves the client and server threads idle and the caches cold as the sidecar's does,
which costs a call more than an instant answer on a host whose idle vCPUs wake slowly.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from cuvil_sidecar._generated import grpc_service_pb2 as pb
from cuvil_sidecar.handoff import Handoff
from cuvil_sidecar.native_frontend import Method, NativeFrontend

from benchmarks.sidecar_load import in_process_call


class Recorded:
    """A response whose bytes are already known."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # protobuf's name: the front end calls it
        return self.data


async def serve(port: int, response: bytes, model: tuple[Path, Path] | None = None) -> None:
    recorded = Recorded(response)
    # one thread loads, warms and runs the model: libgomp keeps one OpenMP pool per such thread
    worker = ThreadPoolExecutor(1, thread_name_prefix="echo-model")
    run: Callable[[], object] | None = None
    if model is not None:
        with np.load(model[1], allow_pickle=False) as saved:
            inputs = {name: saved[name] for name in saved.files}
        run = worker.submit(in_process_call, model[0], inputs).result()

    async def infer(request: Any, context: Any) -> Recorded:
        if run is not None:
            await Handoff(worker, run)
        return recorded

    async def live(request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ready(request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=True)

    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
    frontend = NativeFrontend(
        [
            Method(f"/{service}/ModelInfer", pb.ModelInferRequest, infer),
            Method(f"/{service}/ServerLive", pb.ServerLiveRequest, live),
            Method(f"/{service}/ServerReady", pb.ServerReadyRequest, ready),
        ],
        (pb.DESCRIPTOR,),
        64 * 2**20,
    )
    await frontend.start(f"127.0.0.1:{port}")
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    await stopping.wait()
    await frontend.stop(1.0)
    worker.shutdown()


def main() -> int:
    model = (Path(sys.argv[3]), Path(sys.argv[4])) if len(sys.argv) > 4 else None
    asyncio.run(serve(int(sys.argv[1]), Path(sys.argv[2]).read_bytes(), model))
    return 0


if __name__ == "__main__":
    sys.exit(main())

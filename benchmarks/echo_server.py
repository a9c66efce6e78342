"""A server that answers every ModelInfer with the same recorded response, on the sidecar's own
native gRPC front end: what a call of a model's size costs through gRPC, protobuf and the
client with no decoding, no model and no encoding at all (``sidecar_load.py``'s
``transport_floor_p50_ms``).

    python benchmarks/echo_server.py PORT RESPONSE_FILE

RESPONSE_FILE holds a serialized ``ModelInferResponse`` (the real sidecar's answer to the same
request). Every other method answers UNIMPLEMENTED, except ServerLive and ServerReady.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from cuvil_sidecar._generated import grpc_service_pb2 as pb
from cuvil_sidecar.native_frontend import Method, NativeFrontend


class Recorded:
    """A response whose bytes are already known."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # protobuf's name: the front end calls it
        return self.data


async def serve(port: int, response: bytes) -> None:
    recorded = Recorded(response)

    async def infer(request: Any, context: Any) -> Recorded:
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


def main() -> int:
    asyncio.run(serve(int(sys.argv[1]), Path(sys.argv[2]).read_bytes()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Client side of Triton's system shared-memory extension, for the demo and the load benchmark:
one POSIX shared memory segment holding a request's inputs and outputs, registered with a
sidecar, and the tritonclient inputs and requested outputs that point into it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import Any

import numpy as np


class SharedTensors:
    """``inputs``: (name, protocol datatype, an array of the shape and dtype sent);
    ``outputs``: name -> an array of the shape and dtype expected. A context manager: on exit
    the region is unregistered and the segment freed."""

    def __init__(
        self,
        client: Any,
        region: str,
        inputs: Sequence[tuple[str, str, np.ndarray]],
        outputs: dict[str, np.ndarray],
    ) -> None:
        import tritonclient.grpc as grpcclient

        sizes = [array.nbytes for *_, array in inputs] + [a.nbytes for a in outputs.values()]
        self.segment = shared_memory.SharedMemory(create=True, size=max(1, sum(sizes)))
        self.client, self.region = client, region
        client.register_system_shared_memory(region, "/" + self.segment.name, self.segment.size)
        offset = 0
        self.items, self._sources = [], []
        for name, datatype, array in inputs:
            item = grpcclient.InferInput(name, list(array.shape), datatype)
            item.set_shared_memory(region, array.nbytes, offset)
            self.items.append(item)
            self._sources.append(self._view(array, offset))
            offset += array.nbytes
        self.wanted, self._targets = [], {}
        for name, array in outputs.items():
            output = grpcclient.InferRequestedOutput(name)
            output.set_shared_memory(region, array.nbytes, offset)
            self.wanted.append(output)
            self._targets[name] = self._view(array, offset)
            offset += array.nbytes

    def _view(self, like: np.ndarray, offset: int) -> np.ndarray:
        return np.ndarray(like.shape, like.dtype, buffer=self.segment.buf, offset=offset)

    def infer(self, model: str, arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """Copy ``arrays`` (in the order of ``inputs``) in, run, copy the outputs out."""
        for view, array in zip(self._sources, arrays, strict=True):
            np.copyto(view, array)
        self.client.infer(model, self.items, outputs=self.wanted)
        return {name: view.copy() for name, view in self._targets.items()}

    def close(self) -> None:
        self._sources.clear()  # views into the segment: gone before it closes
        self._targets.clear()
        self.client.unregister_system_shared_memory(self.region)
        with contextlib.suppress(BufferError):  # a view still held after a failure
            self.segment.close()
        self.segment.unlink()

    def __enter__(self) -> SharedTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""A model that passed start-up, as the data plane serves it: the compiled model, its checks and
metadata in protocol terms, its batcher, and a count of requests in flight so that a model
replaced by a reload finishes them before it is closed.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from cuvil.runtime.signature import InputBinder
from cuvil_sidecar.batcher import Batcher
from cuvil_sidecar.codec import datatype_of
from cuvil_sidecar.config import SidecarConfig
from cuvil_sidecar.messages import ModelMetadata, TensorMetadata
from cuvil_sidecar.metrics import Metrics
from cuvil_sidecar.startup import LoadedModel
from cuvil_sidecar.tracing import compile_links

log = logging.getLogger("cuvil_sidecar.servable")

VERSION = "1"  # one version is served at a time; a reload replaces it in place
RETIRE_POLL_S = 0.005  # how often a replaced model looks whether its last call has ended


class ServedModel:
    def __init__(self, loaded: LoadedModel, config: SidecarConfig, metrics: Metrics) -> None:
        model = loaded.model
        self.loaded = loaded
        self.model = model
        self.name = config.model_name or model.name
        self.version = VERSION
        self.digest = loaded.served_digest
        self.index_digest = loaded.index_digest
        # The names the served version answers to: "1", the manifest digest it serves (what
        # status.artifacts[] shows; a local artifact's config digest) and the index digest when
        # the reference resolved one. ModelMetadata lists them, as Triton lists a model's
        # versions, so a client sees which artifact answers; a request may name any of them
        # (model_version=sha256:... is refused once a reload serves another digest).
        digests = (self.digest, self.index_digest) if self.index_digest else (self.digest,)
        self.versions: tuple[str, ...] = (self.version, *digests)
        self.signature = model.signature
        self.binder = InputBinder(model.signature)
        self.input_datatypes = {s.name: datatype_of(s.dtype) for s in model.signature.inputs}
        self.output_names = model.signature.output_names
        self.batch_symbol = loaded.batch_symbol
        self.links = compile_links(model.config)
        self.max_message_bytes = config.max_message_bytes
        max_rows = 1
        if config.batching and loaded.batch_symbol is not None:
            # A joined batch must still fit the model's own bound on the batch dim.
            bound = model.signature.symbol(loaded.batch_symbol).max
            max_rows = min(config.max_batch_size, bound if bound is not None else 2**31)
        self.batcher = Batcher(
            model.run,
            max_rows=max_rows,
            max_delay_s=config.max_queue_delay_us / 1e6,
            instances=config.model_instances,
            on_execute=self._count_execution,
            name=self.name,
            in_flight=None if config.lone_requests_wait else lambda: self.in_flight,
            max_queue=config.max_queue_size,
            queue_timeout_s=config.queue_timeout_us / 1e6,
            on_reject=lambda reason: metrics.rejected(self.name, self.version, reason),
        )
        self._metrics = metrics
        self.in_flight = 0
        self._in_flight_lock = threading.Lock()  # a call may end on a worker (handoff.py)

    @property
    def source_digest(self) -> str:
        """What the source reported before this model was fetched (a reload compares it)."""
        return self.loaded.source_digest

    @property
    def mode(self) -> str:
        return self.batcher.mode

    def _count_execution(self, requests: int, rows: int) -> None:
        self._metrics.add("nv_inference_exec_count", self.name, self.version)
        self._metrics.add("nv_inference_count", self.name, self.version, rows)

    def metadata(self) -> ModelMetadata:
        def tensors(specs: tuple) -> tuple[TensorMetadata, ...]:
            return tuple(
                TensorMetadata(
                    spec.name,
                    datatype_of(spec.dtype),
                    tuple(int(dim) if dim.is_Integer else -1 for dim in spec.shape),
                )
                for spec in specs
            )

        return ModelMetadata(
            name=self.name,
            versions=self.versions,
            platform=f"cuvil_{self.model.config.get('target', 'cpu')}",
            inputs=tensors(self.signature.inputs),
            outputs=tensors(self.signature.outputs),
        )

    def acquire(self) -> ServedModel:
        with self._in_flight_lock:
            self.in_flight += 1
        return self

    def release(self) -> None:
        """On the event loop, or on the worker thread a call ended on: nothing here may wake the
        loop (that would cost every call a turn of it, for the rare retirement)."""
        with self._in_flight_lock:
            self.in_flight -= 1

    async def retire(self, grace_s: float | None = None) -> None:
        """Let in-flight requests finish, then stop the batcher and its threads (``grace_s``
        is a generation model's: a call here ends within the front ends' own grace)."""
        while self.in_flight:
            await asyncio.sleep(RETIRE_POLL_S)
        await self.batcher.close()
        log.info("retired %s %s", self.name, self.digest)

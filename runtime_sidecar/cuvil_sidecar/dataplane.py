"""The data plane: what each Open Inference Protocol call means, in neutral types.

The servicer only converts protobuf to and from ``messages`` and maps errors to status codes;
everything a request can get wrong is caught here (or in ``codec``) and raised as a
``SidecarError`` whose message names the input and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Hashable

import torch

from cuvil import __version__ as CUVIL_VERSION
from cuvil.runtime.signature import InputError
from cuvil_sidecar import tracing
from cuvil_sidecar.codec import DATATYPES, decode_input, encode_output, write_output
from cuvil_sidecar.config import SidecarConfig
from cuvil_sidecar.errors import InvalidInput, NotSupported, SidecarError
from cuvil_sidecar.generation.requests import GenerateRequest
from cuvil_sidecar.generation.servable import GenerationServable, GenerationStream
from cuvil_sidecar.manager import ModelManager
from cuvil_sidecar.messages import (
    InferInput,
    InferRequest,
    InferResponse,
    ModelMetadata,
    ServerMetadata,
)
from cuvil_sidecar.metrics import Metrics
from cuvil_sidecar.repository import (
    IndexEntry,
    ModelConfig,
    ModelStatistics,
    model_config,
    model_statistics,
    repository_index,
)
from cuvil_sidecar.servable import ServedModel
from cuvil_sidecar.shared_memory import BYTE_SIZE, Region, SharedMemoryRegistry

SERVER_NAME = "cuvil"


class DataPlane:
    def __init__(self, manager: ModelManager, metrics: Metrics, config: SidecarConfig) -> None:
        self.manager = manager
        self.metrics = metrics
        self.config = config
        self.shared_memory = SharedMemoryRegistry() if config.shared_memory else None

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.manager.ready

    def server_metadata(self) -> ServerMetadata:
        extensions = ("system_shared_memory",) if self.shared_memory is not None else ()
        return ServerMetadata(SERVER_NAME, CUVIL_VERSION, extensions)

    def register_shared_memory(
        self, name: str, key: str, offset: int, byte_size: int, owner: int | None = None
    ) -> None:
        self._registry().register(name, key, offset, byte_size, owner)

    def unregister_shared_memory(self, name: str) -> None:
        self._registry().unregister(name)

    def shared_memory_status(self, name: str) -> list[Region]:
        return self._registry().status(name)

    def close(self) -> None:
        if self.shared_memory is not None:
            self.shared_memory.close()

    def _registry(self) -> SharedMemoryRegistry:
        if self.shared_memory is None:
            raise NotSupported("system shared memory is turned off here (CUVIL_SHARED_MEMORY=off)")
        return self.shared_memory

    def model_ready(self, name: str, version: str) -> bool:
        try:
            model = self.manager.acquire(name, version)
        except SidecarError:
            if self.manager.ready:
                raise  # a name or version this sidecar does not serve
            return False
        model.release()
        return True

    def model_metadata(self, name: str, version: str) -> ModelMetadata:
        model = self.manager.acquire(name, version)
        try:
            return model.metadata()
        finally:
            model.release()

    def model_config(self, name: str, version: str) -> ModelConfig:
        model = self.manager.acquire(name, version)
        try:
            return model_config(model, self.config)
        finally:
            model.release()

    def model_statistics(self, name: str, version: str) -> list[ModelStatistics]:
        """Every model's statistics (one here) when ``name`` is empty, else that model's."""
        current = self.manager.current
        if not name:
            if current is None:
                return []
            name = current.name
        model = self.manager.acquire(name, version)
        try:
            return [model_statistics(model, self.metrics)]
        finally:
            model.release()

    def repository_index(self, ready_only: bool) -> list[IndexEntry]:
        return repository_index(
            self.manager.current, self.config, self.manager.reason, ready_only=ready_only
        )

    def load_model(self, name: str) -> None:
        raise NotSupported(
            f"loading models by request is not supported: this sidecar serves the one artifact "
            f"CUVIL_MODEL names ({self.manager.source}); it reloads on SIGHUP or by polling "
            "(CUVIL_POLL_INTERVAL_S)"
        )

    def unload_model(self, name: str) -> None:
        raise NotSupported(
            "unloading models by request is not supported: stop the sidecar to stop serving"
        )

    async def infer(
        self,
        request: InferRequest,
        deadline_ns: int | None = None,
        client_gone: Callable[[], bool] | None = None,
    ) -> InferResponse:
        """One inference; ``deadline_ns`` is when the client stops waiting (epoch ns), and
        ``client_gone`` says whether it has stopped already (asked before the request runs)."""
        model = self.manager.acquire(request.model_name, request.model_version)
        started = time.time_ns()
        try:
            if isinstance(model, GenerationServable):
                raise NotSupported(
                    f"model {model.name!r} generates tokens (a decoupled model): use "
                    "ModelStreamInfer over gRPC, or POST .../generate or .../generate_stream"
                )
            with tracing.infer_span(model.name, model.digest, model.links):
                response = await self._infer(model, request, deadline_ns, client_gone)
        except Exception:
            took_us = (time.time_ns() - started) / 1e3
            self.metrics.request_failed(model.name, model.version, request_us=took_us)
            raise
        finally:
            model.release()
        return response

    def is_generation(self, name: str) -> bool:
        """Whether ``name`` is served by a generation model (streams answer per token)."""
        current = self.manager.current
        return isinstance(current, GenerationServable) and current.name == name

    def open_generation(
        self, name: str, version: str, read: Callable[[GenerationServable], GenerateRequest]
    ) -> GenerationStream:
        """Start a generation: ``read`` turns the request into a ``GenerateRequest`` for the
        model (raising ``InvalidInput``); a refusal is raised here, before any answer. The
        stream holds the model until it ends; ``close`` it when the client goes away."""
        model = self.manager.acquire(name, version)
        try:
            if not isinstance(model, GenerationServable):
                raise NotSupported(
                    f"model {model.name!r} is not a generation model: use ModelInfer or .../infer"
                )
            return model.open(read(model))
        except Exception:
            self.metrics.add("nv_inference_request_failure", model.name, model.version)
            model.release()
            raise

    def count_failure(self, name: str, started_ns: int) -> None:
        """A request that failed before it reached ``infer`` (unparseable contents), begun at
        ``started_ns`` (epoch ns)."""
        current = self.manager.current
        if current is not None and current.name == name:
            took_us = (time.time_ns() - started_ns) / 1e3
            self.metrics.request_failed(current.name, current.version, request_us=took_us)

    async def _infer(
        self,
        model: ServedModel,
        request: InferRequest,
        deadline_ns: int | None,
        client_gone: Callable[[], bool] | None,
    ) -> InferResponse:
        started = time.time_ns()
        inputs = self._decode(model, request)
        wanted = request.outputs or model.output_names
        unknown = sorted(set(wanted) - set(model.output_names))
        if unknown:
            raise InvalidInput(
                f"unknown requested output(s) {unknown}; the model has {list(model.output_names)}"
            )
        # resolved before the run, so that a bad reference costs no model run
        targets = {
            name: self._registry().view(ref, name) for name, ref in request.shared_outputs.items()
        }
        rows = 1
        key: Hashable = None
        if model.batch_symbol is not None:
            first = next(iter(inputs.values()))
            rows = int(first.shape[0])
            key = tuple((name, tuple(t.shape[1:])) for name, t in sorted(inputs.items()))
        result = await model.batcher.submit(
            inputs, rows=rows, key=key, deadline_ns=deadline_ns, client_gone=client_gone
        )
        tracing.record_batch_spans(
            enqueued_ns=result.enqueued_ns,
            started_ns=result.started_ns,
            finished_ns=result.finished_ns,
            requests=result.batch_requests,
            rows=result.batch_rows,
            inline=result.inline,
        )
        outputs = tuple(
            write_output(name, result.outputs[name], request.shared_outputs[name], targets[name])
            if name in targets
            else encode_output(name, result.outputs[name])
            for name in wanted
        )
        self.metrics.request_succeeded(
            model.name,
            model.version,
            request_us=(time.time_ns() - started) / 1e3,
            queue_us=(result.started_ns - result.enqueued_ns) / 1e3,
            compute_us=(result.finished_ns - result.started_ns) / 1e3,
        )
        return InferResponse(model.name, model.version, request.id, outputs)

    def _decode(self, model: ServedModel, request: InferRequest) -> dict[str, torch.Tensor]:
        expected = model.input_datatypes
        names = [item.name for item in request.inputs]
        repeated = sorted({name for name in names if names.count(name) > 1})
        unknown = sorted(set(names) - set(expected))
        missing = [name for name in expected if name not in names]
        if repeated or unknown or missing:
            problems = [
                f"{label} {values}"
                for label, values in (
                    ("unknown", unknown),
                    ("missing", missing),
                    ("repeated", repeated),
                )
                if values
            ]
            raise InvalidInput(
                f"inputs do not match model {model.name!r}: {'; '.join(problems)}; "
                f"it takes {list(expected)}"
            )
        tensors = {}
        for item in request.inputs:
            if item.datatype != expected[item.name]:
                raise InvalidInput(
                    f"input {item.name!r} has datatype {item.datatype!r}; the model takes "
                    f"{expected[item.name]}"
                )
            if item.shared is not None:
                item = self._from_shared_memory(item)
            tensors[item.name] = decode_input(item, max_bytes=model.max_message_bytes)
        try:
            model.binder.bind(tensors)
        except InputError as error:
            raise InvalidInput(str(error)) from None
        return tensors

    def _from_shared_memory(self, item: InferInput) -> InferInput:
        """An input in shared memory -> the same input with the region's bytes as its raw data."""
        assert item.shared is not None
        view = self._registry().view(item.shared, item.name)
        datatype = DATATYPES.get(item.datatype)
        if datatype is not None and all(dim >= 0 for dim in item.shape):
            needed = math.prod(item.shape) * datatype.torch.itemsize
            if needed != len(view):
                raise InvalidInput(
                    f"input {item.name!r}: {BYTE_SIZE} is {len(view)}, but shape "
                    f"{list(item.shape)} {item.datatype} takes {needed} bytes"
                )
        return dataclasses.replace(item, raw=view)

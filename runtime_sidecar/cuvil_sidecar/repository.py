"""What the server holds, in Triton's terms: the repository index, each model's configuration
(the shape of Triton's ``config.pbtxt``) and its statistics, as neutral types with ``to_pb``
(gRPC) and ``to_json`` (REST, the JSON Triton's HTTP endpoints answer).

The configuration is derived, not stored: the artifact's signature gives the inputs and
outputs, the sidecar's settings give the batching and queue policy. With a batch dim shared by
every tensor (``startup.batch_symbol``), ``max_batch_size`` is the largest batch a request may
carry and ``dims`` leave that dim out, as Triton's do; without one it is 0 and ``dims`` are the
whole shapes. A dim that varies is -1. Statistics are read from the metrics the data plane
keeps (``metrics.Metrics``), in nanoseconds as Triton reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cuvil_sidecar.config import SidecarConfig
from cuvil_sidecar.generation.servable import GenerationServable
from cuvil_sidecar.messages import TensorMetadata
from cuvil_sidecar.metrics import FAILURE_DURATION, Metrics
from cuvil_sidecar.servable import ServedModel

INT32_MAX = 2**31 - 1
BACKEND = "cuvil"


@dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str
    state: str  # Triton's words: READY, LOADING, UNAVAILABLE
    reason: str = ""

    def to_json(self) -> dict[str, str]:
        entry = {"name": self.name, "version": self.version, "state": self.state}
        return entry | ({"reason": self.reason} if self.reason else {})


def repository_index(
    current: ServedModel | GenerationServable | None,
    config: SidecarConfig,
    reason: str,
    *,
    ready_only: bool,
) -> list[IndexEntry]:
    """The one model this sidecar serves; before it is ready, its configured name (if any) and
    why it is not ready (LOADING while it loads, UNAVAILABLE after a failed load)."""
    if current is not None:
        return [IndexEntry(current.name, current.version, "READY")]
    if ready_only or not config.model_name:
        return []
    state = "UNAVAILABLE" if "failed" in reason else "LOADING"
    return [IndexEntry(config.model_name, "", state, reason)]


@dataclass(frozen=True)
class ModelConfig:
    name: str
    platform: str
    max_batch_size: int
    inputs: tuple[TensorMetadata, ...]  # shapes as Triton's dims
    outputs: tuple[TensorMetadata, ...]
    instances: int
    batching: bool  # a dynamic batcher joins requests
    max_queue_delay_us: int
    max_queue_size: int
    queue_timeout_us: int
    decoupled: bool = False  # a generation model: one request, a response per token

    def to_json(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "name": self.name,
            "platform": self.platform,
            "backend": BACKEND,
            "max_batch_size": self.max_batch_size,
            "input": [_tensor_json(t) for t in self.inputs],
            "output": [_tensor_json(t) for t in self.outputs],
            "instance_group": [{"name": self.name, "kind": "KIND_CPU", "count": self.instances}],
        }
        if self.batching:
            config["dynamic_batching"] = {
                "max_queue_delay_microseconds": self.max_queue_delay_us,
                "default_queue_policy": {
                    "timeout_action": "REJECT",
                    "default_timeout_microseconds": self.queue_timeout_us,
                    "allow_timeout_override": False,
                    "max_queue_size": self.max_queue_size,
                },
            }
        if self.decoupled:
            config["model_transaction_policy"] = {"decoupled": True}
        return config

    def to_pb(self) -> Any:
        from cuvil_sidecar._generated import grpc_service_pb2 as pb

        config = pb.ModelConfig(
            name=self.name,
            platform=self.platform,
            backend=BACKEND,
            max_batch_size=self.max_batch_size,
            input=[
                pb.ModelInput(name=t.name, data_type=_data_type(t.datatype), dims=t.shape)
                for t in self.inputs
            ],
            output=[
                pb.ModelOutput(name=t.name, data_type=_data_type(t.datatype), dims=t.shape)
                for t in self.outputs
            ],
            instance_group=[
                pb.ModelInstanceGroup(
                    name=self.name, kind=pb.ModelInstanceGroup.KIND_CPU, count=self.instances
                )
            ],
        )
        if self.batching:
            config.dynamic_batching.max_queue_delay_microseconds = self.max_queue_delay_us
            policy = config.dynamic_batching.default_queue_policy
            policy.timeout_action = pb.ModelQueuePolicy.REJECT
            policy.default_timeout_microseconds = self.queue_timeout_us
            policy.max_queue_size = self.max_queue_size
        return pb.ModelConfigResponse(config=config)


def model_config(model: ServedModel | GenerationServable, config: SidecarConfig) -> ModelConfig:
    metadata = model.metadata()
    if isinstance(model, GenerationServable):
        return ModelConfig(
            name=metadata.name,
            platform=metadata.platform,
            max_batch_size=0,
            inputs=metadata.inputs,
            outputs=metadata.outputs,
            instances=1,
            batching=False,  # not the dynamic batcher: the scheduler batches every step
            max_queue_delay_us=0,
            max_queue_size=config.generation_max_waiting,
            queue_timeout_us=0,
            decoupled=True,
        )
    max_batch_size = 0
    inputs, outputs = metadata.inputs, metadata.outputs
    if model.batch_symbol is not None:
        bound = model.signature.symbol(model.batch_symbol).max
        max_batch_size = min(INT32_MAX, bound if bound is not None else INT32_MAX)
        inputs, outputs = _without_batch(inputs), _without_batch(outputs)
    return ModelConfig(
        name=metadata.name,
        platform=metadata.platform,
        max_batch_size=max_batch_size,
        inputs=inputs,
        outputs=outputs,
        instances=config.model_instances,
        batching=model.batcher.max_rows > 1,
        max_queue_delay_us=config.max_queue_delay_us,
        max_queue_size=config.max_queue_size,
        queue_timeout_us=config.queue_timeout_us,
    )


@dataclass(frozen=True)
class Duration:
    count: int
    ns: int


@dataclass(frozen=True)
class ModelStatistics:
    name: str
    version: str
    last_inference_ms: int
    inference_count: int
    execution_count: int
    success: Duration
    fail: Duration
    queue: Duration
    compute_infer: Duration

    def _durations(self) -> dict[str, Duration]:
        return {
            "success": self.success,
            "fail": self.fail,
            "queue": self.queue,
            "compute_infer": self.compute_infer,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                key: {"count": value.count, "ns": value.ns}
                for key, value in self._durations().items()
            },
        }

    def to_pb(self) -> Any:
        from cuvil_sidecar._generated import grpc_service_pb2 as pb

        return pb.ModelStatistics(
            name=self.name,
            version=self.version,
            last_inference=self.last_inference_ms,
            inference_count=self.inference_count,
            execution_count=self.execution_count,
            inference_stats=pb.InferStatistics(
                **{
                    key: pb.StatisticDuration(count=value.count, ns=value.ns)
                    for key, value in self._durations().items()
                }
            ),
        )


def model_statistics(model: ServedModel | GenerationServable, metrics: Metrics) -> ModelStatistics:
    def value(name: str) -> float:
        return metrics.value(name, model=model.name, version=model.version)

    succeeded = int(value("nv_inference_request_success"))
    return ModelStatistics(
        name=model.name,
        version=model.version,
        last_inference_ms=metrics.last_inference_ms(model.name, model.version),
        inference_count=int(value("nv_inference_count")),
        execution_count=int(value("nv_inference_exec_count")),
        success=Duration(succeeded, int(value("nv_inference_request_duration_us") * 1e3)),
        fail=Duration(
            int(value("nv_inference_request_failure")), int(value(FAILURE_DURATION) * 1e3)
        ),
        queue=Duration(succeeded, int(value("nv_inference_queue_duration_us") * 1e3)),
        compute_infer=Duration(
            succeeded, int(value("nv_inference_compute_infer_duration_us") * 1e3)
        ),
    )


def statistics_pb(statistics: list[ModelStatistics]) -> Any:
    from cuvil_sidecar._generated import grpc_service_pb2 as pb

    return pb.ModelStatisticsResponse(model_stats=[s.to_pb() for s in statistics])


def index_pb(entries: list[IndexEntry]) -> Any:
    from cuvil_sidecar._generated import grpc_service_pb2 as pb

    index = pb.RepositoryIndexResponse.ModelIndex
    return pb.RepositoryIndexResponse(
        models=[
            index(name=e.name, version=e.version, state=e.state, reason=e.reason) for e in entries
        ]
    )


def _without_batch(tensors: tuple[TensorMetadata, ...]) -> tuple[TensorMetadata, ...]:
    return tuple(TensorMetadata(t.name, t.datatype, t.shape[1:]) for t in tensors)


def _tensor_json(tensor: TensorMetadata) -> dict[str, Any]:
    return {
        "name": tensor.name,
        "data_type": f"TYPE_{_config_type(tensor.datatype)}",
        "dims": list(tensor.shape),
    }


def _config_type(datatype: str) -> str:
    """The protocol's datatype (FP32) -> model_config.proto's DataType name without TYPE_."""
    return "STRING" if datatype == "BYTES" else datatype


def _data_type(datatype: str) -> str:
    """The protocol's datatype (FP32) -> model_config.proto's DataType name (TYPE_FP32)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"

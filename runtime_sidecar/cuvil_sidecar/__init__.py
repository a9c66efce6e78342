"""Cuvil runtime sidecar: serves one compiled artifact over the Open Inference Protocol v2 (gRPC
and REST).

Flow: ``main`` (environment -> ``config.SidecarConfig``) -> ``server`` (composition root: gRPC,
health, reflection, the REST and metrics ports on ``http_server``, signals) -> ``servicer``
(protobuf <-> ``messages``; ``streaming`` for ModelStreamInfer) or ``rest`` (JSON and binary
data <-> ``messages``, in ``rest_tensors``) -> ``dataplane`` (what each call means; Triton's
config, statistics and index in ``repository``) -> ``manager`` (first load, hot reload, atomic
swap) -> ``servable`` + ``batcher`` (one model's requests, joined and run) -> ``cuvil.runtime``.
Start-up checks live in ``startup``; tensors on the wire in ``codec``; telemetry in ``tracing``
and ``metrics``. Generated protobuf code sits in ``_generated/`` (``scripts/gen-proto``).
"""

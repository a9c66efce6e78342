"""Cuvil runtime sidecar: serves one compiled artifact over the Open Inference Protocol v2 (gRPC).

Flow: ``main`` (environment -> ``config.SidecarConfig``) -> ``server`` (composition root: gRPC,
health, reflection, metrics HTTP, signals) -> ``servicer`` (protobuf <-> ``messages``) ->
``dataplane`` (what each RPC means) -> ``manager`` (first load, hot reload, atomic swap) ->
``servable`` + ``batcher`` (one model's requests, joined and run) -> ``cuvil.runtime``.
Start-up checks live in ``startup``; tensors on the wire in ``codec``; telemetry in ``tracing``
and ``metrics``. Generated protobuf code sits in ``_generated/`` (``scripts/gen-proto``).
"""

"""Serving decoder LLMs: continuous batching over a ``cuvil.generation.engine.DecoderEngine``.

``loader`` finds the engine for what ``CUVIL_MODEL`` names (the seam between an artifact and
its engine); ``scheduler`` runs every stream's steps on one thread; ``servable`` is the served
model the data plane hands requests to (tokenizer, metrics, tracing, async streams);
``requests`` reads the generate parameters both protocols share; ``rest_generate`` and
``grpc_generate`` speak Triton's generate extension and decoupled ModelStreamInfer.
"""

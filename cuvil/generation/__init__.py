"""Decoder LLM generation: a compiled prefill/decode pair over a KV cache in fixed slots.

``engine.DecoderEngine`` is the contract between what drives generation (``generate`` in
process, the sidecar's continuous-batching scheduler) and what runs the model's steps.
``sampling`` picks the next token from logits the same way for both. ``compile`` turns a causal
LM into the two steps (``step`` is the module it exports); the compiled model they make is
``cuvil.runtime.generation.GenerationModel``. Nothing here is imported with the package, so the
sidecar can use the contract without the compiler.
"""

"""Decoder LLM generation: a compiled prefill/decode pair over a KV cache in fixed slots.

``engine.DecoderEngine`` is the contract between what drives generation (``generate`` in
process, the sidecar's continuous-batching scheduler) and what runs the model's steps.
``sampling`` picks the next token from logits the same way for both.
"""

"""The generation compile: a causal LM -> a prefill graph and a decode graph over a KV cache.

    probe cache layout -> export prefill, export decode -> import -> passes -> verify

Both steps are the model's own forward wrapped in ``DecoderStep`` (step.py) and exported with
torch.export: decode with a symbolic batch (the slots stepping together, one token each),
prefill with one row and a symbolic number of tokens, each with its own slot and position (a
prompt, a chunk of one, or chunks of several prompts packed together; the config says
``prefill_positions: per_token``). Positions are inputs, so one graph serves every offset (RoPE
angles and learned position embeddings are computed from them in the graph). Each graph goes
through the same passes as any forward (``pipeline.lower``: RMSNorm, SwiGLU, RoPE, sibling
linears, epilogues) and the op allowlist; the KV cache ops are Cuvil ops from the start
(``cuvil.kv_cache_write`` and ``cuvil.cached_attention``, GQA inside). The two graphs share
one weights file: a weight a pass derived in both (a packed SwiGLU or QKV weight) is stored
once. With ``precision="bf16"`` the lowering's precision pass gives the GEMMs bf16 weights, as
in a forward compile, and the KV cache holds bf16 keys and values (``CACHE_DTYPES``), as
transformers' own cache does for a bf16 model: the attention of a decode step reads every
cached position of every row, and at 16 rows of 150 positions a 100M Llama's fp32 cache was
4.9 MB a layer, read from memory each step; the attention widens them to fp32 as it reads.
``precision="int8"`` is bf16 with the linears' weights int8 (one scale per output row): the
same bf16 cache, half the weight bytes a decode step reads.

Verification runs the compiled steps the way ``generate`` does — the example prompt as a
prefill, then decode steps on the model's greedy tokens — against the model's own full forward
on the same sequence, and refuses the result (VerificationError) past the tolerance.

With ``choose_kernels`` (the default outside test suites), the verified model then makes its
kernel choices for every decode row bucket and for the example prompt's prefill
(``GenerationModel.choose_kernels``), and the artifact carries them, so the first steps after a
load do not time candidates.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import cuvil
from cuvil.analysis.memory import plan_memory
from cuvil.artifact import media_types as mt
from cuvil.artifact.files import ArtifactContents
from cuvil.frontend.convert import convert_exported_program
from cuvil.frontend.export import ExportedModel, export_model
from cuvil.generation.generate import sampling_defaults
from cuvil.generation.step import DecoderStep, probe_layout
from cuvil.ir import Graph
from cuvil.ir_verify import verify_graph
from cuvil.passes.program import Program
from cuvil.pipeline import CompileOptions, VerificationError, _Run, check_options, lower
from cuvil.runtime.generation import PER_ROW, PER_TOKEN, STEP_INPUTS, GenerationModel, KVCacheLayout

VERIFY_DECODE_STEPS = 4
# precision -> the KV cache's dtype (else the model's)
CACHE_DTYPES = {"bf16": torch.bfloat16, "int8": torch.bfloat16}
TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE = "tokenizer_config.json", "chat_template.jinja"


def compile_generation(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    max_batch: int,
    max_seq: int,
    options: CompileOptions,
    tokenizer_dir: str | Path | None = None,
) -> GenerationModel:
    backend = check_options(options)
    if backend.target.family != "cpu":
        raise ValueError(f"generation compiles for the CPU only, not {options.target}")
    prompt = _example_prompt(example_inputs)
    if max_batch < 1 or max_seq < 2:
        raise ValueError(f"max_batch must be at least 1 and max_seq 2 ({max_batch}, {max_seq})")
    if prompt.numel() + VERIFY_DECODE_STEPS > max_seq:
        prompt = prompt[: max_seq - VERIFY_DECODE_STEPS]
    config = getattr(model, "config", None)
    _check_positions(config, max_seq)
    started = time.perf_counter()
    model = model.eval()
    run = _Run(options)
    layout = probe_layout(model, max_batch, max_seq)
    if options.precision in CACHE_DTYPES and layout.dtype == torch.float32:
        layout = replace(layout, dtype=CACHE_DTYPES[options.precision])
    name = options.name or type(model).__name__
    with run.stage("export"):
        decode_ep = _export(DecoderStep(model), layout, rows=max_batch, tokens=1)
        prefill_step = DecoderStep(model, per_token=True)
        prefill_ep = _export(prefill_step, layout, rows=1, tokens=max_seq)
    with run.stage("passes"):
        decode, decode_passes = _lowered(decode_ep, f"{name}.decode", run)
        prefill, prefill_passes = _lowered(prefill_ep, f"{name}.prefill", run)
    prefill = _share_weights(decode, prefill)
    cache_inputs = decode.graph.inputs[len(STEP_INPUTS) :]
    eos = _token_ids(model, "eos_token_id")
    generation = {
        "kv_cache": layout.to_json(),
        "cache_inputs": list(cache_inputs),
        "vocab_size": int(decode.graph.type_of(decode.graph.outputs[0][1]).shape[-1]),
        "eos_token_id": eos,
        "pad_token_id": _token_ids(model, "pad_token_id"),
        "kv_bytes_per_token": layout.bytes_per_token,
        "prefill_positions": PER_TOKEN if prefill_step.per_token else PER_ROW,
        # what transformers' generate takes from the model's generation config
        "sampling_defaults": sampling_defaults(getattr(model, "generation_config", None)),
    }
    artifact_config: dict[str, Any] = {
        "name": name,
        "cuvil_version": cuvil.__version__,
        "torch_version": torch.__version__,
        "target": options.target,
        "precision": options.precision,
        "task": "text-generation",
        "eos_token_id": _as_list(eos),  # where the sidecar's loader reads it
        "signature": _signature_json(decode.graph),
        "passes": [entry["name"] for entry in decode_passes],
        "generation": generation,
    }
    weights = {**decode.weights, **prefill.weights}
    contents = ArtifactContents(
        artifact_config,
        decode.graph,
        weights,
        prefill_graph=prefill.graph,
        data_files=_tokenizer_files(tokenizer_dir, model),
    )
    with run.stage("plan"):
        compiled = GenerationModel(contents)
    with run.stage("verify"):
        errors = _verify(compiled, model, prompt)
    worst = max(errors.values())
    if worst > options.tolerance:
        raise VerificationError(
            f"compiled {name} differs from eager by {worst:.3g} of the logits' scale "
            f"(tolerance {options.tolerance}): {errors}"
        )
    compiled.reset_cache()
    choosing = time.perf_counter()
    if options.choose_kernels:  # made now, carried in the artifact: no timing in first steps
        with run.stage("verify"):  # as the forward compile, where its choices are made
            artifact_config.update(compiled.choose_kernels(int(prompt.numel())))
    artifact_config["report"] = {
        "kernel_choice_seconds": round(time.perf_counter() - choosing, 3),
        "compile_seconds": round(time.perf_counter() - started, 3),
        "stages": run.stages,
        "decode": _graph_report(decode, decode_passes, {"batch": max_batch}),
        "prefill": _graph_report(prefill, prefill_passes, {"seq": max_seq}),
        "verification": {"max_relative_to_scale": errors, "tolerance": options.tolerance},
        "fusions": dict(decode.hits),
        "weights_bytes": sum(t.numel() * t.element_size() for t in weights.values()),
        "kv_cache_bytes": layout.bytes_per_token * max_batch * max_seq,
    }
    return compiled


def _example_prompt(example_inputs: Any) -> torch.Tensor:
    """The example's first row of ``input_ids``, as the prompt verification generates from."""
    ids = example_inputs.get("input_ids") if isinstance(example_inputs, dict) else example_inputs
    if isinstance(ids, tuple | list):
        ids = ids[0]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 1:
        raise ValueError("example_inputs for text-generation: input_ids [batch, prompt] tokens")
    return ids[0].to(torch.int64)


def _check_positions(config: Any, max_seq: int) -> None:
    """Refuse a cache longer than the model's positions or its sliding window."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 0)
    if limit and max_seq > limit:
        raise ValueError(f"max_seq {max_seq} exceeds the model's {limit} positions")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ()
    slides = "sliding_attention" in layer_types or (
        window is not None and not hasattr(config, "use_sliding_window")
    )
    if slides and window is not None and max_seq > window:
        raise ValueError(
            f"max_seq {max_seq} exceeds the model's sliding window of {window}: sliding-window "
            "attention over a longer cache is not supported"
        )


def _export(step: DecoderStep, layout: KVCacheLayout, rows: int, tokens: int) -> ExportedModel:
    """One step exported: ``rows`` > 1 makes the batch symbolic, ``tokens`` > 1 the length
    (a ``per_token`` step: slots and positions one per token, of that length)."""
    caches = tuple(layout.allocate())
    example_rows = min(rows, 2)
    example_tokens = min(tokens, 4)
    ids = torch.zeros(example_rows, example_tokens, dtype=torch.int64)
    slots = torch.arange(example_rows, dtype=torch.int64)
    positions = torch.zeros(example_rows, dtype=torch.int64)
    batch = torch.export.Dim("batch", min=1, max=rows) if rows > 1 else None
    seq = torch.export.Dim("seq", min=1, max=tokens) if tokens > 1 else None
    ids_dims = {index: dim for index, dim in ((0, batch), (1, seq)) if dim is not None}
    row_dims = {0: batch} if batch is not None else None
    if step.per_token:  # the example's tokens: slot 0, positions 0, 1, ...
        slots = torch.zeros(example_tokens, dtype=torch.int64)
        positions = torch.arange(example_tokens, dtype=torch.int64)
        row_dims = {0: seq} if seq is not None else None
    shapes = (ids_dims or None, row_dims, row_dims, (None,) * len(caches))
    return export_model(step, (ids, slots, positions, *caches), shapes)


def _lowered(exported: ExportedModel, name: str, run: _Run) -> tuple[Program, list[dict[str, Any]]]:
    frontend = convert_exported_program(exported.program, name, exported.dim_names)
    graph = _renamed_inputs(verify_graph(frontend.graph))
    program = Program(graph, frontend.weights)
    run.dump(f"import-{name}", program.graph)
    lowered, applied = lower(program, run, frozenset(run.options.disable_passes))
    return lowered, applied


def _renamed_inputs(graph: Graph) -> Graph:
    """Caches named ``key_cache_<layer>`` and ``value_cache_<layer>`` instead of export's
    ``caches_<i>`` (the graph's inputs are exactly the step's, in order)."""
    renames = {}
    for index, name in enumerate(graph.inputs[len(STEP_INPUTS) :]):
        kind = "key" if index % 2 == 0 else "value"
        renames[name] = f"{kind}_cache_{index // 2}"
    if not renames:
        return graph
    from cuvil.ir import Value, map_values

    values = {Value(old): Value(new) for old, new in renames.items()}
    nodes = tuple(
        replace(
            node,
            name=renames.get(node.name, node.name),
            args=tuple((key, map_values(arg, values)) for key, arg in node.args),
        )
        for node in graph.nodes
    )
    inputs = tuple(renames.get(name, name) for name in graph.inputs)
    return verify_graph(replace(graph, nodes=nodes, inputs=inputs))


def _share_weights(decode: Program, prefill: Program) -> Program:
    """``prefill`` with its weights under the decode graph's keys where the tensors are equal,
    and under keys of its own (``prefill.<key>``) where they differ."""
    by_shape: dict[tuple[Any, ...], list[str]] = {}
    for key, tensor in decode.weights.items():
        by_shape.setdefault((tuple(tensor.shape), tensor.dtype), []).append(key)
    keys: dict[str, str] = {}
    weights: dict[str, torch.Tensor] = {}
    for key, tensor in prefill.weights.items():
        candidates = [key, *by_shape.get((tuple(tensor.shape), tensor.dtype), [])]
        same = next(
            (
                other
                for other in candidates
                if other in decode.weights and torch.equal(decode.weights[other], tensor)
            ),
            None,
        )
        keys[key] = same if same is not None else f"prefill.{key}"
        if same is None:
            weights[keys[key]] = tensor
    nodes = tuple(
        replace(node, args=(("key", keys[str(node.arg("key"))]),)) if node.op == "const" else node
        for node in prefill.graph.nodes
    )
    return Program(verify_graph(replace(prefill.graph, nodes=nodes)), weights, prefill.hits)


def _verify(compiled: GenerationModel, model: torch.nn.Module, prompt: torch.Tensor) -> dict:
    """Worst error relative to the logits' scale, prefill and decode steps, against the model's
    full forward over the same tokens."""
    sequence = prompt.clone()
    errors: dict[str, float] = {}
    with torch.no_grad():
        logits = compiled.prefill(0, sequence, 0)
        reference = model(input_ids=sequence[None], use_cache=False).logits[0, -1].float()
        errors["prefill"] = _relative(logits, reference)
        worst_decode = 0.0
        for _ in range(VERIFY_DECODE_STEPS):
            token = int(torch.argmax(reference))
            position = sequence.numel()
            sequence = torch.cat([sequence, torch.tensor([token])])
            logits = compiled.decode([0], torch.tensor([token]), torch.tensor([position]))[0]
            reference = model(input_ids=sequence[None], use_cache=False).logits[0, -1].float()
            worst_decode = max(worst_decode, _relative(logits, reference))
        errors["decode"] = worst_decode
    return errors


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = float(expected.abs().max()) or 1.0
    return float((actual - expected).abs().max()) / scale


def _graph_report(program: Program, applied: list, symbols: dict[str, int]) -> dict[str, Any]:
    present = {name: value for name, value in symbols.items() if name in _symbol_names(program)}
    return {
        "ops": len(program.graph.nodes),
        "op_histogram": program.graph.op_histogram(),
        "passes": applied,
        "fusions": dict(program.hits),
        "memory_plan": plan_memory(program.graph, present).summary(),
    }


def _symbol_names(program: Program) -> set[str]:
    return {symbol.name for symbol in program.graph.symbols}


def _signature_json(graph: Graph) -> dict[str, Any]:
    from cuvil.runtime.signature import Signature

    return Signature.of_graph(graph).to_json()


def _token_ids(model: torch.nn.Module, key: str) -> int | list[int] | None:
    """The model's end or pad token(s), from its generation config or its config."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(source, key, None)
        if isinstance(value, int):
            return value
        if isinstance(value, list | tuple) and value:
            return [int(v) for v in value]
    return None


def _as_list(ids: int | list[int] | None) -> list[int]:
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def _tokenizer_files(tokenizer_dir: str | Path | None, model: torch.nn.Module) -> dict[str, bytes]:
    """The tokenizer's JSON files from ``tokenizer_dir``, or the directory the model was
    loaded from, when they are there. A chat template saved as its own ``chat_template.jinja``
    (transformers' newer layout) goes into ``tokenizer_config.json`` as ``chat_template``,
    where older tokenizers keep it: the artifact carries JSON files only."""
    source = tokenizer_dir or getattr(model, "name_or_path", None)
    if not source or not Path(source).is_dir():
        return {}
    found = {name: Path(source) / name for name in mt.TOKENIZER_FILES}
    files = {name: path.read_bytes() for name, path in found.items() if path.is_file()}
    template = Path(source) / CHAT_TEMPLATE_FILE
    if template.is_file():
        config = json.loads(files.get(TOKENIZER_CONFIG, b"{}"))
        if isinstance(config, dict) and "chat_template" not in config:
            config["chat_template"] = template.read_text()
            files[TOKENIZER_CONFIG] = json.dumps(config, indent=2).encode()
    return files

"""The seam between what ``CUVIL_MODEL`` names and the ``DecoderEngine`` that generates from it.

``load_generation`` answers None for a model that is not a generation model (the usual
start-up in ``startup.py`` then loads it), or a ``GenerationModel``: the engine, the tokenizer
(``tokenizer.json``, data) and the end-of-sequence ids, which ``servable.GenerationServable``
serves with the continuous-batching scheduler. Two kinds of source are generation models:

- a Cuvil artifact whose config says ``"task": "text-generation"`` (what
  ``cuvil.jit(..., task="text-generation")`` writes): ``ENGINE_FOR_ARTIFACT`` turns the artifact
  into its engine, the compiled prefill/decode pair over the artifact's KV cache. It is the one
  place that connects the compiled engine to the sidecar;
- a transformers checkpoint folder (``config.json`` with a ``model_type``, weights in
  safetensors, no code: ``trust_remote_code`` stays off): served eagerly by
  ``EagerDecoderEngine`` with ``CUVIL_GENERATION_SLOTS`` slots of ``CUVIL_GENERATION_MAX_SEQ``
  positions, the baseline the compiled engine is measured against.
"""

from __future__ import annotations

import json
import logging
import tarfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cuvil.artifact import media_types as mt
from cuvil.artifact.trust import TrustSettings
from cuvil.generation.engine import DecoderEngine
from cuvil_sidecar.config import SidecarConfig
from cuvil_sidecar.generation.engine_threads import (
    ThreadChoice,
    choose_engine_threads,
    torch_threads,
)
from cuvil_sidecar.generation.text import TOKENIZER_FILE, TextCodec, eos_from_files
from cuvil_sidecar.source import ModelSource

log = logging.getLogger("cuvil_sidecar.generation")

TASK = "text-generation"
DEFAULT_MAX_SEQ = 2048  # positions per slot when the checkpoint allows more


@dataclass(frozen=True)
class GenerationModel:
    name: str
    engine: DecoderEngine
    digest: str
    source_digest: str
    text: TextCodec | None = None  # None: token ids in and out
    eos_token_ids: tuple[int, ...] = ()
    # the source model's generation config's sampling options: what a request leaves out
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)  # the artifact's, for trace links
    threads: ThreadChoice | None = None  # the engine thread's; None: the process's count


class GenerationLoadError(RuntimeError):
    """The source is a generation model that cannot be served here; the message says why."""


@dataclass(frozen=True)
class ServedEngine:
    engine: DecoderEngine
    threads: ThreadChoice | None = None  # None: the engine runs at the process's thread count


def _compiled_engine(
    path: Path, config: Mapping[str, Any], settings: SidecarConfig
) -> ServedEngine:
    """The artifact's compiled prefill/decode pair and its KV cache (``max_batch`` slots of
    ``max_seq`` positions, fixed when it was compiled): cuvil/runtime/generation.py, its
    thread count chosen (``engine_threads.py``) and warmed up at it, at every decode row count
    and prefill length bucket up to ``CUVIL_PREFILL_CHUNK``, before it serves."""
    import torch

    from cuvil.runtime.generation import GenerationModel as CompiledGeneration
    from cuvil.runtime.model import load

    try:
        model = load(path)
    except ValueError as error:  # ArtifactError among them
        raise GenerationLoadError(f"loading the {TASK} artifact {path} failed: {error}") from error
    if not isinstance(model, CompiledGeneration):
        raise GenerationLoadError(f"{path} says {TASK} but holds no prefill/decode pair")
    started = time.perf_counter()
    threads = choose_engine_threads(model, torch.get_num_threads(), settings.generation_threads)
    log.info("%s runs its engine at %d threads: %s", path.name, threads.threads, threads.reason)
    with torch_threads(threads.threads):
        steps = model.warm_up(settings.prefill_chunk)
    log.info("warmed up %s: %d steps in %.2f s", path.name, steps, time.perf_counter() - started)
    return ServedEngine(model, threads)


# (artifact folder or tar, its config, the sidecar's settings) -> its engine, warmed up
EngineForArtifact = Callable[[Path, Mapping[str, Any], SidecarConfig], ServedEngine]
ENGINE_FOR_ARTIFACT: EngineForArtifact = _compiled_engine


def load_generation(
    source: ModelSource,
    source_digest: str,
    settings: SidecarConfig,
    trust: TrustSettings | None = None,
) -> GenerationModel | None:
    """The generation model ``source`` names, or None when it names another kind of model
    (fetched all the same: the node cache then hands it to the usual start-up)."""
    if source.is_local and is_transformers_checkpoint(Path(source.reference)):
        return _eager(Path(source.reference), source_digest, settings)
    path, manifest_digest = source.fetch_resolved(trust)
    config = artifact_config(path)
    if config.get("task") != TASK:
        return None
    served = ENGINE_FOR_ARTIFACT(path, config, settings)
    codec = TextCodec(path / TOKENIZER_FILE) if (path / TOKENIZER_FILE).is_file() else None
    eos = tuple(config.get("eos_token_id") or ()) or eos_from_files(path, codec)
    return GenerationModel(
        name=str(config.get("name") or path.stem),
        engine=served.engine,
        digest=manifest_digest or source_digest,
        source_digest=source_digest,
        text=codec,
        eos_token_ids=eos,
        sampling_defaults=dict((config.get("generation") or {}).get("sampling_defaults") or {}),
        config=config,
        threads=served.threads,
    )


def is_transformers_checkpoint(path: Path) -> bool:
    if not path.is_dir() or (path / mt.GRAPH_FILE).exists():
        return False
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("model_type"), str)


def artifact_config(path: Path) -> dict[str, Any]:
    """A Cuvil artifact's config.json (folder or tar); empty when it has none."""
    try:
        if path.is_dir():
            data = (path / mt.CONFIG_FILE).read_bytes()
        else:
            with tarfile.open(path, "r:") as tar:
                member = tar.extractfile(mt.CONFIG_FILE)
                data = member.read() if member is not None else b"{}"
        value = json.loads(data)
    except (OSError, KeyError, ValueError, tarfile.TarError):
        return {}
    return value if isinstance(value, dict) else {}


def _eager(path: Path, source_digest: str, settings: SidecarConfig) -> GenerationModel:
    import torch
    from transformers import AutoModelForCausalLM

    from cuvil.generation.eager_engine import EagerDecoderEngine
    from cuvil.generation.generate import sampling_defaults

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, use_safetensors=True, dtype=torch.float32
        )
    except (OSError, ValueError) as error:
        raise GenerationLoadError(f"loading the checkpoint {path} failed: {error}") from error
    positions = int(getattr(model.config, "max_position_embeddings", 0) or DEFAULT_MAX_SEQ)
    max_seq = settings.generation_max_seq or min(positions, DEFAULT_MAX_SEQ)
    engine = EagerDecoderEngine(model, settings.generation_slots, max_seq)
    codec = TextCodec(path / TOKENIZER_FILE) if (path / TOKENIZER_FILE).is_file() else None
    log.info(
        "serving the transformers checkpoint %s eagerly: %d slots of %d positions, %s",
        path,
        engine.max_batch,
        engine.max_seq,
        "with its tokenizer" if codec else "token ids in and out (no tokenizer.json)",
    )
    return GenerationModel(
        name=path.name,
        engine=engine,
        digest=source_digest,
        source_digest=source_digest,
        text=codec,
        eos_token_ids=eos_from_files(path, codec),
        sampling_defaults=sampling_defaults(model.generation_config),
    )

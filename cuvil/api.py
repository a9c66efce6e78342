"""The public entry points: ``cuvil.jit`` and ``cuvil.load``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cuvil.analysis.memory import MemoryPolicy
from cuvil.runtime.model import CompiledModel
from cuvil.runtime.model import load as load_artifact


def jit(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    target: str = "cpu",
    precision: str = "fp32",
    dynamic_shapes: Any = None,
    name: str | None = None,
    dump_dir: str | Path | None = None,
    on_stage: Callable[[str], None] | None = None,
    disable_passes: tuple[str, ...] = (),
    patterns: tuple[Any, ...] | None = None,
    tolerance: float | None = None,
    on_mismatch: str = "fallback",
    choose_kernels: bool | None = None,
    task: str | None = None,
    max_batch: int = 8,
    max_seq: int = 512,
    tokenizer_dir: str | Path | None = None,
    memory: MemoryPolicy | None = None,
) -> CompiledModel:
    """Compile ``model`` for ``target``; ``dynamic_shapes`` is what torch.export.export takes.

    ``example_inputs`` is a tensor, a tuple of positional inputs, or a dict of keyword inputs.
    The result is verified against eager PyTorch on the examples before it is returned
    (``compiled.report["verification"]``). If it differs by more than ``tolerance`` (relative to
    the output's scale), the passes are bisected: the responsible pass is named in
    ``report["bisection"]`` and left out (``on_mismatch="fallback"``) or the compile fails
    (``"raise"``). ``patterns`` defaults to those accepted by ``cuvil.patterns.register_pattern``.

    ``choose_kernels`` (default: on unless ``CUVIL_KERNEL_CHOICES=off``) times the backend's
    kernel choices at the example shapes now and carries them in the artifact, so the first
    calls run at full speed; off, kernels time their candidates on their first calls instead
    (a quicker compile, e.g. for test suites that compile many models).

    ``task="text-generation"`` compiles a causal LM for generation instead (cuvil/generation/
    compile.py): a prefill and a decode graph over a KV cache of ``max_batch`` slots of
    ``max_seq`` positions, returned as a ``GenerationModel`` with ``generate``; the tokenizer
    files of ``tokenizer_dir`` (default: the directory the model was loaded from) go with it.
    ``precision="bf16"`` gives its GEMMs bf16 weights (half the bytes a decode step reads) and
    a bf16 KV cache (half the bytes its attention reads, twice the positions in a budget), and
    keeps attention's arithmetic and the norms in fp32.
    ``memory`` (``cuvil.MemoryPolicy``) chooses the memory planner, whether kernels may write
    in place over dead inputs, and a budget the plan must fit at the largest admitted shapes
    (``MemoryBudgetError`` at compile time, with the numbers, where it does not).
    """
    from cuvil.patterns import registered_patterns
    from cuvil.pipeline import CompileOptions, compile_model
    from cuvil.precisions import precision as precision_named

    budget = precision_named(precision).budget

    options = CompileOptions(
        target=target,
        precision=precision,
        name=name,
        dump_dir=Path(dump_dir) if dump_dir is not None else None,
        on_stage=on_stage,
        disable_passes=tuple(disable_passes),
        patterns=tuple(registered_patterns() if patterns is None else patterns),
        tolerance=budget if tolerance is None else tolerance,
        on_mismatch=on_mismatch,
        choose_kernels=(
            os.environ.get("CUVIL_KERNEL_CHOICES", "compile").strip().lower() != "off"
            if choose_kernels is None
            else choose_kernels
        ),
        memory=memory or MemoryPolicy(),
    )
    if task == "text-generation":
        from cuvil.generation.compile import compile_generation

        if dynamic_shapes is not None:
            raise ValueError("text-generation fixes its own shapes: pass max_batch and max_seq")
        return compile_generation(
            model,
            example_inputs,
            max_batch=max_batch,
            max_seq=max_seq,
            options=options,
            tokenizer_dir=tokenizer_dir,
        )
    if task is not None:
        raise ValueError(f"unknown task {task!r}; tasks: None (a forward), 'text-generation'")
    return compile_model(model, example_inputs, dynamic_shapes, options)


def load(
    path_or_ref: str | Path, *, cache_dir: str | Path | None = None, trust: Any = None
) -> CompiledModel:
    """Load an artifact in any process, without the model's code: a file or directory written by
    ``save``, a local OCI layout (``oci:DIR[:tag]``), or a registry reference (by tag or digest;
    the entry for this machine is picked from an index, every digest checked, the node cache used).

    A reference's signatures are checked before anything is downloaded, by ``trust``
    (``cuvil.artifact.trust.TrustSettings``), which defaults to ``CUVIL_TRUST_POLICY`` and
    ``CUVIL_TRUSTED_KEYS`` as the sidecar and ``cuvil pull`` read them (off when unset).
    A file written by ``save`` has no manifest to sign: ``require`` refuses it, ``warn`` logs.
    """
    from cuvil.artifact import resolve_model
    from cuvil.artifact.trust import TrustSettings

    settings = TrustSettings.from_env(os.environ) if trust is None else trust
    if Path(path_or_ref).exists():
        settings.check_path(str(path_or_ref))
        return load_artifact(path_or_ref)
    return load_artifact(resolve_model(str(path_or_ref), cache_dir=cache_dir, trust=settings))

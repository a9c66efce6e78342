"""Kernel choices made at compile time and carried in the artifact, per CPU family, so that the
first calls after ``cuvil.jit`` or ``cuvil.load`` run at full speed, as a TensorRT engine does.

The compiler runs the verified model on its example inputs, and on them cut to one item along
their batch-like dims, until every kernel choice those shapes meet is made (``tactics.py`` times
the candidates in place), and keeps the choices in the artifact's config under the CPU family it
timed them on: the vendor, the instruction-set extensions the kernels use and the thread count,
which decide which path wins (an EPYC with AVX512-BF16 and a Xeon with AMX choose differently).
A load on a CPU of a family the artifact has seen runs those choices from its first call; on
another family nothing is taken and the kernels time their candidates as they run (and the
node's tactics cache, ``tactics_cache.py``, keeps what they chose). Shape buckets the examples
did not reach are timed when first met.

    config["kernel_choices"] = {"AuthenticAMD:avx2+avx512f+avx512_bf16:2t": {node: {bucket: name}}}
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from cuvil.runtime.model import CompiledModel

log = logging.getLogger("cuvil.backends.cpu.kernel_choices")

CONFIG_KEY = "kernel_choices"
# The extensions the CPU kernels (oneDNN, MKL, Cuvil's C kernels) dispatch on.
FAMILY_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)

Choices = dict[str, dict[int, str]]  # node -> {row bucket: candidate name}


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_family(info: Mapping[str, str] | None = None, threads: int | None = None) -> str:
    """``vendor:ext+ext+…:Nt``, the key the artifact's choices are kept under."""
    info = cpuinfo() if info is None else info
    flags = set(info.get("flags", "").split())
    present = "+".join(flag for flag in FAMILY_FLAGS if flag in flags) or "baseline"
    count = torch.get_num_threads() if threads is None else threads
    return f"{info.get('vendor_id', 'unknown')}:{present}:{count}t"


def _decided(choices: Mapping[str, Mapping[int, str]]) -> dict[str, dict[str, str]]:
    """The decided choices, buckets as JSON keys (strings); buckets still timing are left out."""
    decided = {
        node: {str(key): name for key, name in buckets.items() if name != "timing"}
        for node, buckets in choices.items()
    }
    return {node: buckets for node, buckets in decided.items() if buckets}


def single_item_inputs(
    model: CompiledModel, inputs: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """The examples cut to one item along each dim whose symbol may be 1 (a batch), the
    shape a model meets first and most often; None when there is no such dim, or one of its
    symbols also sits inside another dim's expression (a cut could break that relation)."""
    graph = model.graph
    cut: set[str] = {symbol.name for symbol in graph.symbols if symbol.min <= 1}
    plain: dict[str, list[tuple[str, int]]] = {}
    for node in graph.nodes:
        if node.op != "input" or node.name not in inputs:
            continue
        for dim, size in enumerate(node.type.shape):
            names = {str(s) for s in size.free_symbols}
            if size.is_Symbol and str(size) in cut:
                plain.setdefault(str(size), []).append((node.name, dim))
            elif names & cut:
                cut -= names
    places = [place for name, found in plain.items() if name in cut for place in found]
    if not places:
        return None
    narrowed = dict(inputs)
    for name, dim in places:
        narrowed[name] = narrowed[name].narrow(dim, 0, 1)
    unchanged = all(narrowed[n].shape == inputs[n].shape for n in narrowed)
    return None if unchanged else narrowed


def choose_at_compile(
    model: CompiledModel, inputs: Mapping[str, torch.Tensor], settle: Any
) -> dict[str, Any]:
    """Make the choices the example shapes meet, and those of one item (``settle(model,
    inputs)`` runs a shape until they are made), and return the config entry that carries
    them, merged with any families the model's config holds already."""
    settle(model, inputs)
    single = single_item_inputs(model, inputs)
    if single is not None:
        try:
            settle(model, single)
        except Exception as error:  # the examples' own choices stand; this shape times later
            log.warning("no kernel choices for one item: %s: %s", type(error).__name__, error)
    carried = dict(model.config.get(CONFIG_KEY, {}))
    carried[cpu_family()] = _decided(model.plan.kernel_choices())
    return {CONFIG_KEY: carried}


def carried_for_this_cpu(model: CompiledModel) -> Choices:
    """The choices the artifact carries for this CPU's family (none for an unseen family)."""
    family = model.config.get(CONFIG_KEY, {}).get(cpu_family(), {})
    try:
        return {
            str(node): {int(key): str(name) for key, name in buckets.items()}
            for node, buckets in family.items()
        }
    except (AttributeError, TypeError, ValueError) as error:
        log.warning("ignoring the artifact's kernel choices: %s", error)
        return {}


def take_carried(model: CompiledModel) -> int:
    """Run the artifact's choices for this CPU's family; returns how many were taken."""
    choices = carried_for_this_cpu(model)
    if not choices:
        return 0
    taken = model.preset_tactics(choices)
    log.info("took %d kernel choices from the artifact (%s)", taken, cpu_family())
    return taken


def from_artifact(model: CompiledModel) -> Choices:
    """Which of the choices running now are the artifact's (for ``execution()``)."""
    running = model.plan.kernel_choices()
    return {
        node: taken
        for node, buckets in carried_for_this_cpu(model).items()
        if (taken := {k: n for k, n in buckets.items() if running.get(node, {}).get(k) == n})
    }

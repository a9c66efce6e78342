"""The tactics cache: the kernel choices a model made on one machine (tactics.py), kept
on disk, so that the next load of the same artifact (a restart, a reload, another replica on
the node, a benchmark's in-process copy) runs the same kernels at once instead of timing them
again, as TensorRT's timing cache does.

Timing is not free and not stable: each bucket takes ``trial_length`` calls to decide (30 with
two candidates), and on a shared host two loads can still choose differently, one slow stretch
of the host deciding every layer's choice at once (tactics.py). With the cache, every load after
the first runs what the first chose.

A choice holds for the artifact, CPU, thread count and library versions it was timed with, so
all of these name the file: a change of any is a miss (timed afresh), never a wrong choice. A
file that cannot be read or parsed counts as a miss, and is replaced after the next timing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import cuvil
from cuvil.artifact.layout import atomic_write

if TYPE_CHECKING:
    from cuvil.runtime.model import CompiledModel

log = logging.getLogger("cuvil.backends.cpu.tactics_cache")

Choices = dict[str, dict[int, str]]  # node -> {row bucket: candidate name}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, str]:
    """What a choice depends on besides the artifact."""
    return {
        "cpu": cpu_name(),
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "cuvil": cuvil.__version__,
    }


def cache_file(directory: Path, artifact_digest: str) -> Path:
    """Where the choices for this artifact (its config's digest) on the current machine live."""
    identity = json.dumps([artifact_digest, machine()], sort_keys=True).encode()
    return directory / f"{hashlib.sha256(identity).hexdigest()[:32]}.json"


def read_choices(path: Path) -> Choices:
    """The choices in ``path``; none when it is missing or not a tactics file."""
    try:
        document = json.loads(path.read_text())
        return {
            str(node): {int(key): str(name) for key, name in buckets.items()}
            for node, buckets in document["tactics"].items()
        }
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        log.warning("ignoring the tactics cache %s: %s", path, error)
        return {}


def write_choices(
    path: Path, artifact_digest: str, choices: Mapping[str, Mapping[int, str]]
) -> None:
    """Keep the decided choices (not the buckets still timing), replacing the file at once."""
    decided = {
        node: {str(key): name for key, name in buckets.items() if name != "timing"}
        for node, buckets in choices.items()
    }
    document = {
        "artifact": artifact_digest,
        "machine": machine(),
        "tactics": {node: buckets for node, buckets in decided.items() if buckets},
    }
    atomic_write(path, json.dumps(document, indent=1, sort_keys=True).encode())


def take_cached(model: CompiledModel, artifact_digest: str, directory: Path | None) -> Choices:
    """Preset the choices this artifact made earlier on the current machine, if kept; returns them
    (``directory`` None: no cache)."""
    if directory is None:
        return {}
    path = cache_file(directory, artifact_digest)
    choices = read_choices(path)
    if choices:
        taken = model.preset_tactics(choices)
        log.info("took %d kernel choices from the tactics cache %s", taken, path)
    return choices


def keep(
    model: CompiledModel, artifact_digest: str, directory: Path | None, cached: Choices
) -> None:
    """Keep the model's choices for the next load, unless nothing new was decided since
    ``take_cached``. A cache that cannot be written costs the next load its timing, not this
    one its start."""
    if directory is None:
        return
    choices = model.execution()["tactics"]
    if choices == cached:
        return
    path = cache_file(directory, artifact_digest)
    try:
        write_choices(path, artifact_digest, choices)
    except OSError as error:
        log.warning("cannot keep the kernel choices in %s: %s", path, error)

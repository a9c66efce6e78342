"""Artifact files on disk: a directory form and a single-file (tar) form of the same content.

An artifact is data, never code: ``config.json`` (signature, target, report, and the sha256 of
every other file), ``graph.json`` (the planned IR), ``weights.safetensors``, and optionally
``golden.safetensors`` (inputs and eager outputs for start-up checks) and ``kernels.tar``; a model
compiled for generation adds ``prefill_graph.json`` (a second graph over the same weights) and
its tokenizer's JSON files, kept as bytes (``data_files``) for whoever serves text.
Reading checks every file against the digest in the config before parsing it; nothing is
unpickled, imported or evaluated.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from cuvil.artifact import media_types as mt
from cuvil.artifact.errors import ArtifactError
from cuvil.artifact.limits import (
    DEFAULT_LIMITS,
    LoadLimits,
    check_contents,
    check_declared_sizes,
    check_graph,
    check_node_count,
)
from cuvil.artifact.plain_tar import read_plain_tar, write_plain_tar
from cuvil.ir import Graph
from cuvil.ir_json import graph_from_json, graph_to_json
from cuvil.ir_verify import verify_graph

CONFIG_FORMAT = "cuvil.config.v1"
MAX_MEMBER_BYTES = 64 * 2**30


@dataclass
class ArtifactContents:
    config: dict[str, Any]
    graph: Graph
    weights: dict[str, torch.Tensor]
    golden: dict[str, torch.Tensor] = field(default_factory=dict)
    kernels: bytes | None = None
    prefill_graph: Graph | None = None  # generation: the prompt step beside the decode step
    data_files: dict[str, bytes] = field(default_factory=dict)  # tokenizer files (JSON data)


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _tensors_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes; shared or non-contiguous storage is copied (the format wants that)."""
    seen: set[int] = set()
    plain: dict[str, torch.Tensor] = {}
    for key in sorted(tensors):
        tensor = tensors[key].detach().cpu()
        pointer = tensor.untyped_storage().data_ptr() if tensor.numel() else -1
        if pointer in seen or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen.add(pointer)
        plain[key] = tensor
    return save_safetensors(plain)


def encode_files(contents: ArtifactContents) -> dict[str, bytes]:
    """All files of the artifact as bytes, config last (it records the others' digests)."""
    files: dict[str, bytes] = {
        mt.GRAPH_FILE: json.dumps(graph_to_json(contents.graph), sort_keys=True).encode(),
        mt.WEIGHTS_FILE: _tensors_bytes(contents.weights),
    }
    if contents.golden:
        files[mt.GOLDEN_FILE] = _tensors_bytes(contents.golden)
    if contents.kernels is not None:
        files[mt.KERNELS_FILE] = contents.kernels
    if contents.prefill_graph is not None:
        prefill = graph_to_json(contents.prefill_graph)
        files[mt.PREFILL_GRAPH_FILE] = json.dumps(prefill, sort_keys=True).encode()
    for name, data in contents.data_files.items():
        if name not in mt.TOKENIZER_FILES:
            raise ArtifactError(f"{name!r} is not a data file an artifact may carry")
        files[name] = data
    config = dict(contents.config)
    config["format"] = CONFIG_FORMAT
    config["files"] = {
        name: {
            "mediaType": mt.FILE_MEDIA_TYPES[name],
            "digest": sha256_digest(data),
            "size": len(data),
        }
        for name, data in files.items()
    }
    files[mt.CONFIG_FILE] = json.dumps(config, indent=2, sort_keys=True).encode()
    return files


def write_artifact(
    contents: ArtifactContents, path: str | Path, *, directory: bool = False
) -> Path:
    """Write the tar form (default) or the directory form; returns the path written."""
    path = Path(path)
    files = encode_files(contents)
    if directory:
        path.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (path / name).write_bytes(data)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".partial")
    order = [mt.CONFIG_FILE, *sorted(n for n in files if n != mt.CONFIG_FILE)]
    with temporary.open("wb") as target:
        write_plain_tar(target, [(name, files[name]) for name in order])
    temporary.replace(path)
    return path


def read_files(path: str | Path) -> dict[str, bytes]:
    """The raw files of a directory or tar artifact (known names only)."""
    path = Path(path)
    known = {mt.CONFIG_FILE, *mt.FILE_MEDIA_TYPES}
    if path.is_dir():
        return {name: (path / name).read_bytes() for name in known if (path / name).is_file()}
    if not path.is_file():
        raise ArtifactError(f"no artifact at {path}")
    with path.open("rb") as source:
        return read_plain_tar(
            source, origin=str(path), is_expected=known.__contains__, max_bytes=MAX_MEMBER_BYTES
        )


def decode_files(
    files: Mapping[str, bytes], origin: str = "artifact", limits: LoadLimits = DEFAULT_LIMITS
) -> ArtifactContents:
    """Check every file against the config's digests, then parse within ``limits``; refuse
    anything that differs or asks for more (``cuvil.artifact.limits``)."""
    if mt.CONFIG_FILE not in files:
        raise ArtifactError(f"{origin}: missing {mt.CONFIG_FILE}")
    try:
        config = json.loads(files[mt.CONFIG_FILE])
    except json.JSONDecodeError as error:
        raise ArtifactError(f"{origin}: {mt.CONFIG_FILE} is not JSON: {error}") from None
    if config.get("format") != CONFIG_FORMAT:
        raise ArtifactError(
            f"{origin}: config format {config.get('format')!r} is not {CONFIG_FORMAT}"
        )
    recorded = config.get("files", {})
    for name in (mt.GRAPH_FILE, mt.WEIGHTS_FILE):
        if name not in recorded:
            raise ArtifactError(f"{origin}: config does not list {name}")
    for name, entry in recorded.items():
        if name not in files:
            raise ArtifactError(f"{origin}: missing {name}")
        actual = sha256_digest(files[name])
        if actual != entry.get("digest"):
            raise ArtifactError(
                f"{origin}: {name} has digest {actual}, the config records {entry.get('digest')}: "
                "refusing a modified or corrupt artifact"
            )
    check_declared_sizes(config, files, origin)
    try:
        graph_json = json.loads(files[mt.GRAPH_FILE])
        if not isinstance(graph_json, dict):
            raise ValueError(f"{mt.GRAPH_FILE} is not a JSON object")
        check_node_count(graph_json, limits, origin)
        graph = verify_graph(graph_from_json(graph_json))
        check_graph(graph, limits, origin)
        prefill = None
        if mt.PREFILL_GRAPH_FILE in recorded:
            prefill_json = json.loads(files[mt.PREFILL_GRAPH_FILE])
            if not isinstance(prefill_json, dict):
                raise ValueError(f"{mt.PREFILL_GRAPH_FILE} is not a JSON object")
            check_node_count(prefill_json, limits, origin)
            prefill = verify_graph(graph_from_json(prefill_json))
            check_graph(prefill, limits, origin)
        weights = dict(load_safetensors(files[mt.WEIGHTS_FILE]))
        golden = dict(load_safetensors(files[mt.GOLDEN_FILE])) if mt.GOLDEN_FILE in recorded else {}
    except ArtifactError:
        raise
    except (ValueError, RecursionError) as error:
        raise ArtifactError(f"{origin}: {error}") from None
    check_contents(graph, weights, golden, len(files[mt.WEIGHTS_FILE]), limits, origin)
    if prefill is not None:
        check_contents(prefill, weights, golden, len(files[mt.WEIGHTS_FILE]), limits, origin)
    data_files = {name: files[name] for name in mt.TOKENIZER_FILES if name in recorded}
    return ArtifactContents(
        config, graph, weights, golden, files.get(mt.KERNELS_FILE), prefill, data_files
    )


def read_artifact(path: str | Path, limits: LoadLimits = DEFAULT_LIMITS) -> ArtifactContents:
    return decode_files(read_files(path), origin=str(path), limits=limits)

"""Model sources of a ModelCompilation spec -> a model, example inputs and dynamic shapes.

    spec.source  builtin {name}                  a bundled cuvil.models factory
                 huggingface {model, revision, task}   a local directory or the local HF cache
                 pvc {claimName, path}           a HF directory on a mounted volume
                 oci {ref}                        a source bundle (fetched by the caller; see
                                                  ``load_source_bundle``)
                 url                              a source bundle as a tar archive (fetched by
                                                  the caller; see ``cuvil.frontend.url_bundle``)
    spec.inputs / spec.dynamicDims  ->  example inputs (dynamic dims at sizes >= 2, inside their
                 ranges, so that torch.export keeps them symbolic) and ``torch.export.Dim``s.

Everything here reads local files (a caller's fetcher brings ``oci`` and ``url`` bundles in);
nothing runs remote code (no ``trust_remote_code``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.export import Dim

from cuvil.frontend.huggingface import ModelSourceError, load_local, minilm_path

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
# Hub ids that a bundled package can stand in for when the local cache lacks them.
BUNDLED_HUB_IDS: dict[str, Callable[[], Path]] = {
    "sentence-transformers/all-MiniLM-L6-v2": minilm_path,
}
DEFAULT_VOLUMES_DIR = "/var/lib/cuvil/volumes"


class SourceError(ModelSourceError):
    """The spec's source or inputs cannot give a model: a permanent error (never retried)."""


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int | str, ...]


@dataclass
class LoadedSource:
    """A model ready for ``cuvil.jit`` plus what it takes to make more inputs for it."""

    name: str
    model: torch.nn.Module
    example_inputs: Any
    dynamic_shapes: Any
    inputs: tuple[InputSpec, ...] = ()
    dims: dict[str, tuple[int, int]] = field(default_factory=dict)
    vocab_size: int | None = None

    def make_inputs(self, sizes: Mapping[str, int], seed: int = 0) -> dict[str, torch.Tensor]:
        """Inputs with the named dims at ``sizes`` (token ids inside the vocabulary)."""
        generator = torch.Generator().manual_seed(seed)
        return {spec.name: _tensor(spec, sizes, self.vocab_size, generator) for spec in self.inputs}

    def sample_inputs(self, count: int, seed: int = 1, largest: int | None = None) -> list[Any]:
        """``count`` golden input sets: the example first, then sizes drawn inside the ranges
        (each dynamic dim at most ``largest`` where given, but never under its minimum)."""
        samples: list[Any] = [self.example_inputs]
        generator = torch.Generator().manual_seed(seed)
        for index in range(1, count):
            if not self.inputs:
                samples.append(_perturbed(self.example_inputs, generator))
                continue
            bounded = {
                name: (low, high if largest is None else max(low, min(high, largest)))
                for name, (low, high) in self.dims.items()
            }
            sizes = {
                name: int(torch.randint(low, high + 1, (1,), generator=generator))
                for name, (low, high) in bounded.items()
            }
            samples.append(self.make_inputs(sizes, seed=seed + index))
        return samples


def parse_inputs(
    spec: Mapping[str, Any],
) -> tuple[tuple[InputSpec, ...], dict[str, tuple[int, int]]]:
    dims: dict[str, tuple[int, int]] = {}
    for name, bounds in (spec.get("dynamicDims") or {}).items():
        low, high = int(bounds.get("min", 1)), int(bounds.get("max", 2**16))
        if not 1 <= low <= high:
            raise SourceError(f"dynamicDims.{name}: need 1 <= min <= max, got {low}..{high}")
        dims[name] = (low, high)
    inputs = []
    for entry in spec.get("inputs") or []:
        dtype = DTYPES.get(entry.get("dtype", "float32"))
        if dtype is None:
            raise SourceError(f"input {entry.get('name')!r}: dtype {entry.get('dtype')!r} unknown")
        shape = tuple(entry.get("shape") or ())
        for dim in shape:
            if isinstance(dim, str) and dim not in dims:
                raise SourceError(f"input {entry['name']!r}: dim {dim!r} is not in dynamicDims")
        inputs.append(InputSpec(entry["name"], dtype, shape))
    return tuple(inputs), dims


def example_size(low: int, high: int) -> int:
    """torch.export specialises dims seen at 0 or 1: examples stay >= 2 where the range allows."""
    return min(max(low, 2), high)


def dynamic_shapes_for(
    inputs: tuple[InputSpec, ...], dims: Mapping[str, tuple[int, int]]
) -> dict[str, dict[int, Any]]:
    made = {name: Dim(name, min=low, max=high) for name, (low, high) in dims.items() if low < high}
    shapes: dict[str, dict[int, Any]] = {}
    for spec in inputs:
        axes = {i: made[d] for i, d in enumerate(spec.shape) if isinstance(d, str) and d in made}
        shapes[spec.name] = axes
    return shapes


def _tensor(
    spec: InputSpec, sizes: Mapping[str, int], vocab: int | None, generator: torch.Generator
) -> torch.Tensor:
    shape = [d if isinstance(d, int) else sizes[d] for d in spec.shape]
    if spec.dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(spec.dtype)
    if spec.dtype == torch.bool or "mask" in spec.name:
        return torch.ones(shape, dtype=spec.dtype)
    if "type_ids" in spec.name:
        return torch.zeros(shape, dtype=spec.dtype)
    return torch.randint(0, vocab or 2, shape, generator=generator, dtype=spec.dtype)


def _perturbed(example: Any, generator: torch.Generator) -> Any:
    """A fresh input of the example's shapes (for builtin models whose spec lists no inputs)."""
    if isinstance(example, torch.Tensor):
        if example.is_floating_point():
            return torch.randn(example.shape, generator=generator).to(example.dtype)
        return example.clone()
    if isinstance(example, Mapping):
        return {k: _perturbed(v, generator) for k, v in example.items()}
    if isinstance(example, tuple | list):
        return type(example)(_perturbed(v, generator) for v in example)
    return example


def volume_path(claim: str, path: str, root: str | None = None) -> Path:
    """Where a PVC's ``path`` is on this worker: ``$CUVIL_VOLUMES_DIR/<claimName>/<path>``."""
    base = Path(root or os.environ.get("CUVIL_VOLUMES_DIR", DEFAULT_VOLUMES_DIR)) / claim
    resolved = (base / path).resolve()
    if not resolved.is_relative_to(base.resolve()):
        raise SourceError(f"pvc path {path!r} leaves the volume {claim!r}")
    return resolved


def _builtin(source: Mapping[str, Any]) -> tuple[str, torch.nn.Module, Any, Any]:
    from cuvil.models import catalog

    name = str(source.get("name", ""))
    factory = getattr(catalog, name.replace("-", "_"), None)
    if name.startswith("_") or not callable(factory) or name in ("ModelSpec", "MLP", "Dim"):
        raise SourceError(f"no bundled model {name!r}; try mlp, resnet18, resnet50, minilm")
    made = factory()
    return made.name, made.model, made.example_inputs, made.dynamic_shapes


def _huggingface_location(model: str) -> str | Path:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    return model


def _huggingface(source: Mapping[str, Any]) -> tuple[str, torch.nn.Module]:
    model_id = str(source.get("model", ""))
    task = str(source.get("task") or "feature-extraction")
    revision = source.get("revision")
    location = _huggingface_location(model_id)
    try:
        model = load_local(location, task, None if revision in (None, "main") else revision)
    except ModelSourceError:
        if model_id not in BUNDLED_HUB_IDS:
            raise
        model = load_local(BUNDLED_HUB_IDS[model_id](), task)
    return model_id.rstrip("/").rsplit("/", 1)[-1], model


def load_source_bundle(directory: str | Path, class_name: str | None = None) -> torch.nn.Module:
    """A source bundle: ``config.json`` + safetensors weights + a transformers class name
    (``class_name``, else the bundle's, else the config's ``architectures[0]``); never remote
    code (see ``cuvil.frontend.source_bundle`` for the OCI form)."""
    import json

    import transformers

    from cuvil.frontend.source_bundle import bundle_model_class

    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise SourceError(f"source bundle {directory} has no config.json")
    class_name = class_name or bundle_model_class(directory)
    if class_name is None:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
        class_name = architectures[0] if architectures else None
    model_class = getattr(transformers, class_name or "", None)
    if not (
        isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)
    ):
        raise SourceError(f"source bundle class {class_name!r} is not a transformers model class")
    try:
        model = model_class.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError) as error:
        raise SourceError(f"source bundle {directory} does not load: {error}") from None
    return model.eval()


def check_input_names(model: torch.nn.Module, inputs: tuple[InputSpec, ...]) -> None:
    """Refuse ``spec.inputs`` the model's ``forward`` does not take, or that leave out one it
    needs, naming the field (rather than a TypeError from inside torch.export). A forward with
    ``**kwargs`` takes any name, except a transformers model's: its keyword arguments are
    options, not inputs."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = [name for name, p in parameters.items() if p.kind in named]
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if open_ended and not _is_transformers_model(model):
        return
    for index, spec in enumerate(inputs):
        if spec.name not in accepted:
            raise SourceError(
                f"spec.inputs[{index}].name: {type(model).__name__}.forward takes no input "
                f"{spec.name!r}; its inputs are {accepted}"
            )
    given = {spec.name for spec in inputs}
    required = [
        name
        for name, p in parameters.items()
        if p.kind in named and p.default is inspect.Parameter.empty and name not in given
    ]
    if required:
        raise SourceError(
            f"spec.inputs: {type(model).__name__}.forward needs {required}, which are not listed"
        )


def _is_transformers_model(model: torch.nn.Module) -> bool:
    return any(cls.__module__.startswith("transformers.") for cls in type(model).__mro__)


def fetch_bundle(ref: str, folder: Path) -> Path:
    """A source bundle into ``folder``: a URL (``http(s)://``) downloaded as a tar archive,
    anything else pulled as an OCI reference; the fetcher workers and ``cuvil compile`` pass
    to ``load_source``."""
    from cuvil.frontend.source_bundle import fetch_source_bundle
    from cuvil.frontend.url_bundle import fetch_url_bundle

    if ref.startswith(("http://", "https://")):
        return fetch_url_bundle(ref, folder)
    return fetch_source_bundle(ref, folder)


def load_source(
    spec: Mapping[str, Any], *, bundle_fetcher: Callable[[str], Path] | None = None
) -> LoadedSource:
    """The model of a ModelCompilation ``spec`` with its example inputs and dynamic shapes.

    ``bundle_fetcher(ref) -> directory`` brings an ``oci`` source bundle (``ref`` its
    reference) or a ``url`` one (``ref`` the URL) into a folder: the worker passes one that
    pulls from the registry or downloads; without one, both kinds are refused.
    """
    source = spec.get("source") or {}
    kinds = [key for key in ("builtin", "huggingface", "pvc", "oci", "url") if key in source]
    if len(kinds) != 1:
        raise SourceError(
            f"spec.source needs exactly one of builtin/huggingface/pvc/oci/url, "
            f"got {kinds or 'none'}"
        )
    kind, body = kinds[0], source[kinds[0]] or {}
    inputs, dims = parse_inputs(spec)
    if kind == "builtin":
        name, model, example, dynamic = _builtin(body)
        if not inputs:
            return LoadedSource(name, model, example, dynamic)
    elif kind == "huggingface":
        name, model = _huggingface(body)
    elif kind == "pvc":
        path = volume_path(str(body.get("claimName", "")), str(body.get("path", "")))
        name, model = path.name, load_local(path, str(body.get("task") or "feature-extraction"))
    elif kind == "oci":
        if bundle_fetcher is None:
            raise SourceError("oci sources need a registry client (run them on a worker)")
        bundle = bundle_fetcher(str(body.get("ref", "")))
        name, model = bundle.name, load_source_bundle(bundle, body.get("className"))
    else:
        from cuvil.frontend.url_bundle import bundle_name

        if bundle_fetcher is None:
            raise SourceError("url sources need a fetcher (run them on a worker)")
        url = str(body)
        bundle = bundle_fetcher(url)
        name, model = bundle_name(url), load_source_bundle(bundle)
    if not inputs:
        raise SourceError(f"a {kind} source needs spec.inputs (names, dtypes, shapes)")
    check_input_names(model, inputs)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    loaded = LoadedSource(name, model, None, dynamic_shapes_for(inputs, dims), inputs, dims, vocab)
    loaded.example_inputs = loaded.make_inputs({d: example_size(*r) for d, r in dims.items()})
    return loaded

"""The ModelCompilation CRD, as data: the one source of truth for the chart's CRD file.

``python -m cuvil_operator.crd --write`` renders it to ``charts/cuvil/crds/`` (``--check``
fails when that file is stale); tests and the operator's own spec checks read the schema from
here, so the API server and the operator validate the same thing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from cuvil.precisions import PRECISIONS as PRECISION_TABLE
from cuvil.targets import KNOWN_TARGETS

GROUP = "cuvil.dev"
VERSION = "v1alpha1"
PLURAL = "modelcompilations"
SINGULAR = "modelcompilation"
KIND = "ModelCompilation"
SHORT_NAMES = ["mc"]
CRD_NAME = f"{PLURAL}.{GROUP}"
API_VERSION = f"{GROUP}/{VERSION}"

TARGETS = list(KNOWN_TARGETS)
PRECISIONS = ["fp32", "bf16", "fp16", "tf32", "int8"]
DTYPES = ["float32", "float16", "bfloat16", "int64", "int32", "bool"]
BUILTIN_MODELS = ["mlp", "resnet18", "resnet50", "minilm", "tiny_llama"]
PHASES = ["Pending", "Compiling", "Validating", "Pushing", "Succeeded", "Failed"]
CONDITION_TYPES = ["Accepted", "Compiling", "Validated", "Pushed", "Ready", "Promoted"]

CHART_CRD_PATH = Path("charts/cuvil/crds") / f"{CRD_NAME}.yaml"

_NAME = "^[A-Za-z_][A-Za-z0-9_]*$"


def _string(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _number(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "number", "description": description, **extra}


def _defaults(field: str) -> str:
    """A validation tolerance's default per precision, for its description."""
    return ", ".join(f"{name} {getattr(p, field):g}" for name, p in PRECISION_TABLE.items())


def _object(description: str, properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "description": description, "properties": properties, **extra}


def build_source_schema() -> dict[str, Any]:
    hf = _object(
        "A HuggingFace model id, resolved from the worker's local cache (never downloaded).",
        {
            "model": _string(
                "Model id, e.g. sentence-transformers/all-MiniLM-L6-v2.",
                minLength=1,
                maxLength=256,
                pattern=r"^[\w.-]+(/[\w.-]+)?$",
            ),
            "revision": _string("Revision (branch, tag or commit).", default="main", maxLength=128),
            "task": _string(
                "Pipeline task the model is exported for.",
                maxLength=64,
                default="feature-extraction",
            ),
        },
        required=["model"],
    )
    oci = _object(
        "A source bundle in an OCI registry (config.json + safetensors + class).",
        {
            "ref": _string("Reference, by digest preferred.", minLength=1, maxLength=512),
            "className": _string(
                "transformers class (default: config architectures[0]).", maxLength=128
            ),
        },
        required=["ref"],
    )
    pvc = _object(
        "A HuggingFace directory on a PersistentVolumeClaim mounted by the workers.",
        {
            "claimName": _string(
                "PVC name (a DNS-1123 subdomain: it names a folder on the worker).",
                minLength=1,
                maxLength=253,
                pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
            ),
            "path": _string("Directory inside the volume.", minLength=1, maxLength=1024),
            "task": _string(
                "Pipeline task the model is exported for.",
                maxLength=64,
                default="feature-extraction",
            ),
        },
        required=["claimName", "path"],
    )
    builtin = _object(
        "A model bundled with cuvil (cuvil.models).",
        {"name": _string("Factory name.", enum=BUILTIN_MODELS)},
        required=["name"],
    )
    return _object(
        "Where the model comes from: exactly one of huggingface, oci, url, pvc, builtin.",
        {
            "huggingface": hf,
            "oci": oci,
            "url": _string(
                "An http(s) URL of a source bundle as a tar archive (config.json,"
                " *.safetensors, *.txt; optionally #sha256=<hex> pinning its digest). Only"
                " under the URL prefixes the chart's operator.pushPolicy.urls allows the"
                " namespace; redirects are not followed.",
                pattern="^https?://",
                maxLength=2048,
            ),
            "pvc": pvc,
            "builtin": builtin,
        },
        minProperties=1,
        maxProperties=1,
    )


def build_spec_schema() -> dict[str, Any]:
    dim: dict[str, Any] = {
        "x-kubernetes-int-or-string": True,
        "description": "A fixed size (integer) or the name of a dim in dynamicDims.",
    }
    input_item = _object(
        "One named model input.",
        {
            "name": _string(
                "Input name, as the model's forward() takes it.", pattern=_NAME, maxLength=128
            ),
            "dtype": _string("Element type.", enum=DTYPES),
            "shape": {
                "type": "array",
                "description": "Dims, outermost first.",
                "items": dim,
                "minItems": 0,
                "maxItems": 8,
            },
        },
        required=["name", "dtype", "shape"],
    )
    bounds = _object(
        "Bounds of one symbolic dim (inclusive).",
        {
            "min": {
                "type": "integer",
                "minimum": 1,
                "maximum": 1048576,
                "description": "Smallest size the artifact accepts.",
            },
            "max": {
                "type": "integer",
                "minimum": 1,
                "maximum": 1048576,
                "description": "Largest size the artifact accepts.",
            },
        },
        required=["min", "max"],
    )
    names = {
        "type": "array",
        "items": {
            "type": "string",
            "minLength": 1,
            "maxLength": 128,
            "description": "A pass name.",
        },
        "maxItems": 64,
        "x-kubernetes-list-type": "set",
    }
    return _object(
        "What to compile, for which targets, how to check it and where to push it.",
        {
            "source": build_source_schema(),
            "inputs": {
                "type": "array",
                "description": "The model's inputs.",
                "items": input_item,
                "minItems": 1,
                "maxItems": 32,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["name"],
            },
            "dynamicDims": {
                "type": "object",
                "description": "Symbolic dims: name -> bounds.",
                "additionalProperties": bounds,
                "maxProperties": 16,
            },
            "targets": {
                "type": "array",
                "description": "One artifact per target.",
                "items": _string("A compile target.", enum=TARGETS),
                "minItems": 1,
                "maxItems": len(TARGETS),
                "x-kubernetes-list-type": "set",
            },
            "precision": _string("Compute precision.", enum=PRECISIONS, default="fp32"),
            "passes": _object(
                "Optimisation passes to force on or off, and custom rewrite patterns.",
                {
                    "enable": {**names, "description": "Passes to run even where off by default."},
                    "disable": {**names, "description": "Passes to leave out."},
                    "custom": {
                        "type": "array",
                        "maxItems": 64,
                        "description": "User rewrite patterns (pattern, replacement, condition).",
                        "items": {
                            "type": "object",
                            "description": "One rewrite pattern, as cuvil.patterns reads it.",
                            "x-kubernetes-preserve-unknown-fields": True,
                        },
                    },
                },
            ),
            "validation": _object(
                "Numerical check of the compiled model against eager fp32.",
                {
                    "samples": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": 1024,
                        "default": 4,
                        "description": "Golden inputs compared with eager fp32.",
                    },
                    "rtol": _number(
                        f"Relative tolerance (default {_defaults('rtol')}).", minimum=0
                    ),
                    "atol": _number(
                        "Absolute tolerance: an element passes within atol + rtol * |eager|. A"
                        " value given is absolute; the default is times the output's scale"
                        f" (max |eager|, at least 1): {_defaults('atol')}.",
                        minimum=0,
                    ),
                },
            ),
            "gates": _object(
                "Thresholds a compile must meet before it is pushed.",
                {
                    "maxAbsError": _number("Largest absolute error allowed.", minimum=0),
                    "maxRelativeError": _number(
                        "Largest error relative to the output's scale.", minimum=0
                    ),
                    "minCosine": _number(
                        "Smallest cosine similarity allowed.", minimum=0, maximum=1
                    ),
                    "minSpeedup": _number("Smallest speedup over eager allowed.", minimum=0),
                    "maxLatencyP99Ms": _number("Largest p99 latency allowed (ms).", minimum=0),
                },
            ),
            "output": _object(
                "Where the artifacts are pushed.",
                {
                    "repository": _string(
                        "host[:port]/path, without tag or digest.", minLength=1, maxLength=255
                    ),
                    "tag": _string(
                        "Tag of the index.",
                        default="latest",
                        pattern=r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$",
                    ),
                    "pushSecretRef": _object(
                        "A docker-config Secret with push credentials.",
                        {"name": _string("Secret name.", minLength=1, maxLength=253)},
                        required=["name"],
                    ),
                },
                required=["repository"],
            ),
            "queue": _string(
                "Celery queue override (default: one queue per target).",
                pattern=r"^[A-Za-z0-9._-]*$",
                maxLength=128,
            ),
            "timeout": {
                "x-kubernetes-int-or-string": True,
                "pattern": r"^[0-9]+(s|m|h)?$",
                "description": "Fail the compile if no worker has started it by then"
                " (seconds, or 90s / 30m / 2h; default 24h).",
            },
        },
        required=["source", "inputs", "targets", "output"],
    )


def build_condition_schema() -> dict[str, Any]:
    return _object(
        "A standard Kubernetes condition.",
        {
            "type": _string("Condition type.", maxLength=316),
            "status": _string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": _string("CamelCase reason.", maxLength=1024),
            "message": _string("Human-readable detail.", maxLength=32768),
            "observedGeneration": {
                "type": "integer",
                "minimum": 0,
                "description": "The generation this condition describes.",
            },
            "lastTransitionTime": _string("When status last changed.", format="date-time"),
        },
        required=["type", "status", "lastTransitionTime"],
    )


def build_status_schema() -> dict[str, Any]:
    ref = {"ref": _string("Reference with digest."), "digest": _string("sha256:…")}
    artifact = _object(
        "One per-target artifact.",
        {
            "target": _string("Compile target."),
            **ref,
            "size": {"type": "integer", "minimum": 0, "description": "Bytes."},
        },
    )
    return _object(
        "What the operator observed.",
        {
            "phase": _string("Where the compilation is.", enum=PHASES),
            "observedGeneration": {
                "type": "integer",
                "minimum": 0,
                "description": "The generation the status describes.",
            },
            "taskId": _string("The Celery chord id the operator follows."),
            "attempt": {
                "type": "integer",
                "minimum": 0,
                "description": "Retries of this generation (the cuvil.dev/retry annotation).",
            },
            "retry": _string("The cuvil.dev/retry value last acted on."),
            "queuedAt": _string("When this attempt was queued.", format="date-time"),
            "faultSince": _string(
                "Since when a target has been retrying a registry fault.", format="date-time"
            ),
            "stalled": _string("The stall the compile is in: NoWorker, RegistryFault, Timeout."),
            "traceId": _string("The OpenTelemetry trace of this generation's compile."),
            "conditions": {
                "type": "array",
                "description": "Accepted, Compiling, Validated, Pushed, Ready, Promoted"
                " (API conventions).",
                "items": build_condition_schema(),
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "stages": {
                "type": "object",
                "description": "Pipeline stage per target.",
                "additionalProperties": {"type": "string", "description": "The stage now."},
            },
            "artifacts": {
                "type": "array",
                "description": "One per target: manifest digest and the artifact's size.",
                "items": artifact,
            },
            "index": _object("The OCI image index over the targets.", ref),
            "digest": _string("The digest to pull: the index's, else the only artifact's."),
            "targetCount": {"type": "integer", "minimum": 0, "description": "Targets compiled."},
            "speedup": _string("The slowest target's speedup over eager, e.g. 1.84x cpu-x86_64."),
            "report": {
                "type": "object",
                "description": "Speedup, latency, memory, errors.",
                "x-kubernetes-preserve-unknown-fields": True,
            },
            "message": _string("Last notable message (errors name the spec field)."),
            "serving": {
                "type": "array",
                "description": "Pods with an injected sidecar, per pinned reference.",
                "items": _object(
                    "The pods pinned to one reference.",
                    {
                        "ref": _string("The reference, pinned by digest."),
                        "pods": {"type": "integer", "minimum": 0, "description": "Pods."},
                        "ready": {"type": "integer", "minimum": 0, "description": "Ready pods."},
                    },
                ),
            },
            "promoted": build_served_schema("The generation served: its gates passed."),
            "candidate": build_served_schema(
                "A succeeded generation whose speed gates wait for a measurement where it runs."
            ),
        },
    )


def build_served_schema(description: str) -> dict[str, Any]:
    """``status.promoted`` / ``status.candidate``: what injected sidecars are pinned to."""
    return _object(
        description,
        {
            "generation": {"type": "integer", "minimum": 0, "description": "Its generation."},
            "ref": _string("The index (or only artifact), pinned by digest."),
            "digest": _string("sha256:…"),
            "targets": {
                "type": "object",
                "description": "Each target's own manifest, pinned by digest.",
                "additionalProperties": {"type": "string", "description": "Reference."},
            },
            "since": _string("When it was promoted.", format="date-time"),
            "awaiting": {
                "type": "object",
                "description": "A candidate's deferred gates: target -> gate -> limit.",
                "additionalProperties": {
                    "type": "object",
                    "description": "Gate -> limit.",
                    "additionalProperties": {"type": "number", "description": "The limit."},
                },
            },
            "measured": {
                "type": "object",
                "description": "A candidate's measurements so far (cuvil.dev/measurement).",
                "x-kubernetes-preserve-unknown-fields": True,
            },
        },
    )


READY = '.status.conditions[?(@.type=="Ready")].status'
PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": READY},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Targets", "type": "integer", "jsonPath": ".status.targetCount"},
    {"name": "Speedup", "type": "string", "jsonPath": ".status.speedup",
     "description": "The slowest target's speedup over eager, and that target."},
    {"name": "Served", "type": "integer", "jsonPath": ".status.promoted.generation",
     "description": "The generation injected sidecars are pinned to (status.promoted)."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Promoted", "type": "string", "jsonPath": ".status.promoted.digest", "priority": 1},
    {"name": "Digest", "type": "string", "jsonPath": ".status.digest", "priority": 1},
    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},
]  # fmt: skip


def build_crd() -> dict[str, Any]:
    schema = _object(
        "ModelCompilation: compile a model into verified per-target artifacts in OCI.",
        {
            "apiVersion": _string("cuvil.dev/v1alpha1."),
            "kind": _string("ModelCompilation."),
            "metadata": {"type": "object", "description": "Standard object metadata."},
            "spec": build_spec_schema(),
            "status": build_status_schema(),
        },
        required=["spec"],
    )
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "cuvil"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": PLURAL,
                "singular": SINGULAR,
                "kind": KIND,
                "listKind": f"{KIND}List",
                "shortNames": SHORT_NAMES,
                "categories": ["cuvil"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def spec_schema() -> dict[str, Any]:
    """The spec's OpenAPI schema, as served by the CRD (for jsonschema checks)."""
    version = build_crd()["spec"]["versions"][0]
    return dict(version["schema"]["openAPIV3Schema"]["properties"]["spec"])


def render_crd() -> str:
    header = (
        "# Generated by `python -m cuvil_operator.crd --write` from "
        "operator/cuvil_operator/crd.py: edit that, not this.\n"
    )
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {CHART_CRD_PATH}")
    parser.add_argument("--check", action="store_true", help=f"fail if {CHART_CRD_PATH} is stale")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository root")
    args = parser.parse_args(argv)
    path = args.root / CHART_CRD_PATH
    text = render_crd()
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is stale: run python -m cuvil_operator.crd --write", file=sys.stderr)
            return 1
        return 0
    if args.write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

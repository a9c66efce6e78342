"""Spec checks the operator runs before it submits anything.

First the CRD's own OpenAPI schema (an API server enforces it too, but a spec may come through
one that does not), then what a schema cannot say: dims named in ``inputs`` are declared in
``dynamicDims``, bounds are ordered, the output repository parses. Each problem names its field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import jsonschema

from cuvil.source_urls import url_problem
from cuvil_operator.crd import TARGETS, spec_schema

# OCI distribution reference grammar (distribution/reference), repository part only.
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:]+\])"  # noqa: E501
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REPOSITORY = re.compile(rf"^{_HOST}(?::[0-9]+)?/{_COMPONENT}(?:/{_COMPONENT})*$")
DIM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class SpecProblem:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@cache
def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(spec_schema())


def _field_path(path: Any) -> str:
    text = "spec"
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def check_schema(spec: Mapping[str, Any]) -> list[SpecProblem]:
    errors = sorted(_validator().iter_errors(dict(spec)), key=lambda e: list(e.absolute_path))
    return [SpecProblem(_field_path(e.absolute_path), e.message) for e in errors]


def check_shapes(spec: Mapping[str, Any]) -> list[SpecProblem]:
    problems: list[SpecProblem] = []
    dims: Mapping[str, Any] = spec.get("dynamicDims") or {}
    for name, bounds in dims.items():
        field = f"spec.dynamicDims.{name}"
        if not DIM_NAME.match(name):
            problems.append(SpecProblem(field, "a dim name must be an identifier"))
        if isinstance(bounds, Mapping) and bounds.get("min", 1) > bounds.get("max", 1):
            problems.append(SpecProblem(field, f"min {bounds['min']} > max {bounds['max']}"))
    used: set[str] = set()
    for i, item in enumerate(spec.get("inputs") or []):
        for j, dim in enumerate(item.get("shape") or []):
            field = f"spec.inputs[{i}].shape[{j}]"
            if isinstance(dim, bool) or not isinstance(dim, int | str):
                problems.append(SpecProblem(field, f"{dim!r} is neither a size nor a dim name"))
            elif isinstance(dim, int) and dim < 1:
                problems.append(SpecProblem(field, f"size {dim} must be at least 1"))
            elif isinstance(dim, str) and dim not in dims:
                declared = ", ".join(sorted(dims)) or "none"
                problems.append(
                    SpecProblem(
                        field, f"dim {dim!r} is not declared in spec.dynamicDims ({declared})"
                    )
                )
            elif isinstance(dim, str):
                used.add(dim)
    for name in sorted(set(dims) - used):
        problems.append(SpecProblem(f"spec.dynamicDims.{name}", "declared but no input uses it"))
    return problems


def check_targets(spec: Mapping[str, Any]) -> list[SpecProblem]:
    targets = list(spec.get("targets") or [])
    problems = [
        SpecProblem(f"spec.targets[{i}]", f"unknown target {t!r}; known: {', '.join(TARGETS)}")
        for i, t in enumerate(targets)
        if t not in TARGETS
    ]
    if len(set(targets)) != len(targets):
        problems.append(SpecProblem("spec.targets", "a target is listed twice"))
    precision = spec.get("precision")
    if precision in ("fp16", "tf32") and any(str(t).startswith("cpu") for t in targets):
        problems.append(
            SpecProblem("spec.precision", f"{precision} is for cuda targets; use bf16 on cpu")
        )
    if precision == "int8" and any(str(t).startswith("cuda") for t in targets):
        problems.append(
            SpecProblem("spec.precision", "int8 is for cpu targets; use bf16 or fp16 on cuda")
        )
    return problems


def check_output(spec: Mapping[str, Any]) -> list[SpecProblem]:
    repository = str((spec.get("output") or {}).get("repository") or "")
    if not repository:
        return []  # the schema reports the missing field
    if "@" in repository or REPOSITORY.match(repository) is None:
        return [
            SpecProblem(
                "spec.output.repository",
                f"{repository!r} is not host[:port]/path (lowercase path, no tag or digest;"
                " the tag goes in spec.output.tag)",
            )
        ]
    return []


def check_source(spec: Mapping[str, Any]) -> list[SpecProblem]:
    source = spec.get("source") or {}
    if "url" in source:
        problem = url_problem(str(source["url"]))
        return [SpecProblem("spec.source.url", problem)] if problem else []
    pvc = source.get("pvc") or {}
    path = str(pvc.get("path") or "")
    if path.startswith("/") or ".." in path.split("/"):
        return [SpecProblem("spec.source.pvc.path", "must be relative, without '..'")]
    return []


def check_spec(spec: Mapping[str, Any]) -> list[SpecProblem]:
    """Every problem with ``spec``; empty when it may be submitted."""
    problems = check_schema(spec)
    if problems:
        return problems
    return check_shapes(spec) + check_targets(spec) + check_output(spec) + check_source(spec)

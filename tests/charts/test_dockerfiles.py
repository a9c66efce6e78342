"""The three Dockerfiles (docker cannot run here): base image, non-root user matching the chart,
pinned CPU torch for worker and sidecar, extras that exist, and an operator image without torch
that still holds everything the operator imports."""

from __future__ import annotations

import ast
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.charts.conftest import CHART, ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
IMAGES = {
    "operator/Dockerfile": "cuvil-operator",
    "compiler_worker/Dockerfile": "cuvil-worker",
    "runtime_sidecar/Dockerfile": "cuvil-sidecar",
}
# what the operator image installs, by import name -> distribution
OPERATOR_IMPORTS = {
    "kopf": "kopf",
    "celery": "celery",
    "kombu": "celery",
    "redis": "redis",
    "jsonschema": "jsonschema",
    "yaml": "pyyaml",
    "opentelemetry": "opentelemetry-sdk",  # and the OTLP exporter: the trace's root span
}
OPERATOR_EXTRA_DISTRIBUTIONS = {"opentelemetry-exporter-otlp-proto-grpc"}


def _instructions(path: str) -> list[tuple[str, str]]:
    text = (ROOT / path).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return [tuple(line.split(None, 1)) for line in lines if not line.startswith("#")]  # type: ignore[misc]


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_image_basics(path: str) -> None:
    steps = _instructions(path)
    assert [arg for op, arg in steps if op == "FROM"][-1] == "python:3.11-slim"
    user = [arg for op, arg in steps if op == "USER"][-1]
    uid = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]["runAsUser"]
    assert user == f"{uid}:{uid}", "numeric non-root user, the chart's runAsUser"
    entrypoint = [arg for op, arg in steps if op == "ENTRYPOINT"][-1]
    script = yaml.safe_load(entrypoint)[0]
    assert script == IMAGES[path] and script in PYPROJECT["project"]["scripts"]


def test_operator_image_has_no_torch_but_every_operator_import() -> None:
    text = (ROOT / "operator/Dockerfile").read_text()
    # the build itself fails if anything pulled torch in
    assert "sys.exit(u.find_spec('torch') is not None)" in text
    installs = [arg for op, arg in _instructions("operator/Dockerfile") if op == "RUN"]
    requirements = [
        word
        for run in installs
        for word in shlex.split(run)
        if re.match(r"^[A-Za-z][\w.\[\]-]*[<>=]=?", word)
    ]
    listed = {re.split(r"[\[<>=]", req)[0].lower() for req in requirements}
    assert listed == set(OPERATOR_IMPORTS.values()) | OPERATOR_EXTRA_DISTRIBUTIONS
    declared = str(PYPROJECT["project"])
    for requirement in requirements:  # same floors as pyproject.toml
        assert requirement in declared or requirement.lower() in declared.lower(), requirement
    third_party = _imports_of(ROOT / "operator" / "cuvil_operator")
    assert third_party <= set(OPERATOR_IMPORTS), third_party - set(OPERATOR_IMPORTS)


LIGHT_MODULES = ("cuvil.targets", "cuvil.precisions", "cuvil.source_urls", "cuvil.entry_point")


def _imports_of(package: Path) -> set[str]:
    """Third-party top-level modules the package imports, following its cuvil_* imports."""
    seen: set[Path] = set()
    found: set[str] = set()
    queue = list(package.glob("*.py"))
    roots = {"cuvil_operator": ROOT / "operator", "cuvil_worker": ROOT / "compiler_worker"}
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in roots:
                    module = roots[top].joinpath(*name.split("."))
                    queue += [
                        p for p in (module.with_suffix(".py"), module / "__init__.py") if p.exists()
                    ]
                elif name in LIGHT_MODULES:  # cuvil's vocabulary, read without torch
                    queue.append(ROOT.joinpath(*name.split(".")).with_suffix(".py"))
                elif top == "cuvil":
                    found.add(top)  # the compiler: never in the operator image
                elif top not in sys.stdlib_module_names and top != "__future__":
                    found.add(top)
    return found


@pytest.mark.parametrize(
    ("path", "extras"),
    [
        ("compiler_worker/Dockerfile", "worker,oci,telemetry,models"),
        ("runtime_sidecar/Dockerfile", "sidecar,oci,telemetry"),
    ],
)
def test_torch_images_pin_cpu_torch_and_install_real_extras(path: str, extras: str) -> None:
    text = (ROOT / path).read_text()
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert '"torch==2.13.0"' in text
    assert "torch==2.13.0" in PYPROJECT["project"]["dependencies"]
    assert f"ARG EXTRAS={extras}" in text
    for extra in extras.split(","):
        assert extra in PYPROJECT["project"]["optional-dependencies"], extra
    # torch is installed before the project, so the resolver never picks a CUDA build
    assert text.index('"torch==2.13.0"') < text.index("cuvil[${EXTRAS}]")


@pytest.mark.parametrize("path", ["compiler_worker/Dockerfile", "runtime_sidecar/Dockerfile"])
def test_torch_images_carry_portable_native_kernels(path: str) -> None:
    """Built at image build time for a portable level, in a cache the image keeps; the compiler
    leaves again (cuvil/backends/cpu/native: a library is looked up by source, flags and level)."""
    text = (ROOT / path).read_text()
    assert "ENV CUVIL_NATIVE_MARCH=x86-64-v3 CUVIL_NATIVE_CACHE=/opt/cuvil/native" in text
    runs = [arg for op, arg in _instructions(path) if op == "RUN"]
    build = next(run for run in runs if "python -m cuvil.backends.cpu.native" in run)
    assert build.index("apt-get install") < build.index("python -m cuvil.backends.cpu.native")
    assert build.index("python -m cuvil.backends.cpu.native") < build.index("apt-get purge -y gcc")
    # a compiler for every language the native sources are written in, installed then purged
    native = ROOT / "cuvil" / "backends" / "cpu" / "native"
    compilers = {".c": "gcc", ".cc": "g++"}
    needed = {compilers[source.suffix] for source in native.iterdir() if source.suffix in compilers}
    assert needed == {"gcc", "g++"}
    before, purge = build.split("apt-get purge -y", 1)
    installs = before.split("apt-get install")[1:]
    installed = {word for install in installs for word in install.split("&&", 1)[0].split()}
    assert needed <= installed
    assert needed <= set(purge.split("&&", 1)[0].split())
    assert text.index("CUVIL_NATIVE_MARCH") > text.index("cuvil[${EXTRAS}]")

"""The backend seam: one table names the backends, each implements every fused op (or declares
a fallback), target names parse in one place, and a backend's kernels layer goes through
codegen -> artifact -> load into the plan."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch

import cuvil
from cuvil import backends
from cuvil.allowed_ops import ALLOWED_ATEN_OPS
from cuvil.artifact.files import ArtifactError
from cuvil.artifact.kernels_layer import pack_kernels, unpack_kernels
from cuvil.backends import BACKENDS, TargetUnavailableError, backend_for
from cuvil.backends.cpu.backend import CpuBackend
from cuvil.backends.cpu.kernels import linear_kernel
from cuvil.backends.cuda.backend import CudaBackend
from cuvil.fused_ops import FUSED_OPS, LINEAR
from cuvil.ir import Graph
from cuvil.precisions import PRECISIONS
from cuvil.runtime.kernels import FusedCall, KernelFactory, PreparedKernel
from cuvil.targets import KNOWN_TARGETS, TargetError, parse_target


@pytest.fixture
def fresh_backends() -> Iterator[None]:
    backends._backend.cache_clear()
    yield
    backends._backend.cache_clear()


@pytest.mark.parametrize("family", sorted(BACKENDS))
def test_every_backend_implements_every_fused_op_or_declares_a_fallback(family: str) -> None:
    backend = backend_for(family)
    kernels, fallbacks = set(backend.kernels), set(backend.fallbacks)
    implemented = kernels & set(FUSED_OPS)
    assert implemented | fallbacks == set(FUSED_OPS), set(FUSED_OPS) - implemented - fallbacks
    assert kernels - implemented <= set(ALLOWED_ATEN_OPS), kernels - implemented
    assert not implemented & fallbacks
    assert "fp32" in backend.lowering.precisions
    assert set(backend.lowering.precisions) <= set(PRECISIONS)


def test_a_target_picks_its_backend_by_family() -> None:
    for name in ("cpu", "cpu-x86_64", "cpu-x86_64-amx", "cpu-aarch64"):
        backend = backend_for(name)
        assert isinstance(backend, CpuBackend) and backend.target.name == name
        assert backend.device == torch.device("cpu")
    for name in ("cuda-sm_80", "cuda-sm_87", "cuda-sm_90"):
        backend = backend_for(name)
        assert isinstance(backend, CudaBackend) and backend.target.name == name
        backend.check_compile()  # Triton, no GPU
    with pytest.raises(TargetUnavailableError, match="one architecture"):
        backend_for("cuda").check_compile()
    with pytest.raises(TargetUnavailableError, match="one architecture"):
        backend_for("cuda-sm_75").check_compile()


def test_a_machine_without_triton_cannot_compile_for_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    with pytest.raises(TargetUnavailableError, match=r"needs Triton .*no GPU is needed"):
        backend_for("cuda-sm_90").check_compile()


@pytest.mark.parametrize("name", KNOWN_TARGETS)
def test_every_known_target_parses(name: str) -> None:
    target = parse_target(name)
    assert target.family in ("cpu", "cuda") and target.queue.startswith("cuvil.")


def test_target_vocabulary() -> None:
    assert parse_target("cuda-sm_90").compute_capability == (9, 0)
    assert parse_target("cuda-sm_87").queue == "cuvil.cuda.sm_87"
    assert parse_target("cpu-x86_64-amx").cpu_isa == "amx"
    assert parse_target("cpu-x86_64-amx").queue == "cuvil.cpu"
    for bad in ("tpu-v5", "cpu-sparc", "cpu-aarch64-amx", "cuda-sm90", "cuda-ampere", ""):
        with pytest.raises(TargetError):
            parse_target(bad)


def test_the_compiler_refuses_a_precision_the_backend_does_not_compile() -> None:
    with pytest.raises(ValueError, match="fp16"):
        cuvil.jit(torch.nn.Linear(4, 4).eval(), (torch.randn(2, 4),), precision="fp16")


# -- the kernels layer, through a backend that writes one

LOADED: list[dict[str, float]] = []


class LayerBackend(CpuBackend):
    """The CPU backend plus a kernels layer: one JSON file that its linear factory reads back."""

    def codegen(self, graph: Graph, weights: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
        linears = [node.name for node in graph.nodes if node.op == LINEAR]
        return {"linears.json": json.dumps({"count": len(linears)}).encode()}

    def load_kernels(self, files: Mapping[str, bytes]) -> Mapping[str, KernelFactory]:
        manifest = json.loads(files["linears.json"])

        def linear(call: FusedCall) -> PreparedKernel:
            LOADED.append(manifest)
            return linear_kernel(call)

        return {LINEAR: linear}


def test_a_kernels_layer_is_written_by_codegen_and_read_by_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_backends: None
) -> None:
    monkeypatch.setitem(BACKENDS, "cpu", f"{__name__}:LayerBackend")
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x = torch.randn(2, 6)
    LOADED.clear()
    compiled = cuvil.jit(model.eval(), (x,))
    assert LOADED == [{"count": 2}, {"count": 2}]  # the compile's own plan used the layer
    assert "codegen" in [stage["name"] for stage in compiled.report["stages"]]
    path = compiled.save(tmp_path / "model.cuvil")
    with tarfile.open(path) as tar:
        assert "kernels.tar" in tar.getnames()
    LOADED.clear()
    loaded = cuvil.load(path)
    assert LOADED == [{"count": 2}, {"count": 2}]
    torch.testing.assert_close(loaded(x), model(x))


def test_the_cpu_backend_writes_no_kernels_layer(tmp_path: Path) -> None:
    compiled = cuvil.jit(torch.nn.Linear(4, 2).eval(), (torch.randn(2, 4),))
    with tarfile.open(compiled.save(tmp_path / "model.cuvil")) as tar:
        assert "kernels.tar" not in tar.getnames()


def test_a_kernels_layer_holds_plain_files_only() -> None:
    files = {"a.cubin": b"\x7fELF", "a.json": b"{}"}
    assert unpack_kernels(pack_kernels(files)) == files
    assert pack_kernels({}) is None and unpack_kernels(None) == {}
    with pytest.raises(ArtifactError, match="plain file name"):
        pack_kernels({"../escape": b""})
    import io

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        link = tarfile.TarInfo("kernel.cubin")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    with pytest.raises(ArtifactError, match="not a plain file"):
        unpack_kernels(buffer.getvalue())

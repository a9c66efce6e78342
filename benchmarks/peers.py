"""One small runner per peer of the CPU benchmark, and the table name -> runner.

``benchmarks/cpu_models.py`` builds a Case (model, inputs at the benchmark shape), asks a runner
here to prepare it (compile, export, convert: timed as ``setup_seconds``), then times
``Prepared.call`` itself. Each runner imports its framework lazily, so a missing package fails
only that peer's row.

Peers other than Cuvil are prepared at the exact benchmark shape (static), which is their best
case; Cuvil is compiled once from the model's example inputs with its dynamic ranges.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cuvil.models.catalog import ModelSpec


@dataclass
class Case:
    """One benchmark line: a bundled model and its inputs at the benchmark shape."""

    name: str
    spec: ModelSpec
    inputs: dict[str, torch.Tensor]
    threads: int
    workdir: Path


@dataclass
class Prepared:
    """A ready peer: ``call()`` runs one inference; ``output(result)`` -> its first tensor."""

    call: Callable[[], Any]
    output: Callable[[Any], torch.Tensor]
    setup_seconds: float
    precision: str
    info: dict[str, Any] = field(default_factory=dict)


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """A model's outputs (tensor, tuple, dict, HF ModelOutput) as a flat list of tensors."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, np.ndarray):
        return [torch.from_numpy(np.array(value))]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, tuple | list):
        return [tensor for item in value for tensor in flat_tensors(item)]
    return []


def first_tensor(value: Any) -> torch.Tensor:
    tensors = flat_tensors(value)
    if not tensors:
        raise TypeError(f"no tensor in the output ({type(value).__name__})")
    return tensors[0].detach().float()


class Positional(torch.nn.Module):
    """Keyword inputs -> positional, outputs -> a flat tuple: what exporters want."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(flat_tensors(self.model(**dict(zip(self.names, args, strict=True)))))


def _timed(build: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    built = build()
    return built, time.perf_counter() - start


def prepare_eager(case: Case) -> Prepared:
    model, inputs = case.spec.model, case.inputs

    def call() -> Any:
        with torch.inference_mode():
            return model(**inputs)

    return Prepared(call, first_tensor, 0.0, "fp32")


def _prepare_torch_compile(case: Case, precision: str) -> Prepared:
    import torch._dynamo
    import torch._inductor.config

    # freezing folds weights into constants and prepacks them for oneDNN: without it
    # torch.compile on CPU is far slower. It only takes effect under no_grad.
    torch._inductor.config.freezing = True
    torch._dynamo.reset()  # fresh guards: no dynamic-shape recompile across cases
    compiled = torch.compile(case.spec.model, dynamic=False)
    inputs = case.inputs

    def call() -> Any:
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            return compiled(**inputs)

    _, seconds = _timed(call)  # the first call compiles
    return Prepared(call, first_tensor, seconds, precision, {"autocast": precision == "bf16"})


def prepare_torch_compile_fp32(case: Case) -> Prepared:
    return _prepare_torch_compile(case, "fp32")


def prepare_torch_compile_bf16(case: Case) -> Prepared:
    return _prepare_torch_compile(case, "bf16")


def export_onnx(case: Case) -> tuple[Path, str]:
    """The TorchScript exporter where it works (fast), else the torch.export-based one."""
    names = list(case.inputs)
    wrapper = Positional(case.spec.model, names).eval()
    args = tuple(case.inputs.values())
    path = case.workdir / f"{case.name}.onnx"
    errors = []
    for exporter, dynamo in (("torchscript", False), ("dynamo", True)):
        try:
            with torch.no_grad():
                torch.onnx.export(wrapper, args, str(path), dynamo=dynamo, input_names=names)
            return path, exporter
        except Exception as error:
            errors.append(f"{exporter}: {type(error).__name__}: {str(error)[:200]}")
    raise RuntimeError("ONNX export failed; " + " | ".join(errors))


def ort_session_options(case: Case) -> Any:
    """ONNX Runtime's options for a case: its threads, all graph optimisations, no spinning."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = case.threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # spinning intra-op threads would slow down whatever runs next in this process
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def prepare_onnxruntime(case: Case) -> Prepared:
    import onnxruntime as ort

    start = time.perf_counter()
    path, exporter = export_onnx(case)
    options = ort_session_options(case)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    seconds = time.perf_counter() - start
    feed = {name: tensor.numpy() for name, tensor in case.inputs.items()}

    def call() -> Any:
        return session.run(None, feed)

    info = {"exporter": exporter, "version": ort.__version__}
    return Prepared(call, first_tensor, seconds, "fp32", info)


def _convert_openvino(case: Case) -> tuple[Any, str]:
    """OpenVINO's PyTorch frontend (TorchScript tracing), else via torch.export."""
    import openvino as ov

    wrapper = Positional(case.spec.model, list(case.inputs)).eval()
    args = tuple(case.inputs.values())
    try:
        with torch.no_grad():
            return ov.convert_model(wrapper, example_input=args), "torchscript"
    except Exception:
        with torch.no_grad():
            exported = torch.export.export(wrapper, args)
        return ov.convert_model(exported), "torch.export"


def _prepare_openvino(case: Case, precision: str) -> Prepared:
    import openvino as ov

    start = time.perf_counter()
    model, converter = _convert_openvino(case)
    config = {
        # OpenVINO runs bf16 by default on AMX CPUs: fp32 figures need the hint set explicitly
        "INFERENCE_PRECISION_HINT": {"fp32": "f32", "bf16": "bf16"}[precision],
        "INFERENCE_NUM_THREADS": case.threads,
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1,
    }
    compiled = ov.Core().compile_model(model, "CPU", config)
    request = compiled.create_infer_request()
    seconds = time.perf_counter() - start
    feed = [tensor.numpy() for tensor in case.inputs.values()]

    def call() -> Any:
        return request.infer(feed)

    def output(result: Any) -> torch.Tensor:
        return first_tensor(np.array(result.to_tuple()[0]))

    info = {
        "converter": converter,
        "version": ov.__version__,
        # what the plugin actually runs: bf16 falls back to f32 on CPUs without bf16 support
        "inference_precision": compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name(),
    }
    return Prepared(call, output, seconds, precision, info)


def prepare_openvino_fp32(case: Case) -> Prepared:
    return _prepare_openvino(case, "fp32")


def prepare_openvino_bf16(case: Case) -> Prepared:
    return _prepare_openvino(case, "bf16")


def _prepare_cuvil(case: Case, precision: str) -> Prepared:
    import cuvil

    spec = case.spec
    compiled, seconds = _timed(
        lambda: cuvil.jit(
            spec.model,
            spec.example_inputs,
            dynamic_shapes=spec.dynamic_shapes,
            precision=precision,
            name=spec.name,
        )
    )
    inputs = case.inputs
    compiled.prepare(inputs)  # GEMM paths chosen at this shape (timed in place: cpu/tactics.py)
    report = compiled.report
    names = compiled.signature.output_names

    def call() -> Any:
        return compiled.run(inputs)

    def output(result: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return first_tensor([result[name] for name in names])

    verification = report.get("verification") or {}
    execution = compiled.execution()
    info = {
        "compile_seconds_reported": report.get("compile_seconds"),
        "verification_rel_err": verification.get("max_relative_to_scale"),
        "ops_before": report.get("ops_before"),
        "ops_after": report.get("ops_after"),
        # what ran here: bf16 artifacts compute fp32 GEMMs on CPUs without bf16 instructions
        "gemm_compute": execution["gemm_compute"],
        # the dtype values pass between the GEMMs in (bf16 artifacts: bf16 where kept so)
        "activations": execution["activations"],
        # the settled shapes: whether each runs as one native call
        "whole_plan_native": [
            shape["whole_plan_native"]
            for shape in execution["plan_loop"].get("shapes", {}).values()
        ],
        # intermediates at this case's shape: the arena plan against keeping every one
        "memory": compiled.memory_plan(inputs),
    }
    return Prepared(call, output, seconds, precision, info)


def prepare_cuvil_fp32(case: Case) -> Prepared:
    return _prepare_cuvil(case, "fp32")


def prepare_cuvil_bf16(case: Case) -> Prepared:
    return _prepare_cuvil(case, "bf16")


PEERS: dict[str, Callable[[Case], Prepared]] = {
    "eager": prepare_eager,
    "torch_compile_fp32": prepare_torch_compile_fp32,
    "torch_compile_bf16": prepare_torch_compile_bf16,
    "onnxruntime": prepare_onnxruntime,
    "openvino_fp32": prepare_openvino_fp32,
    "openvino_bf16": prepare_openvino_bf16,
    "cuvil_fp32": prepare_cuvil_fp32,
    "cuvil_bf16": prepare_cuvil_bf16,
}

# the fp32 peers Cuvil fp32 is measured against ("best fp32 peer")
FP32_PEERS = ("eager", "torch_compile_fp32", "onnxruntime", "openvino_fp32")


def scratch_dir() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="cuvil-bench-")

"""int8: linears and SwiGLUs get int8 weights with one scale per output row (``weight_scale``),
convolutions bf16, values between them bf16; results stay within int8's budget of eager fp32
and within bf16's of the model whose weights hold the same int8 values; the artifact keeps the
int8 weights and its scales, and a graph written before ``weight_scale`` existed still loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import cuvil
from cuvil.fused_ops import LINEAR, SWIGLU, FusedOpError, fused_node, with_absent_optionals
from cuvil.ir import TensorType, Value
from cuvil.ir_json import graph_from_json, graph_to_json
from cuvil.models import mlp, tiny_llama
from cuvil.passes.precision import with_int8_linears
from cuvil.precisions import PRECISIONS
from tests.cuvil.passes.rule_cases import ConvBlock
from tests.cuvil.passes.test_precision import assert_loaded_runs_alike, golden_inputs


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("factory", [mlp, tiny_llama], ids=["mlp", "tiny_llama"])
def test_int8_quantizes_the_gemm_weights_and_stays_within_budget(  # type: ignore[no-untyped-def]
    factory, tmp_path: Path
) -> None:
    spec = factory()
    compiled = cuvil.jit(
        spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes, precision="int8"
    )
    bf16 = cuvil.jit(
        spec.model, spec.example_inputs, dynamic_shapes=spec.dynamic_shapes, precision="bf16"
    )
    report = compiled.report
    assert report["fusions"]["int8_weights"] >= 3
    assert report["bisection"] is None
    assert 0 < report["verification"]["max_relative_to_scale"] <= PRECISIONS["int8"].budget
    assert report["weights_bytes"] < bf16.report["weights_bytes"]
    weights = compiled.contents.weights
    gemms = [n for n in compiled.graph.nodes if n.op in (LINEAR, SWIGLU)]
    assert gemms
    for node in gemms:
        key = "weight" if node.op == LINEAR else "gate_up_weight"
        weight = weights[str(compiled.graph.node(node.arg(key).node).arg("key"))]
        scale = weights[str(compiled.graph.node(node.arg("weight_scale").node).arg("key"))]
        assert weight.dtype == torch.int8 and scale.shape == (weight.shape[0],)
    assert compiled.execution()["weights"] == "int8"
    # against the fp32 model holding the same int8 values: only bf16's rounding remains
    inputs = golden_inputs(compiled)
    with torch.no_grad():
        eager = with_int8_linears(spec.model)(**inputs)
    eager = eager if isinstance(eager, torch.Tensor) else eager[0]
    result = next(iter(compiled.run(inputs).values()))
    assert _relative(result, eager) <= PRECISIONS["bf16"].budget
    loaded = cuvil.load(compiled.save(tmp_path / "m.cuvil"))
    assert {t.dtype for t in loaded.contents.weights.values()} >= {torch.int8}
    assert_loaded_runs_alike(compiled, loaded, inputs)


def test_int8_leaves_convolutions_in_bf16() -> None:
    model = ConvBlock(torch.relu).eval()
    x = torch.randn(2, 8, 10, 10)
    compiled = cuvil.jit(model, (x,), precision="int8")
    assert compiled.report["fusions"]["bf16_weights"] == 3
    assert "int8_weights" not in compiled.report["fusions"]
    with torch.no_grad():
        assert _relative(compiled(x), model(x)) <= PRECISIONS["int8"].budget


def test_a_graph_written_before_weight_scale_loads_with_it_absent() -> None:
    x, w = Value("x"), Value("w")
    node = fused_node(LINEAR, "y", {"input": x, "weight": w, "activation": "none"}, ())
    assert node.arg("weight_scale") is None
    older = node.__class__(node.name, node.op, node.args[:-1], node.types)
    assert with_absent_optionals(older) == node
    with pytest.raises(FusedOpError, match="no argument"):
        fused_node(LINEAR, "y", {"input": x, "scale": w}, (TensorType("f32", (1,)),))
    compiled = cuvil.jit(torch.nn.Linear(4, 3).eval(), (torch.randn(2, 4),))
    document = json.loads(json.dumps(graph_to_json(compiled.graph)))
    linears = [stored for stored in document["nodes"] if stored["op"] == LINEAR]
    assert linears
    for stored in linears:
        stored["args"] = [arg for arg in stored["args"] if arg[0] != "weight_scale"]
    assert graph_from_json(document) == compiled.graph

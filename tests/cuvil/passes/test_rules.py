"""Every rewrite rule fires on a model built for it and keeps the numbers: compiled output
matches eager on random inputs at several batch sizes."""

from __future__ import annotations

import pytest
import torch

import cuvil
from cuvil.backends.cpu.backend import LOWERING
from cuvil.passes.fusion import rules_transformer
from cuvil.passes.rules_epilogue import epilogue_rules
from cuvil.passes.rules_fold import rules_addmm, rules_fold_batch_norm
from cuvil.passes.rules_matmul import rules_matmul
from cuvil.passes.rules_transformer import rules_gelu
from tests.cuvil.passes.pattern_cases import PATTERN_CASES
from tests.cuvil.passes.rule_cases import CASES as RULE_CASES
from tests.cuvil.passes.rule_cases import RuleCase

CASES = RULE_CASES + PATTERN_CASES
ALL_RULES = {
    r.name
    for r in rules_gelu
    + rules_transformer
    + epilogue_rules(LOWERING.conv_epilogues, LOWERING.linear_epilogues)
    + rules_fold_batch_norm
    + rules_addmm
    + rules_matmul
}
OTHER_REWRITES = {
    "identity",
    "cse",
    "constant_fold",
    "layout_borders",
    "sibling_linears",
    "attention_mask_bias",
}


def test_every_rule_has_an_equivalence_case() -> None:
    covered = {name for case in CASES for name in case.expected}
    assert covered >= ALL_RULES | OTHER_REWRITES, sorted((ALL_RULES | OTHER_REWRITES) - covered)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rule_fires_and_matches_eager(case: RuleCase) -> None:
    torch.manual_seed(0)
    model = case.module.eval()
    example = case.make(2)
    names = list(__import__("inspect").signature(model.forward).parameters)
    shapes = dict(zip(names, case.dynamic, strict=False))
    compiled = cuvil.jit(model, example, dynamic_shapes=shapes, name=case.name)
    fired = compiled.report["fusions"]
    missing = [name for name in case.expected if not fired.get(name)]
    assert not missing, f"rules {missing} did not fire; fired: {fired}"
    if case in PATTERN_CASES:  # (a lone conv between graph input and output needs 2 borders)
        passes = compiled.report["passes"]
        assert passes[-1]["ops_after"] <= passes[0]["ops_before"], passes  # never more ops
    for n in (1, 3, 8):
        inputs = case.make(n)
        with torch.no_grad():
            expected = model(*inputs)
        actual = compiled(*inputs)
        scale = expected.abs().max().item()
        error = (actual - expected).abs().max().item()
        assert error <= 1e-5 * max(scale, 1.0), (case.name, n, error, scale)


def test_one_mask_bias_serves_every_attention_that_shares_the_mask() -> None:
    from tests.cuvil.passes.rule_cases import TwoLayersOneMask, _masked_inputs

    compiled = cuvil.jit(TwoLayersOneMask(), _masked_inputs(2))
    assert compiled.report["fusions"]["attention_mask_bias"] == 1
    masks = {node.arg("mask") for node in compiled.graph.nodes if node.op == "cuvil.attention"}
    assert len(masks) == 1 and compiled.graph.type_of(masks.pop()).dtype == "f32"


def test_sibling_linears_become_one_gemm_per_group() -> None:
    from tests.cuvil.passes.rule_cases import SiblingProjections

    compiled = cuvil.jit(SiblingProjections().eval(), (torch.randn(2, 5, 16),))
    assert compiled.report["fusions"]["sibling_linears"] == 2  # q/k/v and the two GELU ups
    linears = [node for node in compiled.graph.nodes if node.op == "cuvil.linear"]
    assert len(linears) == 2


@pytest.mark.parametrize("name", ["mixconv", "dense_block"])
def test_concat_and_split_keep_channels_last(name: str) -> None:
    """One conversion into channels-last for the whole network, none around its joins."""
    case = next(case for case in CASES if case.name == name)
    compiled = cuvil.jit(case.module.eval(), case.make(2))
    assert compiled.report["fusions"]["layout_borders"] == 1
    clones = [node for node in compiled.graph.nodes if node.op == "aten.clone.default"]
    assert len(clones) == 1


def test_batch_norm_after_a_concat_is_folded_into_every_branch() -> None:
    from tests.cuvil.passes.pattern_cases import MixConv

    compiled = cuvil.jit(MixConv().eval(), (torch.randn(2, 3, 12, 12),))
    ops = [node.op for node in compiled.graph.nodes]
    assert "aten._native_batch_norm_legit_no_training.default" not in ops
    assert ops.count("cuvil.conv2d") == 5  # stem, three mixed kernels, projection

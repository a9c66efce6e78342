"""User patterns are accepted only when they keep the numbers; a bad rewrite is found by
bisection, named, and left out (or the compile fails when asked to)."""

from __future__ import annotations

import pytest
import torch

import cuvil
from cuvil.patterns import Node, P, PatternRejected, Rule, V, clear_patterns, register_pattern
from cuvil.pipeline import VerificationError

TWICE = P("aten.relu.default", {"self": P("aten.relu.default", {"self": V("x")})})


def _relu_once(match, rewriter):  # type: ignore[no-untyped-def]
    # relu(relu(x)) -> relu(x)
    return [
        Node(
            rewriter.names.fresh("relu"),
            "aten.relu.default",
            (("self", match.values["x"]),),
            match.root.types,
        )
    ]


def _identity(match, rewriter):  # type: ignore[no-untyped-def]
    # relu(relu(x)) -> x + 0   (wrong for negative x)
    return [
        Node(
            rewriter.names.fresh("wrong"),
            "aten.add.Tensor",
            (("self", match.values["x"]), ("other", 0.0)),
            match.root.types,
        )
    ]


GOOD = Rule("double_relu", TWICE, _relu_once)
BAD = Rule("drop_relu", TWICE, _identity)


class DoubleRelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.relu(x * 2.0)) + self.linear(x)


@pytest.fixture(autouse=True)
def _fresh_registry():  # type: ignore[no-untyped-def]
    clear_patterns()
    yield
    clear_patterns()


def test_a_correct_pattern_is_accepted_and_used_later() -> None:
    register_pattern(GOOD, DoubleRelu(), (torch.randn(3, 6),))
    model = DoubleRelu().eval()
    compiled = cuvil.jit(model, (torch.randn(2, 6),))
    assert compiled.report["fusions"]["double_relu"] == 1
    x = torch.randn(2, 6)
    torch.testing.assert_close(compiled(x), model(x))


def test_a_wrong_pattern_is_rejected() -> None:
    with pytest.raises(PatternRejected, match="drop_relu"):
        register_pattern(BAD, DoubleRelu(), (torch.randn(3, 6),))


def test_a_pattern_that_never_fires_is_rejected() -> None:
    with pytest.raises(PatternRejected, match="did not fire"):
        register_pattern(GOOD, torch.nn.Linear(3, 3), (torch.randn(2, 3),))


def test_bisection_names_the_pass_and_compiles_without_it() -> None:
    model = DoubleRelu().eval()
    compiled = cuvil.jit(model, (torch.randn(4, 6),), patterns=(BAD,))
    assert compiled.report["bisection"]["culprit"] == "user_patterns"
    assert compiled.report["bisection"]["error"] > 1e-4
    assert "user_patterns" not in compiled.config["passes"]
    x = torch.randn(4, 6)
    torch.testing.assert_close(compiled(x), model(x))


def test_bisection_can_fail_the_compile_instead() -> None:
    with pytest.raises(VerificationError, match="responsible pass: user_patterns"):
        cuvil.jit(DoubleRelu().eval(), (torch.randn(4, 6),), patterns=(BAD,), on_mismatch="raise")


def test_passes_can_be_disabled_by_name() -> None:
    compiled = cuvil.jit(
        DoubleRelu().eval(), (torch.randn(2, 6),), disable_passes=("fuse_epilogues",)
    )
    assert "cuvil.linear" not in compiled.report["op_histogram"]
    assert "fuse_epilogues" not in compiled.config["passes"]
    with pytest.raises(ValueError, match="unknown pass"):
        cuvil.jit(DoubleRelu().eval(), (torch.randn(2, 6),), disable_passes=("no_such_pass",))


def _nan(match, rewriter):  # type: ignore[no-untyped-def]
    # relu(relu(x)) -> x + nan: every output NaN, which a plain `error > tolerance` lets pass
    return [
        Node(
            rewriter.names.fresh("nan"),
            "aten.add.Tensor",
            (("self", match.values["x"]), ("other", float("nan"))),
            match.root.types,
        )
    ]


def _crash(match, rewriter):  # type: ignore[no-untyped-def]
    # relu(relu(x)) -> a view to a size that does not fit: the lowered model raises when run
    return [
        Node(
            rewriter.names.fresh("crash"),
            "aten.view.default",
            (("self", match.values["x"]), ("size", [-1, 7])),
            match.root.types,
        )
    ]


@pytest.mark.parametrize("rewrite", [_nan, _crash], ids=["nan", "raises"])
def test_nan_or_a_crash_in_the_lowered_model_is_bisected_like_a_mismatch(rewrite) -> None:  # type: ignore[no-untyped-def]
    model = DoubleRelu().eval()
    compiled = cuvil.jit(model, (torch.randn(4, 6),), patterns=(Rule("broken", TWICE, rewrite),))
    assert compiled.report["bisection"] == {"error": None, "culprit": "user_patterns"}
    x = torch.randn(4, 6)
    torch.testing.assert_close(compiled(x), model(x))


def test_nan_counts_as_the_worst_error() -> None:
    from cuvil.verify import compare_output, worst_relative_error

    expected = torch.ones(3)
    good = compare_output("good", expected.clone(), expected)
    bad = compare_output("bad", torch.tensor([1.0, float("nan"), 1.0]), expected)
    assert bad.relative_to_scale == float("inf")
    assert worst_relative_error([good, bad]) == float("inf")
    same_nan = torch.tensor([1.0, float("nan"), float("inf")])
    assert compare_output("same", same_nan.clone(), same_nan).relative_to_scale == 0.0

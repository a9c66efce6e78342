"""User rewrite patterns: the public way to teach Cuvil a fusion.

    from cuvil.patterns import P, V, L, Rule, register_pattern

    twice = P("aten.relu.default", {"self": P("aten.relu.default", {"self": V("x")})})
    once = lambda m, rw: [Node(rw.names.fresh("relu"), "aten.relu.default",
                               (("self", m.values["x"]),), m.root.types)]
    rule = Rule("double_relu", twice, once)
    register_pattern(rule, example_model, example_inputs)

A pattern is accepted only after it fires on the example and the compiled example matches eager
PyTorch on random inputs; otherwise PatternRejected says why. Accepted patterns apply to every
later ``cuvil.jit`` in this process (or pass ``patterns=`` to one call). Nothing registers itself
on import.
"""

from __future__ import annotations

from typing import Any

import torch

from cuvil.ir import Node, Value
from cuvil.passes.rewrite import L, Match, P, Rewriter, Rule, V
from cuvil.verify import compare_output

__all__ = [
    "L",
    "Match",
    "Node",
    "P",
    "PatternRejected",
    "Rewriter",
    "Rule",
    "V",
    "Value",
    "clear_patterns",
    "register_pattern",
    "registered_patterns",
]

_registered: list[Rule] = []


class PatternRejected(ValueError):
    pass


def registered_patterns() -> tuple[Rule, ...]:
    return tuple(_registered)


def clear_patterns() -> None:
    _registered.clear()


def _perturb(value: Any, generator: torch.Generator) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return torch.randn(value.shape, generator=generator, dtype=value.dtype)
    return value


def check_pattern(
    rule: Rule,
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    dynamic_shapes: Any = None,
    trials: int = 5,
    tolerance: float = 1e-5,
) -> None:
    """Raise PatternRejected unless ``rule`` fires on ``model`` and keeps its outputs."""
    from cuvil.api import jit
    from cuvil.pipeline import VerificationError

    model = model.eval()
    try:
        compiled = jit(
            model,
            example_inputs,
            dynamic_shapes=dynamic_shapes,
            patterns=(rule,),
            on_mismatch="raise",
            tolerance=tolerance,
        )
    except VerificationError as error:
        raise PatternRejected(f"pattern {rule.name!r} changes results: {error}") from None
    if not compiled.report["fusions"].get(rule.name):
        raise PatternRejected(f"pattern {rule.name!r} did not fire on the example model")
    generator = torch.Generator().manual_seed(0)
    args = example_inputs if isinstance(example_inputs, tuple | list) else (example_inputs,)
    for trial in range(trials):
        inputs = tuple(_perturb(a, generator) for a in args)
        with torch.no_grad():
            expected = model(*inputs)
        difference = compare_output("output", compiled(*inputs), expected)
        if not difference.relative_to_scale <= tolerance:  # NaN fails too
            raise PatternRejected(
                f"pattern {rule.name!r} changes results: trial {trial} differs by "
                f"{difference.relative_to_scale:.3g} of the output scale"
            )


def register_pattern(rule: Rule, model: torch.nn.Module, example_inputs: Any, **check: Any) -> Rule:
    """Check ``rule`` on an example, then use it in every later compile of this process."""
    check_pattern(rule, model, example_inputs, **check)
    _registered.append(rule)
    return rule

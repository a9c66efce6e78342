"""The op allowlist: every listed op is a real, functional aten overload with no random state;
file, random, uninitialised and in-place ops are not on it; the compiler refuses a model that
needs an op outside it before packaging, naming the op."""

from __future__ import annotations

import pytest
import torch

import cuvil
from cuvil.allowed_ops import (
    ALLOWED_ATEN_OPS,
    FAMILIES,
    REQUIRED_LITERALS,
    SIZE_ARGUMENTS,
    DisallowedOpError,
    disallowed_ops,
    is_allowed_op,
)
from cuvil.fused_ops import FUSED_OPS
from cuvil.runtime.kernels import resolve_aten


@pytest.mark.parametrize("op", sorted(ALLOWED_ATEN_OPS))
def test_every_listed_op_is_a_functional_overload_without_random_state(op: str) -> None:
    overload = resolve_aten(op)  # exists in this torch, and is not mutable
    seeded = torch.Tag.nondeterministic_seeded in overload.tags
    assert not seeded or REQUIRED_LITERALS.get(op) == {"dropout_p": 0.0}
    assert not any(
        argument.alias_info and argument.alias_info.is_write
        for argument in overload._schema.arguments
    )


def test_families_say_why_and_do_not_overlap() -> None:
    listed = [op for family in FAMILIES for op in family.ops]
    assert len(listed) == len(set(listed))
    assert all(family.why for family in FAMILIES)
    assert set(SIZE_ARGUMENTS) <= set(ALLOWED_ATEN_OPS)
    for op, names in SIZE_ARGUMENTS.items():
        arguments = {argument.name for argument in resolve_aten(op)._schema.arguments}
        assert set(names) <= arguments, op


REFUSED = [
    "aten.from_file.default",
    "aten.rand.default",
    "aten.randn.default",
    "aten.randint.low",
    "aten.bernoulli.default",
    "aten.dropout.default",
    "aten.native_dropout.default",
    "aten.empty.memory_format",
    "aten.empty_like.default",
    "aten.new_empty.default",
    "aten.add_.Tensor",
    "aten.copy_.default",
    "aten.index_put_.default",
    "aten._local_scalar_dense.default",
    "aten.save.default",
    "cuvil.unknown",
    "prim.load",
]


@pytest.mark.parametrize("op", REFUSED)
def test_side_effecting_and_unknown_ops_are_not_allowed(op: str) -> None:
    assert not is_allowed_op(op)


def test_fused_and_structural_ops_are_allowed() -> None:
    assert disallowed_ops([*FUSED_OPS, "input", "const", "aten.linear.default"]) == []


class NeedsAnUnlistedOp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.logcumsumexp(x, 1) + 1.0  # pure, but not (yet) reviewed for the list


def test_the_compiler_refuses_a_model_that_needs_an_unlisted_op() -> None:
    with pytest.raises(DisallowedOpError, match=r"aten\.logcumsumexp\.default"):
        cuvil.jit(NeedsAnUnlistedOp(), (torch.randn(2, 8),))


def test_every_in_place_fused_op_says_why_an_artifact_may_hold_it() -> None:
    from cuvil.allowed_ops import IN_PLACE_REASONS
    from cuvil.fused_ops import in_place_ops

    assert set(in_place_ops()) == set(IN_PLACE_REASONS)
    assert all(len(reason) > 40 for reason in IN_PLACE_REASONS.values())

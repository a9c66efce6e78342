"""Derived dynamic dims (``4 * d - 1``): the root is named after the user's Dim, solved from the
input's size at call time, and a size no integer root gives (or one out of range) is refused."""

from __future__ import annotations

import pytest
import torch

import cuvil
from cuvil.runtime.signature import InputError

d = cuvil.Dim("d", min=2, max=32)


class Doubled(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).cumsum(0)


class Pair(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y.view(-1, 2).sum(1) + x


@pytest.fixture(scope="module")
def derived_only() -> cuvil.CompiledModel:
    return cuvil.jit(Doubled(), (torch.randn(7),), dynamic_shapes=({0: 4 * d - 1},))


def test_a_root_seen_only_inside_a_derived_dim_is_named_and_solved(derived_only) -> None:  # type: ignore[no-untyped-def]
    assert [s.name for s in derived_only.signature.symbols] == ["d"]
    for size in (7, 11, 4 * 32 - 1):
        x = torch.randn(size)
        torch.testing.assert_close(derived_only(x), Doubled()(x))


def test_sizes_no_integer_root_gives_are_refused(derived_only) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InputError, match="no integer d"):
        derived_only(torch.randn(12))


def test_a_solved_root_outside_its_range_is_refused(derived_only) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InputError, match=r"d = 33, outside its declared range \[2, 32\]"):
        derived_only(torch.randn(4 * 33 - 1))


def test_a_root_bound_by_another_input_checks_the_derived_one() -> None:
    compiled = cuvil.jit(
        Pair(), (torch.randn(3), torch.randn(6)), dynamic_shapes=({0: d}, {0: 2 * d})
    )
    x, y = torch.randn(5), torch.randn(10)
    torch.testing.assert_close(compiled(x, y), Pair()(x, y))
    with pytest.raises(InputError, match="expected 2\\*d = 10"):
        compiled(x, torch.randn(12))

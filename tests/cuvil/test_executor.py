"""Executor and input checks: a flat plan that frees as it goes, and calls outside the
signature refused with a clear InputError."""

from __future__ import annotations

import pytest
import torch

import cuvil
from cuvil.runtime.signature import InputError


class TwoInputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 8)
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.embed(ids) * scale.unsqueeze(-1))
        return self.proj(hidden).sum(1)


@pytest.fixture(scope="module")
def compiled() -> cuvil.runtime.model.CompiledModel:  # type: ignore[name-defined]
    batch = cuvil.Dim("batch", min=1, max=8)
    seq = cuvil.Dim("seq", min=2, max=32)
    example = (torch.randint(0, 100, (2, 5)), torch.rand(2, 5))
    shapes = {"ids": {0: batch, 1: seq}, "scale": {0: batch, 1: seq}}
    return cuvil.jit(TwoInputs().eval(), example, dynamic_shapes=shapes)


def test_plan_is_flat_and_frees_intermediates(compiled) -> None:  # type: ignore[no-untyped-def]
    plan = compiled.plan
    assert len(plan.steps) == sum(1 for n in compiled.graph.nodes if n.op not in ("input", "const"))
    released = {slot for step in plan.steps for slot in step.release}
    outputs = {slot for _, slot in plan.output_slots}
    assert released and not released & outputs


def test_named_and_positional_calls_agree(compiled) -> None:  # type: ignore[no-untyped-def]
    ids, scale = torch.randint(0, 100, (3, 7)), torch.rand(3, 7)
    by_name = compiled.run({"ids": ids, "scale": scale})["output"]
    torch.testing.assert_close(compiled(ids, scale), by_name)
    torch.testing.assert_close(compiled(ids, scale=scale), by_name)


BAD_CALLS = [
    ("missing input", {"ids": torch.randint(0, 100, (2, 5))}, "missing \\['scale'\\]"),
    (
        "unknown input",
        {"ids": torch.zeros(2, 5, dtype=torch.long), "scale": torch.rand(2, 5), "x": torch.rand(1)},
        "unknown \\['x'\\]",
    ),
    (
        "float where int64 declared",
        {"ids": torch.rand(2, 5), "scale": torch.rand(2, 5)},
        "dtype f32, expected i64",
    ),
    (
        "wrong rank",
        {"ids": torch.zeros(2, 5, 1, dtype=torch.long), "scale": torch.rand(2, 5)},
        "rank 3",
    ),
    (
        "batch above range",
        {"ids": torch.zeros(9, 5, dtype=torch.long), "scale": torch.rand(9, 5)},
        "outside its declared range \\[1, 8\\]",
    ),
    (
        "seq below range",
        {"ids": torch.zeros(2, 1, dtype=torch.long), "scale": torch.rand(2, 1)},
        "\\(seq\\) is 1, outside",
    ),
    (
        "inputs disagree",
        {"ids": torch.zeros(2, 5, dtype=torch.long), "scale": torch.rand(3, 5)},
        "another input set batch = 2",
    ),
    ("not a tensor", {"ids": [[1, 2]], "scale": torch.rand(1, 2)}, "must be a tensor"),
]


@pytest.mark.parametrize(("case", "inputs", "message"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_inputs_are_refused(compiled, case, inputs, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InputError, match=message):
        compiled.run(inputs)


def test_too_many_positional_inputs(compiled) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InputError, match="positional"):
        compiled(torch.zeros(2, 5, dtype=torch.long), torch.rand(2, 5), torch.rand(2, 5))


def test_bounds_are_inclusive(compiled) -> None:  # type: ignore[no-untyped-def]
    model = TwoInputs().eval()
    model.load_state_dict({k.removeprefix(""): v for k, v in compiled.contents.weights.items()})
    for b, s in ((1, 2), (8, 32)):
        ids, scale = torch.randint(0, 100, (b, s)), torch.rand(b, s)
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids, scale), model(ids, scale))

"""Frontend: each op family becomes IR that runs like eager; what Cuvil cannot run is named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cuvil
from cuvil.frontend.convert import UnsupportedOpError
from cuvil.frontend.export import ExportError
from cuvil.ir_text import parse_graph, print_graph

batch = cuvil.Dim("batch", min=1, max=16)


class Conv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.pool = torch.nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.pool(y).flatten(1)


class Norms(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(16)
        self.gn = torch.nn.GroupNorm(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(x)
        return self.gn(y.transpose(1, 2)).transpose(1, 2) * torch.rsqrt(
            y.pow(2).mean(-1, keepdim=True) + 1e-6
        )


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        manual = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1) @ v
        fused = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (manual + fused).transpose(1, 2).reshape(b, s, 16)


class Embed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(50, 16)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.table(ids)
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        first, second = torch.chunk(e, 2, dim=-1)
        mixed = torch.cat([second, first + positions.unsqueeze(-1)], dim=-1)
        return mixed[:, 1:, :].sum(1), torch.where(ids > 25, ids, 0)


CASES = [
    (
        "conv",
        Conv(),
        (torch.randn(2, 3, 16, 16),),
        {"x": {0: batch}},
        lambda n: torch.randn(n, 3, 16, 16),
    ),
    (
        "norms",
        Norms(),
        (torch.randn(2, 5, 16),),
        {"x": {0: batch}},
        lambda n: torch.randn(n, 5, 16),
    ),
    (
        "attention",
        Attention(),
        (torch.randn(2, 6, 16),),
        {"x": {0: batch}},
        lambda n: torch.randn(n, 6, 16),
    ),
    (
        "embed",
        Embed(),
        (torch.randint(0, 50, (2, 7)),),
        {"ids": {0: batch}},
        lambda n: torch.randint(0, 50, (n, 7)),
    ),
]


@pytest.mark.parametrize(
    ("name", "model", "example", "dynamic", "make"), CASES, ids=[c[0] for c in CASES]
)
def test_op_family_matches_eager(name, model, example, dynamic, make) -> None:  # type: ignore[no-untyped-def]
    model.eval()
    compiled = cuvil.jit(model, example, dynamic_shapes=dynamic, name=name)
    assert parse_graph(print_graph(compiled.graph)) == compiled.graph
    for n in (1, 3, 16):
        x = make(n)
        with torch.no_grad():
            expected = model(x)
        actual = compiled(x)
        for a, e in zip(
            torch.utils._pytree.tree_leaves(actual),
            torch.utils._pytree.tree_leaves(expected),
            strict=True,
        ):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_symbols_take_the_users_dim_names() -> None:
    compiled = cuvil.jit(
        Embed().eval(), (torch.randint(0, 50, (2, 7)),), dynamic_shapes={"ids": {0: batch}}
    )
    assert [s.name for s in compiled.signature.symbols] == ["batch"]
    assert (compiled.signature.symbol("batch").min, compiled.signature.symbol("batch").max) == (
        1,
        16,
    )


def test_unit_example_on_a_dynamic_dim_stays_dynamic() -> None:
    model = torch.nn.Linear(4, 2).eval()
    compiled = cuvil.jit(model, (torch.randn(1, 4),), dynamic_shapes={"input": {0: batch}})
    assert str(compiled.signature.inputs[0].shape[0]) == "batch"
    assert any("tiled to 2" in note for note in compiled.report["notes"])
    torch.testing.assert_close(compiled(torch.ones(5, 4)), model(torch.ones(5, 4)))


torch.library.define("cuvil_test::opaque", "(Tensor x) -> Tensor")


@torch.library.impl("cuvil_test::opaque", "CompositeExplicitAutograd")
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.library.register_fake("cuvil_test::opaque")
def _opaque_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class UsesCustomOp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.cuvil_test.opaque(x + 1)


def test_unsupported_op_is_named_with_its_origin() -> None:
    with pytest.raises(UnsupportedOpError) as raised:
        cuvil.jit(UsesCustomOp(), (torch.randn(2, 3),))
    message = str(raised.value)
    assert "cuvil_test.opaque.default" in message
    assert "test_frontend.py" in message


class DataDependent(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0]


def test_export_failure_carries_the_exporters_reason() -> None:
    with pytest.raises((ExportError, UnsupportedOpError)) as raised:
        cuvil.jit(DataDependent(), (torch.randn(4, 3),))
    assert "data-dependent" in str(raised.value).lower() or "torch.export failed" in str(
        raised.value
    )


def test_mutating_buffers_is_refused() -> None:
    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.add_(1)
            return x + self.seen

    with pytest.raises(UnsupportedOpError, match="mutates buffers"):
        cuvil.jit(Counter(), (torch.randn(2, 3),))

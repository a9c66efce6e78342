"""Small modules that each exercise a rewrite rule, with the input shapes to test them at."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import cuvil

batch = cuvil.Dim("batch", min=1, max=8)


@dataclass
class RuleCase:
    name: str
    module: nn.Module
    make: Callable[[int], tuple[torch.Tensor, ...]]  # batch size -> positional inputs
    expected: tuple[str, ...]  # rule names that must fire
    dynamic: tuple[dict[int, object], ...] = ({0: batch},)


def _bn(n: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(n)
    bn.running_mean.uniform_(-0.5, 0.5)
    bn.running_var.uniform_(0.5, 2.0)
    bn.weight.data.uniform_(0.5, 1.5)
    bn.bias.data.uniform_(-0.5, 0.5)
    return bn


class ConvBlock(nn.Module):
    def __init__(
        self, act: Callable[[torch.Tensor], torch.Tensor], groups: int = 1, bias: bool = True
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, groups=groups, bias=bias)
        self.bn1 = _bn(8)
        self.conv2 = nn.Conv2d(8, 8, 1, stride=2, bias=False)
        self.down = nn.Conv2d(8, 8, 1, stride=2)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn1(self.conv1(x)))
        y = torch.relu(self.conv2(y) + self.down(x))  # conv_add_act; down is conv_plain
        return y.flatten(1)  # a view after channels-last: a layout border


class ConvResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x)  # conv_add (no activation); the output leaves channels-last


class LinearBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(12, 12), nn.Linear(12, 12), nn.Linear(12, 6)
        self.bn = nn.BatchNorm1d(12)
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.bn(self.a(x)))  # linear_bn_fold, then linear_act
        h = self.b(h) + x  # linear_add
        return self.c(F.dropout(h, training=False).clone())  # identity, linear_plain


class ManualAttention(nn.Module):
    def __init__(self, masked: bool, divide: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.masked, self.divide = masked, divide

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        scores = q @ k.transpose(-1, -2)
        scores = scores / math.sqrt(8) if self.divide else scores * (1 / math.sqrt(8))
        if self.masked:
            scores = scores + mask
        return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, 16)


class GroupedQueryAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        def repeat_kv(t: torch.Tensor) -> torch.Tensor:
            b, h, s, d = t.shape
            return t[:, :, None, :, :].expand(b, h, 4, s, d).reshape(b, h * 4, s, d)

        return F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), is_causal=True)


class Gelus(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        erf = x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
        tanh = (
            0.5
            * x
            * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        )
        return erf + tanh


class Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.w = nn.Parameter(torch.rand(16) + 0.5)
        self.b = nn.Parameter(torch.randn(16))
        self.g = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        manual = self.w * ((x - u) / torch.sqrt(s + 1e-5)) + self.b
        rms = self.g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        return self.ln(x) + manual + rms


class GatedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = (
            nn.Linear(16, 32, bias=False),
            nn.Linear(16, 32, bias=False),
            nn.Linear(32, 16, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Rotary(nn.Module):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class Constants(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(4, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        folded = self.table.t() * 2 + 1  # constant_fold
        return torch.relu(x @ folded) + torch.relu(x @ folded)  # cse


def _attention_inputs(n: int) -> tuple[torch.Tensor, ...]:
    mask = torch.zeros(n, 1, 5, 5)
    mask[:, :, :, -1] = -1e9
    return torch.randn(n, 5, 16), mask


class TwoLayersOneMask(nn.Module):
    """Two attentions sharing a boolean padding mask: converted to a float bias once."""

    def forward(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        first = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return F.scaled_dot_product_attention(first, q, first, attn_mask=mask)


def _masked_inputs(n: int) -> tuple[torch.Tensor, ...]:
    mask = torch.rand(n, 1, 6, 6) > 0.4
    mask |= torch.eye(6, dtype=torch.bool)  # every query sees at least itself
    return torch.randn(n, 2, 6, 4), mask


class SiblingProjections(nn.Module):
    """Q/K/V-style linears on one input (one without bias, widths differ), two GELU siblings, and
    consumers that view a slice in ways only a reshape can (merging the strided dims)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 8, bias=False)
        self.v = nn.Linear(16, 8)
        self.up1, self.up2 = nn.Linear(16, 12), nn.Linear(16, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        merged = q.view(-1, 16)[:, :8] + k.view(-1, 8) * v.reshape(-1, 8)
        gated = F.gelu(self.up1(x)) * F.gelu(self.up2(x))
        return torch.cat((merged.view(x.shape[0], -1), gated.flatten(1)), dim=1)


class TransposedWeightProjection(nn.Module):
    """GPT-2's Conv1D: the weight stored as [in, out] and applied with addmm on 2-D rows."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 24) * 0.2)
        self.bias = nn.Parameter(torch.randn(24))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight)
        return F.gelu(rows.view(x.shape[0], x.shape[1], 24), approximate="tanh")


class ResidualProjection(nn.Module):
    """GPT-2's attention output: a Conv1D whose rows are viewed back, then the residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) * 0.2)
        self.bias = nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight)
        return x + rows.view(x.shape)


CASES = [
    RuleCase(
        "conv_relu",
        ConvBlock(torch.relu),
        lambda n: (torch.randn(n, 8, 10, 10),),
        ("conv_bn_fold", "conv_act", "conv_add_act", "conv_plain", "layout_borders"),
    ),
    RuleCase(
        "conv_relu6_depthwise",
        ConvBlock(F.relu6, groups=8, bias=False),
        lambda n: (torch.randn(n, 8, 9, 9),),
        ("conv_bn_fold", "conv_act"),
    ),
    RuleCase("conv_silu", ConvBlock(F.silu), lambda n: (torch.randn(n, 8, 8, 8),), ("conv_act",)),
    RuleCase(
        "conv_hardswish",
        ConvBlock(F.hardswish),
        lambda n: (torch.randn(n, 8, 8, 8),),
        ("conv_act",),
    ),
    RuleCase("conv_gelu", ConvBlock(F.gelu), lambda n: (torch.randn(n, 8, 8, 8),), ("conv_act",)),
    RuleCase("conv_residual", ConvResidual(), lambda n: (torch.randn(n, 4, 6, 6),), ("conv_add",)),
    RuleCase(
        "linear",
        LinearBlock(),
        lambda n: (torch.randn(max(n, 2), 12),),
        ("linear_bn_fold", "linear_act", "linear_add", "linear_plain", "identity"),
        ({0: cuvil.Dim("rows", min=2, max=8)},),
    ),
    RuleCase(
        "attention_masked_div",
        ManualAttention(True, True),
        _attention_inputs,
        ("attention",),
        ({0: batch}, {0: batch}),
    ),
    RuleCase(
        "attention_unmasked_mul",
        ManualAttention(False, False),
        _attention_inputs,
        ("attention",),
        ({0: batch}, {0: batch}),
    ),
    RuleCase(
        "attention_gqa",
        GroupedQueryAttention(),
        lambda n: (torch.randn(n, 8, 6, 4), torch.randn(n, 2, 6, 4), torch.randn(n, 2, 6, 4)),
        ("attention_gqa",),
        ({0: batch}, {0: batch}, {0: batch}),
    ),
    RuleCase("gelu", Gelus(), lambda n: (torch.randn(n, 33),), ("gelu_erf", "gelu_tanh")),
    RuleCase("norms", Norms(), lambda n: (torch.randn(n, 3, 16),), ("layer_norm", "rms_norm")),
    RuleCase("swiglu", GatedMLP(), lambda n: (torch.randn(n, 4, 16),), ("swiglu",)),
    RuleCase(
        "rope",
        Rotary(),
        lambda n: (torch.randn(n, 2, 5, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)),
        ("rope",),
        ({0: batch}, {}, {}),
    ),
    RuleCase("constants", Constants(), lambda n: (torch.randn(n, 6),), ("constant_fold", "cse")),
    RuleCase(
        "attention_mask_bias",
        TwoLayersOneMask(),
        _masked_inputs,
        ("attention", "attention_mask_bias"),
        ({0: batch}, {0: batch}),
    ),
    RuleCase(
        "addmm_as_linear",
        TransposedWeightProjection(),
        lambda n: (torch.randn(n, 5, 16),),
        ("addmm_as_linear", "linear_act_through_view", "linear_act"),
    ),
    RuleCase(
        "linear_add_through_view",
        ResidualProjection(),
        lambda n: (torch.randn(n, 5, 16),),
        ("addmm_as_linear", "linear_add_through_view", "linear_add"),
    ),
    RuleCase(
        "sibling_linears",
        SiblingProjections(),
        lambda n: (torch.randn(n, 5, 16),),
        ("sibling_linears",),
    ),
]

"""Modules written the way other model families write attention biases, matmul linears,
GELUs and mixed-kernel or dense-connected convolutions, one per rule that fuses them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import cuvil
from tests.cuvil.passes.rule_cases import RuleCase, _bn, batch

HEADS, HEAD_DIM, SEQ = 2, 8, 5


def _alibi_slopes(heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)])


class AlibiBaddbmm(nn.Module):
    """Bloom's attention: scores over [batch*heads] rows from ``baddbmm`` on the ALiBi bias,
    viewed per head to add the causal mask, softmax in fp32, ``bmm`` with the values."""

    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM)
        self.register_buffer("slopes", _alibi_slopes(HEADS).view(HEADS, 1, 1))
        self.masked = masked

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        fused = self.qkv(x).view(b, s, HEADS, 3, HEAD_DIM)
        q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))
        q, k, v = (t.reshape(b * HEADS, s, HEAD_DIM) for t in (q, k, v))
        alibi = (self.slopes * torch.arange(s)).repeat(b, 1, 1)  # [b*heads, 1, s]
        scores = alibi.baddbmm(q, k.transpose(-1, -2), beta=1.0, alpha=1 / math.sqrt(HEAD_DIM))
        scores = scores.view(b, HEADS, s, s)
        if self.masked:
            scores = scores + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).view(b * HEADS, s, s)
        out = torch.bmm(probs, v).view(b, HEADS, s, HEAD_DIM)
        return out.permute(0, 2, 1, 3).reshape(b, s, HEADS * HEAD_DIM)


def _alibi_inputs(n: int) -> tuple[torch.Tensor, ...]:
    mask = torch.zeros(n, 1, SEQ, SEQ).masked_fill(
        torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min
    )
    return torch.randn(n, SEQ, HEADS * HEAD_DIM), mask


class FilledBiasedScores(nn.Module):
    """MPT's attention: scaled scores plus a bias (here a learned one per head), the masked
    positions filled with the dtype's minimum, softmax, matmul; or the fill without a bias."""

    def __init__(self, biased: bool) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(HEADS, SEQ, SEQ)) if biased else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor):
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1 / math.sqrt(HEAD_DIM))
        if self.bias is not None:
            scores = scores + self.bias
        scores = scores.masked_fill(keep, torch.finfo(scores.dtype).min)
        return torch.matmul(torch.softmax(scores, dim=-1), v)


def _filled_inputs(n: int) -> tuple[torch.Tensor, ...]:
    qkv = (torch.randn(n, HEADS, SEQ, HEAD_DIM) for _ in range(3))
    keep = torch.rand(n, 1, SEQ, SEQ) > 0.7
    keep[0] = True  # a fully masked row: eager and the fused attention both spread evenly
    return (*qkv, keep)


class MatmulLinears(nn.Module):
    """Falcon's ``x @ W.T + b``, a weight stored [in, out] and used as ``x @ W``, and a GELU in
    Bloom's factored tanh form after a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(24, 16) * 0.2)
        self.bias = nn.Parameter(torch.randn(24))
        self.stored_in_out = nn.Parameter(torch.randn(24, 16) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.weight.T + self.bias
        h = h * 0.5 * (1.0 + torch.tanh(0.79788456 * h * (1 + 0.044715 * h * h)))
        return torch.matmul(h, self.stored_in_out)


class LinearBatchNormHardswish(nn.Module):
    """A tabular head: Linear -> BatchNorm1d -> Hardswish, then a linear with a tanh-GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(12, 16), nn.Linear(16, 8)
        self.bn = nn.BatchNorm1d(16)
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.running_var.uniform_(0.5, 2.0)
        self.bn.weight.data.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.b(F.hardswish(self.bn(self.a(x)))), approximate="tanh")


class MixConv(nn.Module):
    """MixNet's mixed-kernel block: the channels split into groups, a depthwise convolution of
    a different kernel size on each, concatenated, then one BatchNorm and an activation."""

    def __init__(self, channels: int = 12, kernels: tuple[int, ...] = (3, 5, 7)) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.splits = [channels // len(kernels)] * len(kernels)
        self.mixed = nn.ModuleList(
            nn.Conv2d(c, c, k, padding=k // 2, groups=c, bias=False)
            for c, k in zip(self.splits, kernels, strict=True)
        )
        self.bn = _bn(channels)
        self.project = nn.Conv2d(channels, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(self.stem(x), self.splits, dim=1)
        mixed = torch.cat([conv(p) for conv, p in zip(self.mixed, parts, strict=True)], dim=1)
        return self.project(F.silu(self.bn(mixed))).mean((2, 3))


class DenseBlock(nn.Module):
    """DenseNet's block: each layer reads the concat of every feature map before it through
    BatchNorm -> ReLU -> convolution, and its output joins the concat."""

    def __init__(self, channels: int = 8, growth: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        widths = [channels + i * growth for i in range(layers)]
        self.norms = nn.ModuleList(_bn(w) for w in widths)
        self.convs = nn.ModuleList(nn.Conv2d(w, growth, 3, padding=1) for w in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for norm, conv in zip(self.norms, self.convs, strict=True):
            features.append(conv(torch.relu(norm(torch.cat(features, dim=1)))))
        return torch.cat(features, dim=1).mean((2, 3))


_two = ({0: batch}, {0: batch})
_four = ({0: batch}, {0: batch}, {0: batch}, {0: batch})
PATTERN_CASES = [
    RuleCase("alibi_masked", AlibiBaddbmm(True), _alibi_inputs, ("attention_alibi",), _two),
    RuleCase("alibi_unmasked", AlibiBaddbmm(False), _alibi_inputs, ("attention_alibi",), _two),
    RuleCase(
        "filled_biased", FilledBiasedScores(True), _filled_inputs, ("attention_filled",), _four
    ),
    RuleCase("filled", FilledBiasedScores(False), _filled_inputs, ("attention_filled",), _four),
    RuleCase(
        "matmul_linears",
        MatmulLinears(),
        lambda n: (torch.randn(n, 5, 16),),
        ("matmul_as_linear", "linear_bias_add", "gelu_tanh", "linear_act"),
    ),
    RuleCase(
        "linear_bn_hardswish",
        LinearBatchNormHardswish(),
        lambda n: (torch.randn(max(n, 2), 12),),
        ("linear_bn_fold", "linear_act"),
        ({0: cuvil.Dim("rows", min=2, max=8)},),
    ),
    RuleCase(
        "mixconv",
        MixConv(),
        lambda n: (torch.randn(n, 3, 12, 12),),
        ("concat_bn_fold", "activation_into_branches", "conv_act", "layout_borders"),
    ),
    RuleCase(
        "dense_block", DenseBlock(), lambda n: (torch.randn(n, 3, 10, 10),), ("layout_borders",)
    ),
]

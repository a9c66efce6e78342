"""Small models for the CUDA backend's tests: one block with every templated op."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    """Llama's RMSNorm, as the fusion rules see it (torch.nn.RMSNorm exports as one aten op)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class NormBlock(torch.nn.Module):
    """linear -> GELU(tanh) -> LayerNorm -> RoPE over 4 heads -> causal self-attention ->
    RMSNorm -> linear + residual: a linear with an activation epilogue, one with a residual
    epilogue, both row norms, a rotation by constant angles and attention, for ``seq`` tokens."""

    def __init__(self, width: int = 48, hidden: int = 64, seq: int = 5) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.rms = RMSNorm(hidden)
        self.down = torch.nn.Linear(hidden, width)
        angles = torch.arange(seq)[:, None] * torch.linspace(0.1, 1.0, 16)[None, :]
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(F.gelu(self.up(x), approximate="tanh"))
        batch, seq, hidden = h.shape
        q = h.view(batch, seq, 4, hidden // 4).transpose(1, 2)
        q = q * self.cos + torch.cat((-q[..., 8:], q[..., :8]), dim=-1) * self.sin
        q = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        h = q.transpose(1, 2).reshape(batch, seq, hidden)
        return self.down(self.rms(h)) + x


class NormMLP(torch.nn.Module):
    """An MLP with LayerNorm between its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(32, 64),
            torch.nn.LayerNorm(64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 64),
            torch.nn.SiLU(),
            torch.nn.LayerNorm(64),
            torch.nn.Linear(64, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

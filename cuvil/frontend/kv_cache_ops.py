"""The torch ops that stand for Cuvil's KV-cache ops while a decoder step is exported.

torch.export records ``torch.ops.cuvil.kv_cache_write`` and ``torch.ops.cuvil.cached_attention``
as single calls; the frontend turns each into the ``cuvil.*`` node of the same name
(fused_ops.py). Their schemas declare no mutation, so export keeps them as they are instead of
functionalising the cache: the write's result stands for "the cache after the write" and the
attention reads that, which orders the two. The in-place nature is recorded in the IR instead
(``FusedOp.writes``), where the verifier and memory planner know of it. The ops are defined on
first use, never on import, in the ``cuvil`` namespace of torch's op registry.
"""

from __future__ import annotations

from functools import cache

import torch

from cuvil.backends import kv_cache

NAMESPACE = "cuvil"


@cache
def define_ops() -> None:
    """Register the two ops with torch (once per process)."""
    library = torch.library.Library(NAMESPACE, "FRAGMENT")
    library.define(
        "kv_cache_write(Tensor cache, Tensor new, Tensor slots, Tensor positions) -> Tensor"
    )
    library.define(
        "cached_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor slots, "
        "Tensor positions, float? scale) -> Tensor"
    )
    library.impl("kv_cache_write", kv_cache.write, "CompositeExplicitAutograd")
    library.impl("cached_attention", kv_cache.attend, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::kv_cache_write", _write_meta, lib=library)
    torch.library.register_fake(f"{NAMESPACE}::cached_attention", _attend_meta, lib=library)
    _LIBRARIES.append(library)  # a Library deregisters its ops when collected


_LIBRARIES: list[torch.library.Library] = []


def _write_meta(
    cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    return torch.empty_like(cache)


def _attend_meta(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    return torch.empty_like(query)


def kv_cache_write(
    cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    define_ops()
    return torch.ops.cuvil.kv_cache_write(cache, new, slots, positions)


def cached_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    define_ops()
    return torch.ops.cuvil.cached_attention(query, key_cache, value_cache, slots, positions, scale)

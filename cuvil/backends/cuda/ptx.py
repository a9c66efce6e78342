"""What a kernel's PTX says of itself: the parameter types of its ``.entry``, read from the text
(no CUDA toolkit). The launcher packs arguments from the manifest; the PTX is what the driver
JIT-compiles when no cubin fits the device, so codegen checks that its entry takes the
manifest's parameters, in order, with the width and kind each is packed as.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# manifest parameter type -> the PTX parameter types it may be declared as
PTX_TYPES: dict[str, frozenset[str]] = {
    "pointer": frozenset({"u64", "b64", "s64"}),
    "i32": frozenset({"u32", "b32", "s32"}),
    "i64": frozenset({"u64", "b64", "s64"}),
    "fp32": frozenset({"f32", "b32"}),
}
_PARAM = re.compile(r"\.param\s+\.(\w+)")


class PtxError(ValueError):
    """PTX that is not what its manifest says."""


def entry_params(ptx: str, symbol: str) -> list[str]:
    """The PTX types of ``symbol``'s parameters, in order (``["u64", "u64", "f32", …]``)."""
    found = re.search(rf"\.entry\s+{re.escape(symbol)}\s*\((.*?)\)", ptx, re.DOTALL)
    if found is None:
        raise PtxError(f"the PTX has no entry {symbol!r}")
    return _PARAM.findall(found.group(1))


def check_entry(ptx: str, symbol: str, manifest: Mapping[str, Any]) -> None:
    """Refuse PTX whose entry does not take the manifest's parameters (scratch pointers too)."""
    declared = entry_params(ptx, symbol)
    params = manifest["params"]
    if len(declared) != len(params):
        raise PtxError(
            f"{manifest['name']}: the PTX entry takes {len(declared)} parameters, the manifest "
            f"{len(params)}"
        )
    for param, kind in zip(params, declared, strict=True):
        wanted = "pointer" if param["type"].startswith("*") else param["type"]
        if kind not in PTX_TYPES.get(wanted, frozenset()):
            raise PtxError(
                f"{manifest['name']}: parameter {param['name']} is {param['type']} in the "
                f"manifest and .{kind} in the PTX"
            )

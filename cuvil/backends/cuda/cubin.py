"""What a cubin says about itself, read in plain Python: its architecture and each kernel's
parameter table, so codegen checks every cubin it writes without an NVIDIA tool or a GPU.

A cubin is an ELF64 file (machine 190, EM_CUDA). ptxas 12.x writes ELF ABI 7 with the SM in
the low byte of ``e_flags``; ptxas 13.x writes ABI 8 with it in bits 8-15. The ``a`` of an
arch-specific target (``sm_90a``, which runs only on compute capability 9.0) sits in the
``.nv.compat`` section (attribute 0x09 = 1) under ABI 8, in ``e_flags`` bit 0x800 under ABI 7.
``.nv.info.<kernel>`` holds the parameter table the driver copies ``kernelParams`` by
(EIATTR_KPARAM_INFO: ordinal, offset, size), which is what a launch must match.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

EM_CUDA = 190
SHT_SYMTAB = 2
STT_FUNC = 2
EIFMT_SVAL = 4
EIATTR_KPARAM_INFO = 0x17
EIATTR_CBANK_PARAM_SIZE = 0x19
COMPAT_ARCH_SPECIFIC = 0x09


class CubinError(ValueError):
    """Bytes that are not a CUDA cubin, or one that is not what its manifest says."""


@dataclass(frozen=True)
class KernelParam:
    ordinal: int
    offset: int
    size: int


@dataclass(frozen=True)
class CubinInfo:
    arch: str  # "sm_80", "sm_90a"
    abi_version: int
    kernels: dict[str, tuple[KernelParam, ...]]  # function symbol -> its parameters in order


@dataclass(frozen=True)
class _Section:
    name: str
    kind: int
    data: bytes
    link: int


def _sections(data: bytes) -> list[_Section]:
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + index * shentsize) for index in range(shnum)
    ]
    names = headers[shstrndx]
    names_data = data[names[4] : names[4] + names[5]]

    def name_at(offset: int) -> str:
        return names_data[offset : names_data.index(b"\0", offset)].decode()

    return [
        _Section(name_at(h[0]), h[1], data[h[4] : h[4] + h[5]] if h[1] != 8 else b"", h[6])
        for h in headers
    ]


def _functions(sections: list[_Section]) -> list[str]:
    found = []
    for section in sections:
        if section.kind != SHT_SYMTAB:
            continue
        strings = sections[section.link].data
        for index in range(len(section.data) // 24):
            name, info = struct.unpack_from("<IB", section.data, index * 24)
            if info & 0xF == STT_FUNC:
                found.append(strings[name : strings.index(b"\0", name)].decode())
    return found


def _params(info: bytes) -> tuple[KernelParam, ...]:
    params, position = [], 0
    while position + 4 <= len(info):
        form, attribute = info[position], info[position + 1]
        if form != EIFMT_SVAL:
            position += 4
            continue
        (size,) = struct.unpack_from("<H", info, position + 2)
        payload = info[position + 4 : position + 4 + size]
        position += 4 + size
        if attribute == EIATTR_KPARAM_INFO:
            _, ordinal, offset, flags = struct.unpack_from("<IHHI", payload, 0)
            params.append(KernelParam(ordinal, offset, flags >> 18))
    return tuple(sorted(params, key=lambda param: param.ordinal))


def _arch_specific(compat: bytes) -> bool:
    for position in range(0, len(compat) - 3, 4):
        if compat[position] != 2:
            break
        if compat[position + 1] == COMPAT_ARCH_SPECIFIC and compat[position + 2] == 1:
            return True
    return False


def read_cubin(data: bytes) -> CubinInfo:
    """The architecture and kernel parameter tables of a cubin; CubinError if it is none."""
    if data[:4] != b"\x7fELF" or len(data) < 64 or data[4] != 2 or data[5] != 1:
        raise CubinError("not an ELF64 little-endian file")
    (machine,) = struct.unpack_from("<H", data, 18)
    if machine != EM_CUDA:
        raise CubinError(f"ELF machine {machine}, not CUDA ({EM_CUDA})")
    abi = data[8]
    (flags,) = struct.unpack_from("<I", data, 48)
    sections = _sections(data)
    by_name = {section.name: section.data for section in sections}
    if abi >= 8:
        sm, specific = (flags >> 8) & 0xFF, _arch_specific(by_name.get(".nv.compat", b""))
    else:
        sm, specific = flags & 0xFF, bool(flags & 0x800)
    kernels = {
        name: _params(by_name[f".nv.info.{name}"])
        for name in _functions(sections)
        if f".nv.info.{name}" in by_name
    }
    return CubinInfo(f"sm_{sm}{'a' if specific else ''}", abi, kernels)

"""Triton's system shared-memory extension: tensors that never travel through gRPC.

A client on the same node (another container of the pod, which shares its ``/dev/shm``) writes
its inputs into POSIX shared memory, registers the region once (``SystemSharedMemoryRegister``:
a name, the ``shm_open`` key, an offset and a size) and then sends requests that only point at
it, through three tensor parameters, the same for inputs and requested outputs::

    shared_memory_region     the registered name
    shared_memory_byte_size  bytes the tensor takes there
    shared_memory_offset     where it starts in the region (default 0)

The sidecar reads such an input straight from the mapping and writes such an output into it;
the response then carries the output's shape and a reference instead of its bytes. For
ResNet-50 at batch 1 that is 600 KB per request that protobuf and HTTP/2 no longer copy.

Keys are names in ``/dev/shm`` (``/name``, as ``shm_open`` and Python's
``multiprocessing.shared_memory`` use them), never paths: a key with another ``/`` or a ``..``
is refused, a link is never followed, and the segment must belong to the client's user
(peer_credentials.py), so a client cannot make the sidecar map an arbitrary file or another
process's segment. Every offset and size is
checked against the region before anything is read or written, and against the segment's
current size too: touching a mapping past the end of a segment that its owner shrank since
would kill the process (SIGBUS), so each region keeps its descriptor open to ask. At most
``MAX_REGIONS`` regions are registered at once. All of this runs on the event loop thread, so
the registry needs no lock.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cuvil_sidecar.errors import (
    AlreadyExists,
    InvalidInput,
    PermissionDenied,
    RegionNotFound,
    TooManyRegions,
)

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
PARAMETERS = (REGION, BYTE_SIZE, OFFSET)

SHM_ROOT = Path("/dev/shm")
MAX_REGIONS = 256  # each holds a descriptor and a mapping
KEY_PATTERN = re.compile(r"/?[A-Za-z0-9_.\-]{1,255}")


@dataclass(frozen=True)
class SharedMemoryRef:
    """Where one tensor of a request lies: ``byte_size`` bytes at ``offset`` in ``region``."""

    region: str
    byte_size: int
    offset: int = 0

    def parameters(self) -> dict[str, str | int]:
        values: dict[str, str | int] = {REGION: self.region, BYTE_SIZE: self.byte_size}
        if self.offset:
            values[OFFSET] = self.offset
        return values


def reference(tensor: str, parameters: Mapping[str, Any]) -> SharedMemoryRef | None:
    """A tensor's shared-memory parameters -> its reference; None when it sets none of them."""
    if not any(key in parameters for key in PARAMETERS):
        return None
    region = parameters.get(REGION)
    if not isinstance(region, str) or not region:
        raise InvalidInput(
            f"tensor {tensor!r}: {REGION} must name a registered region (a string parameter) "
            f"when {BYTE_SIZE} or {OFFSET} is set"
        )
    byte_size = parameters.get(BYTE_SIZE)
    offset = parameters.get(OFFSET, 0)
    for key, value in ((BYTE_SIZE, byte_size), (OFFSET, offset)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidInput(
                f"tensor {tensor!r} in shared memory region {region!r}: {key} must be a "
                f"non-negative integer parameter, got {value!r}"
            )
    assert isinstance(byte_size, int) and isinstance(offset, int)
    return SharedMemoryRef(region, byte_size, offset)


@dataclass(frozen=True)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap
    descriptor: int  # kept open to check the segment's size before each access


class SharedMemoryRegistry:
    """The regions clients registered, by name, each mapped once."""

    def __init__(self, root: Path = SHM_ROOT) -> None:
        self.root = root
        self._regions: dict[str, Region] = {}

    def register(
        self, name: str, key: str, offset: int, byte_size: int, owner: int | None = None
    ) -> None:
        """Map ``key`` for ``name``: a regular file in the shared-memory folder (no link) that
        belongs to ``owner`` (the client's uid; default: the sidecar's own), so a client can
        map only a segment it could have made, never another process's."""
        owner = os.getuid() if owner is None else owner
        if not name:
            raise InvalidInput("a shared memory region needs a name")
        if len(self._regions) >= MAX_REGIONS:
            raise TooManyRegions(
                f"{MAX_REGIONS} shared memory regions are registered already; unregister some"
            )
        if name in self._regions:
            raise AlreadyExists(
                f"shared memory region {name!r} is already registered (key "
                f"{self._regions[name].key!r}); unregister it first"
            )
        if not KEY_PATTERN.fullmatch(key) or key.strip("/") in {".", ".."}:
            raise InvalidInput(
                f"shared memory key {key!r} is not a POSIX shared memory name: expected /name "
                "with letters, digits, '_', '-' or '.' (no further '/')"
            )
        if byte_size <= 0:
            raise InvalidInput(f"shared memory region {name!r}: byte_size must be positive")
        path = self.root / key.lstrip("/")
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as error:
            raise InvalidInput(
                f"cannot open shared memory key {key!r} ({path}): {error.strerror}"
            ) from None
        try:
            found = os.fstat(descriptor)
            if not stat.S_ISREG(found.st_mode) or found.st_uid != owner:
                raise PermissionDenied(
                    f"shared memory key {key!r} belongs to uid {found.st_uid}, not to the "
                    f"client's ({owner}): a client maps only segments it made"
                )
            size = found.st_size
            if offset + byte_size > size:
                raise InvalidInput(
                    f"shared memory region {name!r}: offset {offset} + byte_size {byte_size} "
                    f"runs past the end of {key!r}, which holds {size} bytes"
                )
            mapping = mmap.mmap(descriptor, size)
        except BaseException:
            os.close(descriptor)
            raise
        self._regions[name] = Region(name, key, offset, byte_size, mapping, descriptor)

    def unregister(self, name: str) -> None:
        """Forget ``name`` (every region when empty); an unknown name is not an error."""
        names = [name] if name else list(self._regions)
        for each in names:
            region = self._regions.pop(each, None)
            if region is not None:
                os.close(region.descriptor)
                _close(region.mapping)

    def status(self, name: str) -> list[Region]:
        if not name:
            return list(self._regions.values())
        if name not in self._regions:
            raise RegionNotFound(f"no shared memory region named {name!r} is registered")
        return [self._regions[name]]

    def view(self, ref: SharedMemoryRef, tensor: str) -> memoryview:
        """The ``ref.byte_size`` bytes ``ref`` points at, checked against its region."""
        region = self._regions.get(ref.region)
        if region is None:
            raise InvalidInput(
                f"tensor {tensor!r}: no shared memory region named {ref.region!r} is registered"
            )
        if ref.offset + ref.byte_size > region.byte_size:
            raise InvalidInput(
                f"tensor {tensor!r}: {OFFSET} {ref.offset} + {BYTE_SIZE} {ref.byte_size} runs "
                f"past the end of region {ref.region!r} ({region.byte_size} bytes)"
            )
        start = region.offset + ref.offset
        size = os.fstat(region.descriptor).st_size
        if start + ref.byte_size > size:
            raise InvalidInput(
                f"tensor {tensor!r}: shared memory key {region.key!r} of region {ref.region!r} "
                f"shrank to {size} bytes since it was registered; register it again"
            )
        return memoryview(region.mapping)[start : start + ref.byte_size]

    def close(self) -> None:
        self.unregister("")


def _close(mapping: mmap.mmap) -> None:
    # BufferError: a request still holds a view; the mapping goes when that view does
    with contextlib.suppress(BufferError):
        mapping.close()

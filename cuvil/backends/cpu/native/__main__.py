"""``python -m cuvil.backends.cpu.native``: compile every native kernel, the native plan loop
and its CPython caller into the cache now (an image build does this, with
``CUVIL_NATIVE_MARCH=x86-64-v3`` and ``CUVIL_NATIVE_CACHE`` set)."""

from __future__ import annotations

import sys

from cuvil.backends.cpu import fast_call, plan_loop
from cuvil.backends.cpu.native import NativeError, build, sources


def main() -> int:
    for name in sources():
        try:
            print(f"{name}: {build(name, for_this_cpu=False)}")
        except NativeError as error:
            print(f"{name}: {error}", file=sys.stderr)
            return 1
    for name, builder in (("plan_loop", plan_loop.build), ("fast_call", fast_call.build)):
        try:
            print(f"{name}: {builder()}")
        except NativeError as error:
            print(f"{name}: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m cuvil_sidecar.native``: build the gRPC front end into the cache now (images)."""

from __future__ import annotations

import sys

from cuvil.runtime.native_build import NativeError
from cuvil_sidecar.native import build

if __name__ == "__main__":
    try:
        print(build())
    except NativeError as error:
        print(f"cuvil_sidecar.native: {error}", file=sys.stderr)
        sys.exit(1)

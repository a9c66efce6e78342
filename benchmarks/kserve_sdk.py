"""KServe's Python SDK (PyPI ``kserve``) as its clients and its model server use it, imported
without the package's ``__init__``.

The sidecar's KServe client test (tests/cuvil_sidecar/kserve_clients.py) and
benchmarks/sidecar_load.py's KServe peer (kserve_peer.py) take KServe's own clients
(``InferenceRESTClient``, ``InferenceGRPCClient``) and model server (``Model``,
``ModelServer``) from ``sdk()``. ``kserve/__init__.py`` also imports the SDK's Kubernetes API
client (``kserve.api``: the ``kubernetes`` package, about 130 MB), which neither needs, so
scripts/setup installs kserve with ``--no-deps`` beside only what the clients and the server
import (pyproject.toml's ``kserve`` extra). ``sdk()`` registers ``kserve`` as a bare package
over its installed folder, and every submodule then imports from there unchanged; where the
whole SDK is installed, the package is imported as usual.

KServe's generated protobuf module registers the same ``inference.*`` names in protobuf's default
pool as tritonclient's and the sidecar's, so a process holds only one of them: KServe runs in
processes of its own.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

# what sdk() hands out: (module under kserve., name)
EXPORTS = {
    "Model": "model",
    "ModelServer": "model_server",
    "InferenceRESTClient": "inference_client",
    "InferenceGRPCClient": "inference_client",
    "RESTConfig": "inference_client",
    "InferRequest": "protocol.infer_type",
    "InferInput": "protocol.infer_type",
    "InferResponse": "protocol.infer_type",
    "InferOutput": "protocol.infer_type",
    "RequestedOutput": "protocol.infer_type",
}


class KServeMissing(ImportError):
    """The kserve package is not installed (scripts/setup dev installs it)."""


class SDK:
    """The names of ``EXPORTS`` as attributes, each module imported when first asked for (the
    clients need none of the server's)."""

    def __getattr__(self, name: str) -> Any:
        if name not in EXPORTS:
            raise AttributeError(name)
        return getattr(importlib.import_module(f"kserve.{EXPORTS[name]}"), name)


def sdk() -> SDK:
    """KServe's clients, model server and request types (``EXPORTS``)."""
    if "kserve" not in sys.modules:
        spec = importlib.util.find_spec("kserve")
        if spec is None or spec.submodule_search_locations is None:
            raise KServeMissing("KServe's SDK is not installed: run scripts/setup dev")
        if importlib.util.find_spec("kubernetes") is None:  # its __init__ would fail
            package = types.ModuleType("kserve")
            package.__path__ = list(spec.submodule_search_locations)
            package.__file__ = spec.origin
            package.__spec__ = spec
            sys.modules["kserve"] = package
    return SDK()

"""The command-line parser every Cuvil deployable (``cuvil-operator``, ``cuvil-worker``,
``cuvil-sidecar``) starts from: ``--help`` lists its environment settings and ``--version``
prints the installed ``cuvil``'s version, and neither starts anything.

Torch-free and standard library only, so the operator (which never imports the compiler) and
the sidecar share it. Each deployable's settings are the table in its config module's
docstring, after the docstring's first paragraph.
"""

from __future__ import annotations

import argparse
from importlib.metadata import version


def build_parser(prog: str, description: str, settings_doc: str | None) -> argparse.ArgumentParser:
    """A parser with ``--version`` and a ``--help`` whose epilog is ``settings_doc`` past its
    first paragraph; the caller adds its own options."""
    settings = (settings_doc or "").split("\n", 2)[2:]
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog="settings (environment):\n" + (settings[0] if settings else ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('cuvil')}")
    return parser

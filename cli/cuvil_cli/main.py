"""The ``cuvil`` command: one subcommand per module listed in COMMANDS.

Each module has ``register(subparsers)``, which adds its parser and sets ``handler`` to a
function ``(args) -> int``. Errors that users cause (bad spec, bad artifact, bad input) print one
clear line and exit 2; anything else is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = (
    "cuvil_cli.compile_command",
    "cuvil_cli.inspect_command",
    "cuvil_cli.run_command",
    "cuvil_cli.demo_command",
    "cuvil_cli.serve_command",
    "cuvil_cli.oci_commands",
    "cuvil_cli.trust_commands",
)


class UserError(Exception):
    """A problem with what the user asked for; printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cuvil", description="Compile, inspect, run and serve Cuvil artifacts."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (UserError, ValueError, LookupError, OSError) as error:
        print(f"cuvil {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The console the ``cuvil`` commands print their messages and progress on (stderr).

``soft_wrap``: rich never breaks a line at the console's width. A terminal wraps long lines
itself; piped, rich would break them at its default 80 columns, cutting a reference or a
``sha256:`` digest in two for whoever greps or copies it. The stage spinner shows only on a
terminal (piped, it would leave a blank line and nothing else).
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


def stderr_console() -> Console:
    return Console(stderr=True, soft_wrap=True)


def stage_progress(console: Console) -> Progress:
    """A spinner, the current stage and the time elapsed; gone once the block ends."""
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    return Progress(*columns, console=console, transient=True, disable=not console.is_terminal)

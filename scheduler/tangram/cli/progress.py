"""Progress bars on stderr (stdout stays clean for --json)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

_err = Console(stderr=True)


@contextmanager
def bar(label: str, total: int, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """Yields ``update(done, total)``."""
    if not enabled or not _err.is_terminal:
        yield lambda done, total: None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=_err,
        transient=True,
    ) as progress:
        task = progress.add_task(label, total=total)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update


def note(message: str) -> None:
    # Not wrapped at the console's width: in a log (80 columns when not a terminal) a URL
    # or a path broken over two lines could no longer be found or copied.
    _err.print(message, soft_wrap=True)

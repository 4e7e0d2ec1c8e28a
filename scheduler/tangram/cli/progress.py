"""Progress bars on stderr (stdout stays clean for --json)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text


def plain_console(**kwargs: Any) -> Console:
    """A console that prints strings verbatim: what the CLI prints holds paths, names and
    error text from the user, and rich's markup (``[bold]``, ``[/]``) or emoji codes
    (``:cat:``) in them would be eaten or raise MarkupError. Styles go in as
    :class:`rich.text.Text`."""
    return Console(markup=False, emoji=False, **kwargs)


_err = plain_console(stderr=True)


@contextmanager
def bar(label: str, total: int, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """Yields ``update(done, total)``."""
    if not enabled or not _err.is_terminal:
        yield lambda done, total: None
        return
    with Progress(
        TextColumn("{task.description}", markup=False),  # (a label may name a user's policy)
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


def note(message: str | Text) -> None:
    """``message`` on stderr, as written (a :class:`Text` with its styles)."""
    # Not wrapped at the console's width: in a log (80 columns when not a terminal) a URL
    # or a path broken over two lines could no longer be found or copied.
    _err.print(message, soft_wrap=True)

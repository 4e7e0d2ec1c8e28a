"""The ``tangram`` console script's entry point, and the first import of ``python -m
tangram.cli.main``: a Ctrl-C from here until :func:`tangram.cli.main.main` takes it says
``tangram: interrupted`` and exits 130, as one a moment later does.

The script imports the command line outside any ``try`` (``from ... import run``), and
those imports (argparse, logging, the thread pools) take a few hundredths of a second: a
Ctrl-C in them was a KeyboardInterrupt's traceback out of the script, and Python then
ended the process by SIGINT. Nothing is running yet, so nothing needs stopping: the
process leaves at once. What Python does before the script (``site``, the ``.pth`` files
of the environment) comes before any of this and is not covered.
"""

from __future__ import annotations

# Built in: the handler is in place before anything else is imported (``signal`` would
# import enum and functools first, when the environment has not yet).
import _signal  # type: ignore[import-not-found,unused-ignore]
import os

INTERRUPTED = 130  # as a shell reports a command that SIGINT ended


def _interrupted(signum: int, frame: object) -> None:
    os.write(2, b"tangram: interrupted\n")
    os._exit(INTERRUPTED)


_previous = _signal.getsignal(_signal.SIGINT)
if _previous is _signal.default_int_handler:  # (not a SIGINT the parent had ignored)
    _signal.signal(_signal.SIGINT, _interrupted)


def hand_over() -> None:
    """Ctrl-C is a KeyboardInterrupt again, which ``main`` ends the same way (and a
    command may take for its stop)."""
    if _signal.getsignal(_signal.SIGINT) is _interrupted:
        _signal.signal(_signal.SIGINT, _previous)


def run() -> None:
    """The ``tangram`` command."""
    from tangram.cli.main import run as run_cli  # (a Ctrl-C meanwhile: ``_interrupted``)

    run_cli()

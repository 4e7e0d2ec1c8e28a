"""Entry point of the ``tangram`` command; each sub-command lives in its own module."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from tangram.node_agent import daemon_threads


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("arl-tangram")
    except PackageNotFoundError:  # (run from a source tree that was never installed)
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    from tangram.cli.files import Parser

    parser = Parser(
        prog="tangram",
        description="ARL-Tangram: action-level pooling of external resources for agentic RL.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from tangram.cli import bench, crds, explain, operator, serve, trace, up

    up.register(sub)
    serve.register(sub)
    trace.register(sub)
    bench.register(sub)
    explain.register(sub)
    crds.register(sub)
    operator.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from tangram.cli.files import InputError, Interrupted

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors (exit 2, flag named) and --help (exit 0)
        return int(e.code or 0)
    try:
        code: int = args.run(args)
    except InputError as e:
        from tangram.service.logs import as_json

        if as_json():  # (a serve or an agent with --log-json: its log's last line)
            logging.getLogger("tangram.cli").error("%s", e)
        else:
            print(f"tangram: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"tangram: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # its reader left (``| head``): nothing more to say to it
        _quiet_stdout()
        return 141  # as a shell reports a command SIGPIPE ended
    try:
        sys.stdout.flush()  # (a reader that left shows here, at the last write)
    except BrokenPipeError:
        _quiet_stdout()
        return 141
    return code


def run() -> NoReturn:
    """The ``tangram`` command: ``main``, then the exit. A RewardService call abandoned at
    a stop may still run inside a library (a torch op); the interpreter's teardown under it
    aborts the process (SIGABRT, exit 134), so with one still running the process leaves
    without a teardown, its logs and output flushed first."""
    code = main()
    if daemon_threads.busy():
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that Python's own flush at exit does not fail again."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())


if __name__ == "__main__":
    run()

"""Entry point of the ``tangram`` command; each sub-command lives in its own module."""

from __future__ import annotations

if __name__ == "__main__":  # (python -m tangram.cli.main: a Ctrl-C in the imports below
    import tangram.cli.start  # noqa: F401  ends as in the console script's, that module's)

import argparse
import contextlib
import importlib
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


# Every command: the module that registers it (``register(sub)``) and its summary in
# ``tangram --help``, kept here so that listing them imports none: ``serve``, ``up`` and
# ``operator`` pull in the service, the Kubernetes client and more, seconds that ``trace``,
# ``bench`` and ``explain`` need not wait (tests/unit/test_cli_help.py checks that these
# summaries are the ones the modules register).
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("up", "run the scheduler and a local node agent (embedded mode)"),
    "serve": ("serve", "run the scheduler service of one pool (no local agent)"),
    "agent": ("serve", "run a node agent that serves a scheduler"),
    "trace": ("trace", "generate synthetic traces"),
    "bench": ("bench", "replay a trace under several policies, or run a benchmark"),
    "explain": ("explain", "show the scheduler's decision for a state, step by step"),
    "crds": (
        "crds",
        "write the CustomResourceDefinitions (and the chart's CRD templates) from the models",
    ),
    "operator": (
        "operator",
        "run the Kubernetes operator (ActionPool, TrajectoryEnv, RewardService)",
    ),
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser. With ``argv``, only the command it names is registered whole (its
    module imported); the others are listed by their summary. Without: all of them."""
    from tangram.cli.files import Parser

    parser = Parser(
        prog="tangram",
        description="ARL-Tangram: action-level pooling of external resources for agentic RL.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = _command_of(argv) if argv is not None else None
    done: set[str] = set()
    for name, (module, summary) in COMMANDS.items():
        if module in done:
            continue  # (it registered this command with another)
        if argv is None or name == named or COMMANDS.get(named or "", ("",))[0] == module:
            importlib.import_module(f"tangram.cli.{module}").register(sub)
            done.add(module)
        else:
            sub.add_parser(name, help=summary, add_help=False)  # listed; never run
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word that is no option (``tangram`` itself
    takes only ``--help`` and ``--version``)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        _take_ctrl_c()
        return _main(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:  # Ctrl-C while importing, before a command runs
        return _interrupted()


def _take_ctrl_c() -> None:
    """From here a Ctrl-C is a KeyboardInterrupt, ended here or by the command (which may
    take it for its stop): the console script's handler for its imports gives it back."""
    start = sys.modules.get("tangram.cli.start")
    if start is not None:
        start.hand_over()


def _interrupted() -> int:
    print("tangram: interrupted", file=sys.stderr)
    return 130  # as a shell reports a command that SIGINT ended


def _main(argv: list[str]) -> int:
    from tangram.cli.files import InputError, Interrupted, OutputError

    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors (exit 2, flag named) and --help (exit 0)
        return int(e.code or 0)
    try:
        code: int = args.run(args)
    except OutputError as e:  # stdout failed: nothing more can go there
        _quiet_stdout()
        print(f"tangram: error: {e}", file=sys.stderr)
        return 2
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
    except KeyboardInterrupt:  # (a command that did not take it: say so, as above)
        return _interrupted()
    except BrokenPipeError:  # its reader left (``| head``): nothing more to say to it
        _quiet_stdout()
        return 141  # as a shell reports a command SIGPIPE ended
    try:
        sys.stdout.flush()  # (a reader that left shows here, at the last write)
    except BrokenPipeError:
        _quiet_stdout()
        return 141
    except OSError as e:  # (a full disk, ``> /dev/full``)
        _quiet_stdout()
        print(f"tangram: error: cannot write to the standard output: {e.strerror}", file=sys.stderr)
        return 2
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

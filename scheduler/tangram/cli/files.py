"""Reading what the user gives — command lines and files — with errors that name the flag,
or the file, the line and the field."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import yaml
from pydantic import ValidationError

from tangram.api.cluster import ClusterSpec
from tangram.api.field_errors import described
from tangram.api.trace import TraceError, TrajectoryTrace, load_trace


class InputError(Exception):
    """Bad user input; the message is printed as is, without a traceback."""


class Interrupted(Exception):  # noqa: N818 (Ctrl-C, not an error)
    """Ctrl-C during a long run: the message says what had finished (its results were
    printed already); the command exits 130, as a plain Ctrl-C does."""


class DefaultsShown(argparse.HelpFormatter):
    """Help that says each flag's default: ``(default: …)`` is appended unless the text
    says it already (``(default``) or there is none to say (None, False, '')."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text, default = action.help, action.default
        if (
            not text
            or "(default" in text
            or not action.option_strings
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or default == ""
        ):
            return text
        return f"{text} (default: %(default)s)"


class RawDocDefaultsShown(argparse.RawDescriptionHelpFormatter, DefaultsShown):
    """:class:`DefaultsShown`, with the description printed as written (a docstring)."""


class Parser(argparse.ArgumentParser):
    """The ``tangram`` parser: its sub-commands' parsers are of this class too, and their
    help shows each flag's default (:class:`DefaultsShown`) unless given another
    formatter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)


def documented_command(sub: Any, name: str, summary: str, doc: str | None) -> Any:
    """A sub-command listed with ``summary``, whose ``--help`` shows its module's docstring
    ``doc`` as written."""
    return sub.add_parser(name, help=summary, description=doc, formatter_class=RawDocDefaultsShown)


def whole_number(least: int, most: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= ``least`` (and <= ``most``); argparse names the flag
    in its error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least or (most is not None and value > most):
            within = f"at least {least}" if most is None else f"{least} to {most}"
            raise argparse.ArgumentTypeError(f"must be {within}, got {value}")
        return value

    return parse


def port(text: str) -> int:
    """An argparse type: a TCP port."""
    value = whole_number(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1-65535)")
    return value


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds >= 0")
    return value


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):  # also NaN
        raise argparse.ArgumentTypeError(f"{text} is not a finite number > 0")
    return value


def check_writable(path: str | Path, flag: str, *, parents: bool = True) -> None:
    """Raise ``InputError`` now, before a long run, if ``path`` could not be written at its
    end: a folder, under a file, or not writable. ``parents``: the writer creates missing
    folders (otherwise its folder must exist). Writes nothing."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{flag}: cannot write {p}: Is a directory")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise InputError(f"{flag}: cannot write {p}: Permission denied")
        return
    folder = p.parent
    if not parents and not folder.exists():
        raise InputError(f"{flag}: cannot write {p}: No such file or directory")
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise InputError(f"{flag}: cannot write {p}: Not a directory ({folder} is a file)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{flag}: cannot write {p}: Permission denied")


def _read(path: str | Path, parse: Callable[[TextIO], Any], kind: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return parse(f)
    except OSError as e:
        raise InputError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: not valid {kind}: {e}") from None


def read_yaml(path: str | Path) -> Any:
    return _read(path, yaml.safe_load, "YAML")


def read_json(path: str | Path) -> Any:
    return _read(path, json.load, "JSON")


def load_cluster(path: str | Path) -> ClusterSpec:
    data = read_yaml(path)
    try:
        cluster = ClusterSpec.model_validate(data)
    except ValidationError as e:
        raise InputError(f"{path}: {described(e, '(top level)', most=5)}") from None
    if not cluster.nodes:
        raise InputError(f"{path}: nodes: a replay needs at least one node")
    return cluster


def load_trace_file(path: str | Path) -> list[TrajectoryTrace]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise InputError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        trace = load_trace(lines)
    except TraceError as e:
        raise InputError(f"{path}: {e}") from None
    if not trace:
        raise InputError(f"{path}: no trajectories")
    return trace


def dump_cluster(cluster: ClusterSpec) -> str:
    return yaml.safe_dump(cluster.model_dump(mode="json", exclude_none=True), sort_keys=False)

"""Reading what the user gives — command lines and files — with errors that name the flag,
or the file, the line and the field."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import sys
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tangram.api.cluster import ClusterSpec
from tangram.api.field_errors import described
from tangram.api.trace import JsonKeyError, TraceError, TrajectoryTrace, load_trace, strict_json


class InputError(Exception):
    """Bad user input; the message is printed as is, without a traceback."""


class OutputError(InputError):
    """The standard output could not be written (a full disk, ``> /dev/full``): said on
    stderr, exit 2 as for a file that cannot be written, no traceback."""


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


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (kubectl refuses it too):
    custom resources, cluster files. Without it the last one would win unseen."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"found key {key!r} twice (first on line {seen[key] + 1})",
                    key_node.start_mark,
                )
            if isinstance(key, Hashable):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float | int:
        """A float as ``kubectl`` sends it: Go's JSON writes a whole float64 (``2.0``,
        ``1e3``) as an integer, which an integer field takes."""
        value = float(super().construct_yaml_float(node))
        if math.isfinite(value) and value.is_integer() and abs(value) < 1e21:
            return int(value)
        return value


# PyYAML follows YAML 1.1, where a float needs a dot and a signed exponent: ``1e3`` and
# ``1.5e-3`` were strings, refused as "not a number", while kubectl (YAML 1.2 floats) takes them.
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _no_bom(path: str | Path, first: str) -> None:
    """Refuse a file that starts with a byte-order mark: the parsers would say only
    "unexpected character" at line 1 (JSON has none; some Windows editors add one)."""
    if first == "\ufeff":  # (one character once decoded)
        raise InputError(f"{path}: starts with a UTF-8 byte-order mark (BOM); save it without one")


def _read(path: str | Path, parse: Callable[[str], Any], kind: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()  # whole (a pipe cannot seek back)
        _no_bom(path, text[:1])
        return parse(text)
    except OSError as e:
        raise InputError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: not valid {kind}: {e}") from None
    except JsonKeyError as e:
        raise InputError(f"{path}: {e}") from None


def read_yaml(path: str | Path) -> Any:
    """One YAML document; a key given twice in a mapping is refused, naming it."""

    def parse(text: str) -> Any:
        stream = io.StringIO(text)
        stream.name = str(path)  # (its errors' marks name the file, not "<unicode string>")
        return yaml.load(stream, Loader=StrictLoader)  # (a SafeLoader)

    return _read(path, parse, "YAML")


def read_json(path: str | Path) -> Any:
    """One JSON document; a key given twice in an object, ``NaN`` or ``Infinity`` (Python
    reads them, JSON has no such numbers) are refused, naming them."""
    return _read(path, strict_json, "JSON")


def load_cluster(path: str | Path) -> ClusterSpec:
    data = read_yaml(path)
    try:
        # Strict: ``cpus: "8"`` or ``cpus: true`` is no core count (an integer still takes a
        # float field; StrictLoader reads a whole float, ``8.0``, as an integer).
        cluster = ClusterSpec.model_validate(data, strict=True)
    except ValidationError as e:
        raise InputError(f"{path}: {described(e, '(top level)', most=5)}") from None
    if not cluster.nodes:
        raise InputError(f"{path}: nodes: a replay needs at least one node")
    return cluster


STDIN = "-"  # a file name that means the standard input, as for most commands


def _trace_lines(path: str | Path) -> list[str]:
    try:
        if str(path) == STDIN:
            return sys.stdin.readlines()
        with open(path, encoding="utf-8") as f:
            return f.readlines()
    except OSError as e:
        raise InputError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def load_trace_file(path: str | Path) -> list[TrajectoryTrace]:
    """The trace at ``path`` (``-``: the standard input), refused whole, naming the file,
    when it holds no trajectory or no action at all: a replay of it would report zeros."""
    lines = _trace_lines(path)
    _no_bom(path, lines[0][:1] if lines else "")
    try:
        trace = load_trace(lines)
    except TraceError as e:
        raise InputError(f"{path}: {e}") from None
    if not trace:
        raise InputError(f"{path}: no trajectories")
    if not any(t.steps for t in trace):
        # A trajectory without steps among others is kept: an episode the LLM ends without
        # a tool call is real, and holds its memory (and its pod under k8s-static).
        raise InputError(f"{path}: no actions: none of its trajectories has a step")
    return trace


def dump_cluster(cluster: ClusterSpec) -> str:
    return yaml.safe_dump(cluster.model_dump(mode="json", exclude_none=True), sort_keys=False)

"""What ``--help`` says matches what each command takes."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest

from tangram.cli.main import build_parser


def _help(*argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return capsys.readouterr().out


def test_up_offers_and_explains_only_the_runtimes_it_takes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = " ".join(_help("up", capsys=capsys).split())
    assert "{auto,docker,process,noop}" in text
    assert "pod:" not in text  # the operator's runtime: `tangram agent --runtime pod`
    assert "--host HOST address to serve on" in text


def test_every_command_has_a_summary_in_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys=capsys)
    for command in ("up", "serve", "agent", "bench", "explain", "crds", "operator"):
        assert f"    {command} " in text, command


def _parsers(parser: argparse.ArgumentParser, name: str = "tangram") -> Iterator[tuple[str, Any]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _parsers(p, f"{name} {sub}")


def test_every_flag_with_a_default_says_it() -> None:
    """(`--grace` 10, `--idle-cores` 1, `bench --policy` elastic, ... were not said.)"""
    for name, parser in _parsers(build_parser()):
        for action in parser._actions:
            default = action.default
            none = default is None or default is False or default == argparse.SUPPRESS
            if not action.option_strings or none or default == "":
                continue
            # as --help prints it: the flag and its help, the default appended or written
            said = " ".join(parser._get_formatter()._format_action(action).split())
            assert "(default" in said, f"{name}: {said!r} says no default"


def test_serve_and_agent_say_what_they_are(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("serve", "agent"):
        head = _help(command, capsys=capsys).split("options:")[0]
        assert "What a cluster's" in " ".join(head.split()).replace("what", "What"), head

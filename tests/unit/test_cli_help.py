"""What ``--help`` says matches what each command takes."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tangram.cli import main as main_module
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


def test_the_list_of_commands_imports_none_and_says_what_they_register(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`tangram --help` lists every command from main.COMMANDS without importing them: it
    must read as the list their modules register does."""
    full = _help(capsys=capsys)
    with pytest.raises(SystemExit):
        build_parser(["--help"]).parse_args(["--help"])
    assert capsys.readouterr().out == full


@pytest.mark.parametrize("command", ["trace", "bench", "explain"])
def test_the_simulator_commands_start_without_the_service(command: str) -> None:
    """(`build_parser` imported every command, the service and the Kubernetes client
    among them: seconds before `tangram bench` started.)"""
    code = (
        "import sys; from tangram.cli.main import build_parser; "
        f"build_parser([{command!r}, '--help']); "
        "print(sorted(m for m in sys.modules if m.startswith(('tangram.service', 'kubernetes', "
        "'fastapi', 'kopf', 'tangram.operator'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_ctrl_c_while_starting_ends_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(argv: object = None) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(main_module, "build_parser", interrupted)
    try:
        code = main_module.main(["bench", "--help"])
    except KeyboardInterrupt:  # (it escaped main, with its traceback)
        pytest.fail("Ctrl-C while starting escaped main")
    assert code == 130
    assert capsys.readouterr().err == "tangram: interrupted\n"


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

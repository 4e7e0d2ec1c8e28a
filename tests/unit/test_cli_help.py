"""What ``--help`` says matches what each command takes."""

from __future__ import annotations

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

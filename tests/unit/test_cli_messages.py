"""What `tangram up`, `serve` and `agent` say, and how: user text (paths, a refused
reload's problem) printed as it is, whatever its brackets; with --log-json nothing but
JSON lines; the default level showing nodes and links come and go; a SIGHUP during the
start kept for when it is ready."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rich.table import Table

from tangram.cli.main import main
from tangram.cli.progress import note
from tangram.cli.up import load_tokens
from tangram.client import Client
from tangram.service.auth import TokenStore
from tangram.service.embedded import free_port
from tests.unit.test_cli_stop import LOCAL_POOL, ROOT, Lines, _stopped

BRACKETS = "[bold]b[/] :cat:"  # rich markup and an emoji code, neither to be read as such


def _tangram(
    *argv: str, tokens: Path, err_only: bool = False
) -> tuple[subprocess.Popen[str], Lines]:
    """A ``tangram`` process; its stderr (and, unless ``err_only``, its stdout) read."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tangram.cli.main", *argv],
        cwd=ROOT,
        env={**os.environ, "TANGRAM_TOKEN_FILE": str(tokens)},
        stdout=subprocess.DEVNULL if err_only else subprocess.PIPE,
        stderr=subprocess.PIPE if err_only else subprocess.STDOUT,
        text=True,
    )
    stream = proc.stderr if err_only else proc.stdout
    assert stream is not None
    return proc, Lines(stream)


def _pool(tmp_path: Path, name: str = "p") -> Path:
    pool = tmp_path / name
    pool.mkdir()
    (pool / "pool.yaml").write_text((Path(LOCAL_POOL) / "pool.yaml").read_text())
    return pool


def _misspell(pool: Path) -> None:
    """An unknown key under spec.scheduling whose name is rich's closing tag."""
    text = (pool / "pool.yaml").read_text()
    (pool / "pool.yaml").write_text(
        text.replace("  scheduling:\n", '  scheduling:\n    "[/]": 1\n')
    )


def test_a_note_prints_markup_and_emoji_codes_as_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    note(f"path /tmp/{BRACKETS}")
    assert capsys.readouterr().err == f"path /tmp/{BRACKETS}\n"


def test_a_tables_cells_are_printed_as_written() -> None:
    from tangram.cli.progress import plain_console  # (the bench's and explain's console)

    console = plain_console(width=120, record=True, file=io.StringIO())
    t = Table(title=f"trace {BRACKETS}")
    t.add_column("policy")
    t.add_row(f"p{BRACKETS}")
    console.print(t)
    out = console.export_text()
    assert "trace [bold]b[/]" in out and ":cat:" in out.splitlines()[1]  # (the title wraps)
    assert f"p{BRACKETS}" in out


def test_up_prints_paths_and_a_refused_reload_with_brackets_as_they_are(
    tmp_path: Path, reaped: list[subprocess.Popen[str]]
) -> None:
    """A state directory with ``[/]`` ended the start in a MarkupError; one with
    ``[bold]`` lost it from the path printed; a refused reload whose problem named a
    ``[/]`` key said nothing but an asyncio traceback."""
    pool, state, tokens = _pool(tmp_path, "p[bold]"), tmp_path / "s[/]x", tmp_path / "t[bold]"
    proc, out = _tangram(
        "up", "-f", str(pool), "--port", str(free_port()), "--runtime", "noop",
        "--state-dir", str(state), "--token-file", str(tokens), tokens=tokens,
    )  # fmt: skip
    reaped.append(proc)
    out.wait_for("reloads the files", proc)  # (the banner's last line: SIGHUP is handled)
    assert f"learned state: {state}/learned/local.json" in out.text(), out.text()
    assert f"token file: {tokens}\n" in out.text()
    _misspell(pool)
    proc.send_signal(signal.SIGHUP)
    refused = out.wait_for("reload refused", proc)
    assert "spec.scheduling['[/]']: unknown field" in refused, refused
    proc.send_signal(signal.SIGINT)
    assert _stopped(proc) == 0, out.text()
    assert "Traceback" not in out.text() and "MarkupError" not in out.text()


def _records(out: Lines) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.lines]  # (any other line fails here)


def test_with_log_json_every_line_up_writes_is_json(
    tmp_path: Path, reaped: list[subprocess.Popen[str]]
) -> None:
    """The banner, a refused and an applied reload, the stop: records with their fields,
    not text among the JSON lines a cluster's log pipeline reads."""
    pool, tokens, port = _pool(tmp_path), tmp_path / "tokens", free_port()
    TokenStore.create(tokens)  # (its "created" line is said too, but not asserted here)
    proc, out = _tangram(
        "up", "-f", str(pool), "--port", str(port), "--runtime", "noop", "--log-json",
        "--state-dir", str(tmp_path / "state"), "--learned-file", "", tokens=tokens,
        err_only=True,
    )  # fmt: skip
    reaped.append(proc)
    out.wait_for("ready at", proc)
    _misspell(pool)
    proc.send_signal(signal.SIGHUP)
    out.wait_for("reload refused", proc)
    (pool / "pool.yaml").write_text((Path(LOCAL_POOL) / "pool.yaml").read_text()
                                    .replace("depth: 2", "depth: 3"))  # fmt: skip
    proc.send_signal(signal.SIGHUP)
    out.wait_for("reloaded", proc)
    proc.send_signal(signal.SIGINT)
    assert _stopped(proc) == 0, out.text()
    by_msg = {str(r["msg"]).partition(":")[0]: r for r in _records(out)}
    ready = by_msg["ARL-Tangram pool local ready at http"]
    assert ready["url"] == f"http://127.0.0.1:{port}" and ready["level"] == "info"
    assert ready["logger"] == "tangram.cli" and str(ready["ts"]).endswith("Z")
    refused = by_msg["reload refused"]
    assert refused["level"] == "warning" and refused["via"] == "SIGHUP"
    assert any("[/]" in r for r in refused["reasons"])  # type: ignore[attr-defined]
    assert by_msg["reloaded"]["changes"] == ["scheduling"]
    assert "stopped; every environment was removed" in by_msg
    joined = by_msg["node vm joined"]  # (at the default level, with its node)
    assert joined["node"] == "vm" and joined["logger"] == "tangram.service.nodes"


def test_serve_and_agent_say_at_the_default_level_when_the_link_comes_and_goes(
    tmp_path: Path, reaped: list[subprocess.Popen[str]]
) -> None:
    """Without -v: the scheduler logs the agent joining (as it logs it leaving), the agent
    logs its connect, its failures naming the URL, and its connect again after them; serve
    says it stopped. With -v the agent logs each action it runs, with its ids."""
    port, tokens = free_port(), tmp_path / "tokens"
    TokenStore.create(tokens)
    serve_argv = ("serve", "-f", LOCAL_POOL, "--port", str(port), "--learned-file", "")
    serve, serve_out = _tangram(*serve_argv, tokens=tokens)
    reaped.append(serve)
    serve_out.wait_for("agents at", serve)
    url = f"ws://127.0.0.1:{port}/v1/agents"
    agent, agent_out = _tangram(
        "agent", "--scheduler", url, "--runtime", "noop", "--node", "n1", "-v",
        "--state-dir", str(tmp_path / "agent"), tokens=tokens,
    )  # fmt: skip
    reaped.append(agent)
    assert "node n1 joined" in serve_out.wait_for("joined", serve)
    assert f"connected to {url} as n1" in agent_out.wait_for("connected to", agent)
    with Client(f"http://127.0.0.1:{port}", TokenStore.load(tokens).token_for("local")) as c:
        t = c.open("sandbox")
        c.exec(t.id, ["true"])
    ran = agent_out.wait_for(" exec ran", agent)
    assert f"trajectory={t.id}" in ran and "node=n1" in ran and "status=ok" in ran, ran
    serve.send_signal(signal.SIGINT)
    assert _stopped(serve) == 0, serve_out.text()
    assert "stopped; environments stay on their nodes" in serve_out.text()
    failed = agent_out.wait_for(f"scheduler link to {url}:", agent)
    assert "WARNING" in failed and "retrying in" in failed
    serve, serve_out = _tangram(*serve_argv, tokens=tokens)  # the same port, again
    reaped.append(serve)
    again = agent_out.wait_for("again after", agent)
    assert f"connected to {url} as n1 again after " in again and "failed attempt" in again
    serve_out.wait_for("node n1 joined", serve)
    for p in (agent, serve):
        p.send_signal(signal.SIGINT)
        assert _stopped(p) == 0
    assert "agent n1 stopped" in agent_out.text()
    assert "Traceback" not in agent_out.text() + serve_out.text()


def test_a_sighup_during_the_start_is_kept_for_when_it_is_ready(
    tmp_path: Path, reaped: list[subprocess.Popen[str]]
) -> None:
    """The banner says SIGHUP reloads; one before the banner ended the process (129)."""
    tokens = tmp_path / "tokens"
    proc, out = _tangram(
        "up", "-f", LOCAL_POOL, "--port", str(free_port()), "--runtime", "noop",
        "--state-dir", str(tmp_path / "state"), "--learned-file", "", tokens=tokens,
    )  # fmt: skip
    reaped.append(proc)
    out.wait_for(f"created {tokens}", proc)  # (said during the start, before serving)
    proc.send_signal(signal.SIGHUP)
    out.wait_for("ready at", proc)
    out.wait_for("reloaded: no changes", proc)
    proc.send_signal(signal.SIGINT)
    assert _stopped(proc) == 0, out.text()


def test_a_bad_state_dir_is_named_as_the_flag_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile, tokens = tmp_path / "afile", tmp_path / "tokens"
    afile.write_text("")
    TokenStore.create(tokens)
    for state in (afile, afile / "sub"):
        code = main(["up", "-f", LOCAL_POOL, "--port", str(free_port()), "--runtime", "noop",
                     "--token-file", str(tokens), "--state-dir", str(state)])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"tangram: error: --state-dir {state}: "), err


def test_a_token_file_every_user_can_read_is_warned_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tmp_path / "tokens"
    TokenStore.create(tokens)
    load_tokens(tokens)
    assert capsys.readouterr().err == ""
    tokens.chmod(0o440)  # (the operator mounts the scheduler's so, for its fsGroup)
    load_tokens(tokens)
    assert capsys.readouterr().err == ""
    tokens.chmod(0o644)
    assert load_tokens(tokens).token_for("local") is not None  # warned, not refused
    err = capsys.readouterr().err
    assert f"--token-file {tokens}: mode 0644" in err and "every user" in err, err


@pytest.mark.parametrize("command", ["serve", "agent"])
def test_help_says_the_token_files_default_once(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    token_help = text.split("--token-file TOKEN_FILE", 2)[2].split(" --", 1)[0]
    assert token_help.count("default") == 1, token_help


def test_the_log_level_default_shows_lifecycle_records_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """(a unit check of what the process tests show: the default level is WARNING, with
    the lifecycle loggers' INFO records let through)"""
    from tangram.service.logs import LIFECYCLE, setup

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    levels = {n: logging.getLogger(n).level for n in LIFECYCLE}  # setup() sets them too
    try:
        setup(verbose=False, as_json=False)
        assert not logging.getLogger("tangram.service").isEnabledFor(logging.INFO)
        assert all(logging.getLogger(n).isEnabledFor(logging.INFO) for n in LIFECYCLE)
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        for name, level in levels.items():  # (later tests in this worker see the defaults)
            logging.getLogger(name).setLevel(level)

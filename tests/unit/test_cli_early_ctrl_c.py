"""Ctrl-C early in ``tangram up``'s start: never a traceback.

Each case runs the ``tangram`` console script (as pip writes it, from pyproject.toml's
entry point) in a real process with a hook that holds it at one point of its start and
says so on stdout; the test then sends it SIGINT, as a terminal's Ctrl-C does. Until the
running service takes SIGINT for its stop, the start ends with ``tangram: interrupted``
and exit status 130, the local agent stopped if it was made; from there on it is the
stop (``stopped; every environment was removed``, exit status 0). docs/service.md says
both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tangram.service.embedded import free_port

from .test_cli_stop import LOCAL_POOL, ROOT, Lines, _stopped

# What the console script does (pip's template), the entry point read from pyproject.toml.
_PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
_MODULE, _, _FUNCTION = _PROJECT["scripts"]["tangram"].partition(":")
SCRIPT = f"import sys\nfrom {_MODULE} import {_FUNCTION}\nsys.exit({_FUNCTION}())\n"
# As ``python -m tangram.cli.main`` runs it (the tests' and benchmarks' way).
AS_MODULE = "import runpy\nrunpy.run_module('tangram.cli.main', run_name='__main__')\n"

HOOKS = """
import os, signal, sys, time

POINT = os.environ["HOLD_AT"]


def hold(where):
    print(f"holding {where}", flush=True)
    while True:  # until the SIGINT the test sends
        time.sleep(0.01)


class HoldOnImport:  # holds the import of a module, inside the import of its importer
    def __init__(self, module):
        self.module = module

    def find_spec(self, name, path=None, target=None):
        if name == self.module:
            sys.meta_path.remove(self)
            hold(f"importing {name}")
        return None


if POINT in ("cli imports", "command imports"):
    # tangram.cli.main imports daemon_threads; the up command's modules, embedded
    module = {"cli imports": "tangram.node_agent.daemon_threads",
              "command imports": "tangram.service.embedded"}[POINT]
    sys.meta_path.insert(0, HoldOnImport(module))
else:
    from tangram.cli import up

    shut_down = up.shut_down

    def said_shut_down(agent):
        shut_down(agent)
        print("the agent was shut down", flush=True)

    up.shut_down = said_shut_down
    if POINT == "agent made":  # reckoning the warnings, just after the agent was made

        def fit_warnings(*args, **kwargs):
            hold("with the agent made")

        up.fit_warnings = fit_warnings
    elif POINT == "loop started":  # in the loop, before the stop's handlers are in place
        install = up.stop_on_signals

        def stop_on_signals(*args):
            came = []
            handler = signal.getsignal(signal.SIGINT)  # (whatever takes it there)

            def noted(signum, frame):
                came.append(signum)
                handler(signum, frame)

            signal.signal(signal.SIGINT, noted)
            print("holding in the loop", flush=True)
            while not came:
                time.sleep(0.01)
            signal.signal(signal.SIGINT, handler)
            install(*args)  # (the rest of the start, as after a SIGINT just then)

        up.stop_on_signals = stop_on_signals
    elif POINT == "serving":  # the stop's handlers in place, not yet ready
        serve = up.run

        async def run(config, tokens, agent, stop, **kwargs):
            print("holding with the handlers in place", flush=True)
            await stop.wait()
            await serve(config, tokens, agent, stop, **kwargs)

        up.run = run
"""

INTERRUPTED = (130, "tangram: interrupted")
STOPPED = (0, "stopped; every environment was removed")


def _up(tmp: Path, point: str, launch: str) -> tuple[subprocess.Popen[str], Lines, Lines]:
    argv = ["up", "-f", LOCAL_POOL, "--runtime", "noop", "--port", str(free_port()),
            "--state-dir", str(tmp / "state"), "--learned-file", ""]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", HOOKS + launch, *argv],
        cwd=ROOT,
        env={**os.environ, "HOLD_AT": point, "TANGRAM_TOKEN_FILE": str(tmp / "tokens")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    return proc, Lines(proc.stdout), Lines(proc.stderr)


@pytest.mark.parametrize(
    ("point", "launch", "ends"),
    [
        # (before: a KeyboardInterrupt's traceback out of the script's import, rc -2)
        ("cli imports", SCRIPT, INTERRUPTED),
        ("cli imports", AS_MODULE, INTERRUPTED),
        ("command imports", SCRIPT, INTERRUPTED),
        ("agent made", SCRIPT, INTERRUPTED),  # (before: the agent left running)
        ("loop started", SCRIPT, INTERRUPTED),  # (before: uvicorn's CancelledError traceback)
        ("serving", SCRIPT, STOPPED),  # (the embedded run stops its agent)
    ],
)
def test_ctrl_c_early_in_the_start_of_up_ends_it_cleanly(
    tmp_path: Path,
    reaped: list[subprocess.Popen[str]],
    point: str,
    launch: str,
    ends: tuple[int, str],
) -> None:
    proc, out, err = _up(tmp_path, point, launch)
    reaped.append(proc)
    out.wait_for("holding", proc)
    proc.send_signal(signal.SIGINT)
    code, said = ends
    assert _stopped(proc) == code, err.text()
    err.wait_for(said, proc)
    assert "Traceback" not in err.text() and "KeyboardInterrupt" not in err.text(), err.text()
    agent_made = point in ("agent made", "loop started")  # and the start ended: stopped
    assert ("the agent was shut down" in out.text()) == agent_made, out.text()


def test_ctrl_c_as_up_reads_its_files_ends_it_cleanly(
    tmp_path: Path, reaped: list[subprocess.Popen[str]]
) -> None:
    """The installed console script, no hook: a Ctrl-C sent as soon as the start says it
    made the token file lands wherever the start then is, and ends it as one of the two."""
    script = Path(sys.executable).parent / "tangram"
    if not script.exists():
        pytest.skip(f"no console script at {script}")
    proc = subprocess.Popen(
        [str(script), "up", "-f", LOCAL_POOL, "--runtime", "noop", "--port", str(free_port()),
         "--state-dir", str(tmp_path / "state"), "--learned-file", ""],
        cwd=ROOT, env={**os.environ, "TANGRAM_TOKEN_FILE": str(tmp_path / "tokens")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    reaped.append(proc)
    assert proc.stdout is not None
    out = Lines(proc.stdout)
    out.wait_for(f"created {tmp_path / 'tokens'}", proc)  # (said during the start)
    proc.send_signal(signal.SIGINT)
    code = _stopped(proc)
    ends = dict([INTERRUPTED, STOPPED])
    assert code in ends, out.text()
    out.wait_for(ends[code], proc)
    assert "Traceback" not in out.text(), out.text()

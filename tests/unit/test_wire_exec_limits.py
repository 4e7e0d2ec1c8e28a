"""A command the environment's exec server could never start (over its 4,096 arguments or
variables, or its 1 MiB request, or Linux's 128 KiB for one of them) is refused at admission,
naming the field: it took a core and only then failed (``exec_failed: "argv: 50003 entries,
over the exec server's 4096"``)."""

from __future__ import annotations

import asyncio
import errno
import subprocess

import pytest

from tangram.api.wire import (
    EXEC_MAX_BYTES,
    EXEC_MAX_ENTRIES,
    EXEC_MAX_ENTRY_BYTES,
    BatchItem,
    EnvSpec,
    ExecRequest,
    OpenTrajectory,
    exec_server_problem,
)
from tangram.node_agent import exec_server
from tangram.service.config import ActionProfile, EnvConfig
from tangram.service.engine import Engine
from tangram.service.records import EngineError
from tests.fixtures.fake_agent import Agent, connect, hello, run


def test_the_bounds_are_the_exec_servers() -> None:
    assert (EXEC_MAX_ENTRIES, EXEC_MAX_BYTES) == (exec_server.MAX_ARGS, exec_server.MAX_FRAME)


def _vars(n: int, first: int = 0) -> dict[str, str]:
    return {f"V{i}": "" for i in range(first, first + n)}


def test_entries_over_the_bound_are_refused_naming_their_field() -> None:
    assert exec_server_problem(["x"] * EXEC_MAX_ENTRIES, {}) is None
    assert exec_server_problem(["x"] * (EXEC_MAX_ENTRIES + 1), {}) == (
        "argv", "4097 entries, over the exec server's 4096"
    )  # fmt: skip
    # The agent adds TANGRAM_DOP to the command's variables.
    assert exec_server_problem(["x"], _vars(EXEC_MAX_ENTRIES - 1)) is None
    field, why = exec_server_problem(["x"], _vars(EXEC_MAX_ENTRIES)) or ("", "")
    assert field == "env" and why.startswith("4097 variables")
    assert exec_server_problem(["x"], {**_vars(EXEC_MAX_ENTRIES - 1), "TANGRAM_DOP": "1"}) is None


_ENTRY = "a" * (EXEC_MAX_ENTRY_BYTES - 1)  # the longest argument Linux takes, with its NUL
_FULL = EXEC_MAX_BYTES // EXEC_MAX_ENTRY_BYTES  # so many of them fill the request


def test_bytes_over_the_bound_are_refused_naming_the_larger_part() -> None:
    most = [_ENTRY] * (_FULL - 1) + ["a" * (EXEC_MAX_ENTRY_BYTES - 1)]
    assert exec_server_problem(most, {}) is None
    field, why = exec_server_problem([*most, ""], {}) or ("", "")  # one NUL more
    assert field == "argv" and f"over the {EXEC_MAX_BYTES}" in why
    # ``{dop}`` becomes one digit at least: what may fit once rendered is not refused.
    assert exec_server_problem([*most[:-1], "a" * (EXEC_MAX_ENTRY_BYTES - 2) + "{dop}"], {}) is None
    wide = {f"A{i}": "é" * 60_000 for i in range(_FULL + 1)}  # (counted in UTF-8 bytes)
    assert _field(["true"], wide) == "env"
    # Half each, 1 KiB an entry with its NUL ("V000=" and 1,018 bytes): the bound exactly.
    args, env = ["a" * 1023] * 512, {f"V{i:03}": "a" * 1018 for i in range(512)}
    assert _field(args, env) is None
    assert _field([*args[1:], "a" * 1024], env) == "argv"
    assert _field(args, {**env, "V000": "a" * 1019}) == "env"


def test_one_argument_or_variable_over_linuxs_bound_is_refused() -> None:
    """Linux refuses an argv or envp entry over MAX_ARG_STRLEN (E2BIG) however small the
    rest: the command took its cores, then failed to start."""
    assert exec_server_problem([_ENTRY], {"V": "a" * (EXEC_MAX_ENTRY_BYTES - 3)}) is None
    field, why = exec_server_problem(["sh", "-c", _ENTRY + "a"], {}) or ("", "")
    assert field == "argv" and why.startswith(f"an argument of {EXEC_MAX_ENTRY_BYTES + 1} bytes")
    assert "MAX_ARG_STRLEN" in why and "stdin or a file" in why
    field, why = exec_server_problem(["true"], {"V": "é" * (EXEC_MAX_ENTRY_BYTES // 2)}) or ("", "")
    assert field == "env" and why.startswith("variable 'V': ")


def _field(argv: list[str], environ: dict[str, str]) -> str | None:
    problem = exec_server_problem(argv, environ)
    return None if problem is None else problem[0]


ENV = EnvConfig(
    spec=EnvSpec(name="e", image="i", memory_gb=1.0),
    profiles={"p": ActionProfile(command=("echo",))},
)


def test_a_command_over_the_bounds_is_refused_before_it_queues() -> None:
    async def scenario(engine: Engine) -> None:
        agent = Agent(hello())
        await connect(engine, agent)
        env_vars = _vars(100)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1", env_vars=env_vars))
        over = ["x"] * (EXEC_MAX_ENTRIES + 1)
        cases = [
            (ExecRequest(argv=over), "argv"),
            (ExecRequest(profile="p", args=over[1:]), "args"),  # with the profile's command
            # With the trajectory's env_vars (and TANGRAM_DOP): one more than the bound.
            (ExecRequest(argv=["true"], env=_vars(EXEC_MAX_ENTRIES - 100, 100)), "env"),
        ]
        for req, field in cases:
            with pytest.raises(EngineError) as e:
                engine.submit_exec("u", "t1", req)
            assert (e.value.kind, e.value.field) == ("invalid", field), e.value
        with pytest.raises(EngineError) as e:
            engine.submit_batch("u", [BatchItem(trajectory="t1", exec=ExecRequest(argv=over))])
        assert e.value.field == "actions.0.exec.argv"
        assert not engine.state.actions and not agent.ops("exec")  # nothing queued, or run

        # At the bounds it is admitted and sent.
        engine.submit_exec("u", "t1", ExecRequest(argv=over[1:]))
        engine.submit_exec("u", "t1", ExecRequest(profile="p", args=over[2:]))
        at_most = _vars(EXEC_MAX_ENTRIES - 101, 100)  # with the 100 env_vars and TANGRAM_DOP
        engine.submit_exec("u", "t1", ExecRequest(argv=["true"], env=at_most))
        while len(agent.ops("exec")) < 3:
            await asyncio.sleep(0)
        sent = agent.ops("exec")
        assert [len(m["argv"]) for m in sent] == [EXEC_MAX_ENTRIES, EXEC_MAX_ENTRIES, 1]
        assert len(sent[2]["environ"]) == EXEC_MAX_ENTRIES - 1

    run(scenario, env=ENV)


def test_the_entry_bound_is_the_kernels() -> None:
    """The bound is this kernel's: ``true`` starts with the longest argument and variable
    admitted, and one byte more is E2BIG."""
    subprocess.run(["true", _ENTRY], check=True)
    subprocess.run(["true"], env={"V": "a" * (EXEC_MAX_ENTRY_BYTES - 3)}, check=True)
    for argv, environ in ((["true", _ENTRY + "a"], {}), (["true"], {"V": _ENTRY[2:] + "a"})):
        with pytest.raises(OSError) as e:
            subprocess.run(argv, env=environ, check=True)
        assert e.value.errno == errno.E2BIG
        assert exec_server_problem(argv, environ) is not None

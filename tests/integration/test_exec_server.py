"""The exec server and the sessions on top of it, run as a host process (no Docker).

The same static binary is every fast-path container's PID 1; here it serves a socket in
a temporary directory so that its protocol, its kill semantics and the bash and Python
sessions are tested on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from tangram.node_agent import env_files
from tangram.node_agent.exec_server import MAX_ARGS, MAX_FRAME, Built, Channel
from tangram.node_agent.execution import ExecError
from tangram.node_agent.sessions import BashSession, PythonSession, ansi_c_quote

from .host_env import file_answer
from .service_harness import until


@contextmanager
def serving(execd: Built, launcher: Sequence[str] = ()) -> Iterator[tuple[Path, int]]:
    """The exec server on a socket of its own, started through ``launcher`` (a command
    that execs its arguments): the socket and the server's pid."""
    assert execd.path is not None
    run_dir = Path(tempfile.mkdtemp(prefix="execd-", dir="/tmp"))  # short: a socket path
    sock = run_dir / "exec.sock"
    proc = subprocess.Popen([*launcher, str(execd.path), str(sock)], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        yield sock, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def server(execd: Built) -> Iterator[Path]:
    with serving(execd) as (sock, _):
        yield sock


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


async def collect(sock: Path, argv: list[str], **kw: object) -> tuple[bytes, bytes, int | None]:
    chan = await Channel.start(sock, argv, **kw)  # type: ignore[arg-type]
    out = await chan.collect(1 << 20)
    chan.close()
    return out.stdout, out.stderr, chan.exit_code


def test_argv_env_and_cwd_reach_the_command(server: Path, tmp_path: Path) -> None:
    out, err, code = asyncio.run(
        collect(
            server,
            ["sh", "-c", 'echo "$A|$(pwd)|$1"; echo oops >&2; exit 4', "sh", "a b;c"],
            cwd=str(tmp_path),
            env={"A": "x y"},
        )
    )
    assert out == f"x y|{tmp_path}|a b;c\n".encode() and err == b"oops\n" and code == 4


def test_the_servers_limits_are_said_as_limits_and_what_is_within_them_runs(
    server: Path,
) -> None:
    """Past 4096 variables the server said "bad argv count"; past its 1 MiB frame it hung
    up unanswered, which reads as its pids limit. Both are said before anything is sent."""
    most = ["sh", "-c", 'echo "$#"', "sh", *(["a"] * (MAX_ARGS - 4))]
    assert asyncio.run(collect(server, most))[0] == f"{MAX_ARGS - 4}\n".encode()
    many_env = {f"V{i}": "" for i in range(MAX_ARGS + 1)}
    for argv, env, said in [
        ([*most, "one more"], {}, f"argv: {MAX_ARGS + 1} entries, over the exec server's"),
        (["true"], many_env, f"env: {MAX_ARGS + 1} entries, over the exec server's"),
        (["echo", "x" * MAX_FRAME], {}, "argv and env: 1048592 bytes in all, over"),
    ]:
        with pytest.raises(ExecError, match=said):
            asyncio.run(collect(server, argv, env=env))
    # within the frame: it runs (the kernel takes 128 KiB an argument at most)
    within = ["sh", "-c", 'echo "$#"', "sh", *(["y" * 100_000] * 9)]
    assert asyncio.run(collect(server, within))[0] == b"9\n"


def test_the_exit_status_arrives_though_input_was_left_unread(server: Path) -> None:
    """The command ends with input still on its way: the server closed a socket with data
    unread, which resets the connection, and the agent's reader dropped the exit status
    it had not read yet (an action then ended with no exit code). Tried a number of times:
    the reset raced the reading."""

    async def once() -> int | None:
        chan = await Channel.start(server, ["sh", "-c", "exit 3"])
        with contextlib.suppress(ExecError):  # (the server may be gone before it is sent)
            await chan.write(b"x" * (4 << 20))
        await chan.collect(1 << 20)
        chan.close()
        return chan.exit_code

    async def many() -> list[int | None]:
        return [await once() for _ in range(30)]

    assert set(asyncio.run(many())) == {3}


def _ignored(status: str) -> set[signal.Signals]:
    """The standard signals a /proc/PID/status says are ignored (glibc reserves 32 and 33,
    which no program can reset, and a caller may have them ignored)."""
    line = next(ln for ln in status.splitlines() if ln.startswith("SigIgn:"))
    bits = int(line.split()[1], 16)
    return {signal.Signals(n) for n in range(1, 32) if bits >> (n - 1) & 1}


def test_a_command_starts_with_every_signal_at_its_default(execd: Built) -> None:
    """A server started in the background (SIGINT and SIGQUIT ignored) or by Python
    (SIGPIPE ignored) must not hand that on: its commands could not be interrupted."""
    # As `server &` in a script: the shell ignores SIGINT and SIGQUIT (and here SIGHUP and
    # SIGPIPE), and exec keeps what is ignored.
    trap = ["sh", "-c", 'trap "" INT QUIT HUP PIPE; exec "$0" "$1"']
    with serving(execd, trap) as (sock, pid):
        server_ignores = _ignored(Path(f"/proc/{pid}/status").read_text())
        assert {signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGPIPE} <= server_ignores
        out, _, code = asyncio.run(collect(sock, ["grep", "^SigIgn", "/proc/self/status"]))
        assert code == 0 and _ignored(out.decode()) == set()


def test_stdin_is_streamed_and_closed(server: Path) -> None:
    async def scenario() -> bytes:
        chan = await Channel.start(server, ["tr", "a-z", "A-Z"])
        await chan.write(b"hello ")
        await chan.write(b"world")
        await chan.close_stdin()
        out = await chan.collect(1 << 20)
        chan.close()
        return out.stdout

    assert asyncio.run(scenario()) == b"HELLO WORLD"


# More stdin than any pipe holds: the server must keep relaying and listening meanwhile.
BIG_STDIN = os.urandom(4 << 20)
HANG_GUARD_S = 60  # a hang fails the test instead of the run; no timing is asserted


def test_stdin_larger_than_a_pipe_streams_through_a_command_that_echoes_it(
    server: Path,
) -> None:
    """cat writes back while stdin is still arriving: the server relays its output as it
    feeds it (blocking on either would deadlock both)."""

    async def scenario() -> bytes:
        chan = await Channel.start(server, ["cat"])

        async def feed() -> None:
            await chan.write(BIG_STDIN)
            await chan.close_stdin()

        feeding = asyncio.create_task(feed())
        out = await asyncio.wait_for(chan.collect(len(BIG_STDIN) * 2), HANG_GUARD_S)
        await feeding
        chan.close()
        return out.stdout

    assert asyncio.run(scenario()) == BIG_STDIN


def test_a_command_that_never_reads_its_stdin_is_still_killed_when_asked(
    server: Path,
) -> None:
    """A timeout or a cancel is a kill frame behind the stdin the command has not read:
    the server takes both, so the kill is heard and the command ends."""

    async def scenario() -> int | None:
        chan = await Channel.start(server, ["sleep", "600"])
        await asyncio.wait_for(chan.write(BIG_STDIN), HANG_GUARD_S)
        await asyncio.wait_for(chan.kill(), HANG_GUARD_S)
        await asyncio.wait_for(chan.collect(1 << 20), HANG_GUARD_S)
        chan.close()
        return chan.exit_code

    assert asyncio.run(scenario()) == -signal.SIGKILL


def test_stdin_past_what_the_server_holds_waits_for_the_command_and_is_all_delivered(
    server: Path,
) -> None:
    """80 MiB to a command that reads only after a while: the server holds 16 MiB, then
    takes no more frames until the command reads (the agent's writes wait), and every
    byte arrives."""
    data = b"y" * (80 << 20)

    async def scenario() -> bytes:
        chan = await Channel.start(server, ["sh", "-c", "sleep 1; wc -c"])

        async def feed() -> None:
            await chan.write(data)
            await chan.close_stdin()

        feeding = asyncio.create_task(feed())
        out = await asyncio.wait_for(chan.collect(1 << 10), HANG_GUARD_S)
        await feeding
        chan.close()
        return out.stdout

    assert asyncio.run(scenario()).strip() == str(len(data)).encode()


def test_a_kill_behind_stdin_the_server_will_not_take_hangs_up_and_ends_the_command(
    server: Path, tmp_path: Path
) -> None:
    """Past what the server holds its socket is not read, so the kill frame cannot get
    through: the agent hangs up, and the server kills the command for that."""
    pidfile = tmp_path / "cmd.pid"

    async def scenario() -> None:
        chan = await Channel.start(server, ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 600"])
        feeding = asyncio.create_task(chan.write(b"z" * (40 << 20)))
        while not pidfile.exists() or not pidfile.read_text().strip():
            await asyncio.sleep(0.01)
        await asyncio.sleep(1)  # the server holds its 16 MiB, the socket's buffers are full
        await asyncio.wait_for(chan.kill(), HANG_GUARD_S)
        await asyncio.wait_for(chan.collect(1 << 10), HANG_GUARD_S)
        feeding.cancel()
        chan.close()

    asyncio.run(scenario())
    pid = int(pidfile.read_text())
    until(lambda: not alive(pid), "the command to end", 10)


def test_a_command_that_exits_before_reading_all_its_stdin_reports_its_exit(
    server: Path, tmp_path: Path
) -> None:
    """The stdin left over meets a closed pipe (EPIPE, not a SIGPIPE that would end the
    server's handler): the exit code is told and what the command left running is
    killed, as for any action."""
    pidfile = tmp_path / "helper.pid"
    script = f"head -c 10 >/dev/null; sleep 600 & echo $! > {pidfile}; exit 3"

    async def scenario() -> int | None:
        chan = await Channel.start(server, ["sh", "-c", script])
        feeding = asyncio.create_task(chan.write(BIG_STDIN))
        await asyncio.wait_for(chan.collect(1 << 20), HANG_GUARD_S)
        feeding.cancel()
        chan.close()
        return chan.exit_code

    assert asyncio.run(scenario()) == 3
    helper = int(pidfile.read_text())
    until(lambda: not alive(helper), "the helper it left to be killed", 5)


def test_a_missing_program_exits_127_with_the_reason(server: Path) -> None:
    _, err, code = asyncio.run(collect(server, ["/no/such/tool"]))
    assert code == 127 and b"No such file or directory" in err


def test_output_written_before_exit_is_complete_and_background_output_does_not_block(
    server: Path,
) -> None:
    # The sleeper keeps the pipes open; the action still ends when its command does.
    out, _, code = asyncio.run(
        collect(server, ["sh", "-c", "head -c 300000 /dev/zero; sleep 30 & exit 0"])
    )
    assert len(out) == 300000 and code == 0


def test_kill_reaches_orphaned_descendants(server: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "orphan.pid"

    async def scenario() -> int | None:
        chan = await Channel.start(
            server, ["sh", "-c", f"sh -c 'setsid sleep 600 & echo $! > {pidfile}'; sleep 600"]
        )
        while not pidfile.exists() or not pidfile.read_text().strip():
            await asyncio.sleep(0.01)
        await chan.kill()
        await chan.collect(1 << 20)
        chan.close()
        return chan.exit_code

    assert asyncio.run(scenario()) == -signal.SIGKILL
    orphan = int(pidfile.read_text())
    until(lambda: not alive(orphan), "the orphan to be killed", 5)


def test_a_disconnected_agent_leaves_nothing_running(server: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "cmd.pid"

    async def scenario() -> None:
        chan = await Channel.start(server, ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 600"])
        while not pidfile.exists() or not pidfile.read_text().strip():
            await asyncio.sleep(0.01)
        chan.close()

    asyncio.run(scenario())
    pid = int(pidfile.read_text())
    until(lambda: not alive(pid), "the command to end", 5)


def test_a_start_cancelled_before_its_answer_hangs_up() -> None:
    """Cancelled after its request went out, a start must end the connection: the server
    may start the command all the same and kills it only on hang-up (above). A stand-in
    server holds the started frame back, the cancel's window."""
    run_dir = Path(tempfile.mkdtemp(prefix="execd-", dir="/tmp"))
    head = struct.Struct(">cI")

    async def scenario() -> None:
        asked, hung_up = asyncio.Event(), asyncio.Event()

        async def stand_in(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            _, n = head.unpack(await r.readexactly(head.size))
            await r.readexactly(n)
            asked.set()
            await r.read()  # until the agent hangs up
            hung_up.set()
            w.close()

        server = await asyncio.start_unix_server(stand_in, path=str(run_dir / "exec.sock"))
        start = asyncio.create_task(Channel.start(run_dir / "exec.sock", ["sleep", "600"]))
        try:
            await asyncio.wait_for(asked.wait(), HANG_GUARD_S)
            start.cancel()
            with pytest.raises(asyncio.CancelledError) as cancelled:
                await start
            # The error is kept (as a caller's handler may keep it), and with it the
            # channel: only closing it, not the collector, may end the connection.
            await asyncio.wait_for(hung_up.wait(), HANG_GUARD_S)
            del cancelled
        finally:
            server.close()

    try:
        asyncio.run(scenario())
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_bad_requests_are_refused_before_anything_runs(server: Path) -> None:
    with pytest.raises(ExecError, match="env"):
        asyncio.run(collect(server, ["true"], env={"A=B": "x"}))
    with pytest.raises(ExecError, match="NUL"):
        asyncio.run(collect(server, ["echo", "a\0b"]))


_ASK_FROM_INSIDE = """
import asyncio, sys
from tangram.node_agent.exec_server import Channel
async def main() -> None:
    try:
        chan = await Channel.start(sys.argv[1], ["sleep", "600"])
    except Exception as e:
        print("refused:", e)
    else:
        print("served", chan.pid)
asyncio.run(main())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a PID namespace of its own needs root")
def test_as_pid_1_it_serves_the_agent_and_not_a_process_of_its_sandbox(execd: Built) -> None:
    """A command that asked its own sandbox's server for a command started a process no
    action owned, which outlived its action."""
    with serving(execd, ["unshare", "--pid", "--fork", "--kill-child"]) as (sock, unshare):
        try:
            out, _, code = asyncio.run(collect(sock, ["sh", "-c", "echo $$"]))  # the agent's
            assert code == 0 and int(out) > 1  # (run in the server's namespace)
            env = {"PYTHONPATH": os.pathsep.join(sys.path), "PATH": os.environ["PATH"]}
            argv = [sys.executable, "-c", _ASK_FROM_INSIDE, str(sock)]
            out, err, code = asyncio.run(collect(sock, argv, env=env))
            assert code == 0, err
            assert out.decode().startswith("refused: exec server: a process of the sandbox"), out
        finally:  # (unshare ignores the SIGTERM that ends a server: its PID 1 does not)
            children = Path(f"/proc/{unshare}/task/{unshare}/children").read_text().split()
            for child in children:
                os.kill(int(child), signal.SIGTERM)


def test_a_link_planted_in_the_socket_directory_is_not_followed(
    server: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused, and the refusal (which the tenant whose command planted the link reads)
    names no path of the agent's: the agent's log does."""
    planted = tmp_path / "exec.sock"
    planted.symlink_to(server)
    with caplog.at_level(logging.WARNING, logger="tangram.agent"):
        with pytest.raises(ExecError, match="exec server socket: not a socket") as refused:
            asyncio.run(collect(planted, ["true"]))
        with pytest.raises(ExecError, match="exec server socket: No such file") as missing:
            asyncio.run(collect(tmp_path / "gone.sock", ["true"]))
    assert str(tmp_path) not in str(refused.value) + str(missing.value)
    assert f"{planted}: not a socket" in caplog.text and f"{tmp_path}/gone.sock" in caplog.text


def test_ansi_c_quoting_round_trips_through_bash() -> None:
    text = "a 'quoted' \"double\" $HOME `x` \\ back\nnew line\ttab \x01 é"
    out = subprocess.run(
        ["bash", "-c", f"printf %s {ansi_c_quote(text)}"], capture_output=True, check=True
    ).stdout
    assert out.decode() == text


def test_the_bash_session_keeps_its_cwd_and_variables(server: Path, tmp_path: Path) -> None:
    async def scenario() -> list[tuple[int | None, str]]:
        bash = await BashSession.start(server, str(tmp_path), {})
        results = []
        for code in [
            "mkdir -p sub && cd sub && export GREETING=hi && X=42",
            'pwd; echo "$GREETING $X"',
            "echo 'unbalanced",  # a syntax error for this command only
            "false",
            "[ -t 0 ] && echo tty",
            'echo "dop=$TANGRAM_DOP"',
        ]:
            r = await bash.run(code, timeout_s=30, output_cap=1 << 16, env={"TANGRAM_DOP": "3"})
            results.append((r.exit_code, r.stdout))
        await bash.kill()
        return results

    res = asyncio.run(scenario())
    assert res[0] == (0, "")
    assert res[1] == (0, f"{tmp_path}/sub\nhi 42\n")
    assert res[2][0] == 2 and "unexpected EOF" in res[2][1]
    assert res[3] == (1, "")
    assert res[4] == (0, "tty\n")
    assert res[5] == (0, "dop=3\n")


def test_a_bash_timeout_interrupts_the_job_and_the_session_survives(
    server: Path, tmp_path: Path
) -> None:
    async def scenario() -> tuple[bool, str, int | None, str]:
        bash = await BashSession.start(server, str(tmp_path), {})
        await bash.run("STATE=kept", timeout_s=30, output_cap=1024)
        slow = await bash.run("echo started; sleep 600", timeout_s=0.5, output_cap=1024)
        after = await bash.run("echo $STATE", timeout_s=30, output_cap=1024)
        await bash.kill()
        return slow.timed_out, slow.stdout, after.exit_code, after.stdout

    timed_out, slow_out, code, out = asyncio.run(scenario())
    assert timed_out and slow_out.startswith("started\n")  # bash adds a newline at ^C
    assert code == 0 and out == "kept\n"


def test_exit_ends_the_bash_session(server: Path, tmp_path: Path) -> None:
    async def scenario() -> tuple[int | None, bool]:
        bash = await BashSession.start(server, str(tmp_path), {})
        r = await bash.run("exit 7", timeout_s=30, output_cap=1024)
        return r.exit_code, bash.alive

    assert asyncio.run(scenario()) == (7, False)


def test_a_bash_session_whose_server_dies_under_a_command_fails_it(
    execd: Built, tmp_path: Path
) -> None:
    """Its connection ended with no exit status (the environment went): the command's
    reply was an exit code of None, read as an end of its own."""

    async def scenario(sock: Path, pid: int) -> None:
        bash = await BashSession.start(sock, str(tmp_path), {}, server_pid=pid)
        shell = int((await bash.run("echo $$", timeout_s=30, output_cap=64)).stdout)
        running = asyncio.ensure_future(bash.run("sleep 30", timeout_s=None, output_cap=1024))
        await asyncio.sleep(0.5)
        os.killpg(pid, signal.SIGKILL)  # the server and its handlers, as a sandbox's end
        try:
            with pytest.raises(ExecError, match="ended before the shell's exit status"):
                await asyncio.wait_for(running, 30)
            assert not bash.alive
        finally:  # (on a host, unlike in a sandbox, the shell outlives its server)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(shell), signal.SIGKILL)

    with serving(execd) as (sock, pid):
        asyncio.run(scenario(sock, pid))


def test_the_python_session_keeps_its_variables(server: Path, tmp_path: Path) -> None:
    async def scenario() -> list[tuple[int | None, str, str]]:
        py = await PythonSession.start(server, str(tmp_path), {})
        out = []
        for code in [
            "import os\nx = 20",
            "x += 1\nprint('x is', x)\nx * 2",
            "1 / 0",
            "import subprocess; subprocess.run(['echo', 'from a child'])",
            "os.environ['TANGRAM_DOP']",
        ]:
            r = await py.run(code, timeout_s=30, output_cap=1 << 16, env={"TANGRAM_DOP": "2"})
            out.append((r.exit_code, r.stdout, r.stderr))
        await py.kill()
        return out

    res = asyncio.run(scenario())
    assert res[0] == (0, "", "")
    assert res[1] == (0, "x is 21\n42\n", "")
    assert res[2][0] == 1 and "ZeroDivisionError" in res[2][2]
    assert res[3][0] == 0 and "from a child" in res[3][2]  # child output is kept apart
    assert res[4] == (0, "'2'\n", "")


def test_a_python_timeout_raises_keyboard_interrupt_and_keeps_state(
    server: Path, tmp_path: Path
) -> None:
    async def scenario() -> tuple[bool, str, str]:
        py = await PythonSession.start(server, str(tmp_path), {})
        await py.run("kept = 'yes'", timeout_s=30, output_cap=1024)
        slow = await py.run(
            "import time\nwhile True: time.sleep(0.01)", timeout_s=0.5, output_cap=1 << 16
        )
        after = await py.run("kept", timeout_s=30, output_cap=1024)
        await py.kill()
        return slow.timed_out, slow.stderr, after.stdout

    timed_out, err, out = asyncio.run(scenario())
    assert timed_out and "KeyboardInterrupt" in err and out == "'yes'\n"


def test_output_caps_hold_in_sessions(server: Path, tmp_path: Path) -> None:
    async def scenario() -> tuple[int, bool, int, bool]:
        bash = await BashSession.start(server, str(tmp_path), {})
        py = await PythonSession.start(server, str(tmp_path), {})
        b = await bash.run("head -c 5000 /dev/zero | tr '\\0' x", timeout_s=30, output_cap=100)
        p = await py.run("print('y' * 5000)", timeout_s=30, output_cap=100)
        await bash.kill()
        await py.kill()
        return len(b.stdout), b.stdout_truncated, len(p.stdout), p.stdout_truncated

    assert asyncio.run(scenario()) == (100, True, 100, True)


def test_a_bash_session_keeps_what_its_cap_shows_not_the_whole_output(
    server: Path, tmp_path: Path
) -> None:
    """16 MiB printed under a cap of 1 KiB: what the session holds stays about the cap
    (plus a frame), the reply is cut and flagged, and the exit status after it is read."""

    async def scenario() -> tuple[int, bool, int | None, int]:
        bash = await BashSession.start(server, str(tmp_path), {})
        held = 0
        frame = bash.chan.frame

        async def watched() -> tuple[bytes, bytes]:
            nonlocal held
            held = max(held, len(bash._buffer))
            return await frame()

        bash.chan.frame = watched  # type: ignore[method-assign]
        r = await bash.run("head -c 16777216 /dev/zero | tr '\\0' x; (exit 7)",
                           timeout_s=300, output_cap=1024)  # fmt: skip
        await bash.kill()
        return len(r.stdout), r.stdout_truncated, r.exit_code, held

    shown, truncated, code, held = asyncio.run(scenario())
    assert (shown, truncated, code) == (1024, True, 7)
    assert held <= 1024 + 4096 + 256 + (1 << 20)  # the cap, its slack, the tail, a frame


def test_the_server_reaps_everything(server: Path) -> None:
    for _ in range(20):
        asyncio.run(collect(server, ["sh", "-c", "sleep 0.01 & true"]))
    time.sleep(0.2)
    zombies = [
        p for p in os.listdir("/proc") if p.isdigit() and _is_zombie_child_of_server(p, server)
    ]
    assert zombies == []


def _is_zombie_child_of_server(pid: str, server: Path) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().split(") ")[1].split()
    except (FileNotFoundError, IndexError):
        return False
    if state[0] != "Z":
        return False
    with open(f"/proc/{state[1]}/cmdline", "rb") as f:
        return str(server).encode() in f.read()


def test_sessions_take_commands_longer_than_a_terminal_line_and_a_frame(
    server: Path, tmp_path: Path
) -> None:
    async def scenario() -> tuple[str, str]:
        bash = await BashSession.start(server, str(tmp_path), {})
        py = await PythonSession.start(server, str(tmp_path), {})
        text = "é'x\\" * 3000  # 12,000 characters, far more bytes once quoted
        b = await bash.run(f"cat <<'EOF' | wc -c\n{text}\nEOF", timeout_s=30, output_cap=1024)
        blob = "a" * (3 << 20)  # 3 MiB of code: several stdin frames
        p = await py.run(f"s = '{blob}'\nlen(s)", timeout_s=60, output_cap=1024)
        await bash.kill()
        await py.kill()
        return b.stdout.strip(), p.stdout.strip()

    bash_out, py_out = asyncio.run(scenario())
    assert bash_out == str(len(("é'x\\" * 3000 + "\n").encode()))
    assert py_out == str(3 << 20)


def test_a_prebuilt_server_is_copied_onto_the_cache_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Docker mounts the server from the host: in a pod the image's own copy is not there,
    so the agent copies it into its cache (a host path) and hands out that copy."""
    from tangram.node_agent.exec_server import build

    prebuilt = tmp_path / "image" / "tangram-execd"
    prebuilt.parent.mkdir()
    prebuilt.write_bytes(b"#!/bin/sh\nexit 0\n")
    prebuilt.chmod(0o755)
    monkeypatch.setenv("TANGRAM_EXECD", str(prebuilt))
    cache = tmp_path / "state" / "cache"
    first = build(cache)
    assert first.path is not None and first.path.parent == cache
    assert first.path.read_bytes() == prebuilt.read_bytes() and os.access(first.path, os.X_OK)
    assert build(cache).path == first.path  # the same content: the same copy
    prebuilt.write_bytes(b"#!/bin/sh\nexit 1\n")
    assert build(cache).path != first.path  # an upgraded image: a new copy
    prebuilt.chmod(0o644)
    assert build(cache).path is None


def test_install_copies_the_server_whole_or_not_at_all(execd: Built, tmp_path: Path) -> None:
    """How a sandbox pod's init container delivers it: a read-only executable copy; a
    destination it cannot write fails, naming it, and leaves no partial file."""
    assert execd.path is not None
    dest = tmp_path / "bin" / "execd"
    dest.parent.mkdir()
    done = subprocess.run([str(execd.path), "--install", str(dest)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert dest.read_bytes() == execd.path.read_bytes()
    assert dest.stat().st_mode & 0o777 == 0o555
    assert list(dest.parent.iterdir()) == [dest]  # no .tmp left behind
    missing = tmp_path / "absent" / "execd"
    failed = subprocess.run([str(execd.path), "--install", str(missing)], capture_output=True,
                            text=True, check=False)  # fmt: skip
    assert failed.returncode == 1
    assert f"install {missing}: No such file or directory" in failed.stderr


def test_a_first_frame_over_the_limit_is_refused_not_a_crash(server: Path) -> None:
    """A request frame the server cannot read (over 1 MiB) gets a refusal; the handler
    used to go on with the frame it had not read."""
    import socket as sockets
    import struct

    conn = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    conn.connect(str(server))
    conn.sendall(struct.pack(">cI", b"R", 2 << 20))
    conn.settimeout(30)
    head = conn.recv(5)
    conn.close()
    assert head[:1] == b"Z"


def test_eof_reaches_a_command_under_a_terminal(server: Path) -> None:
    async def scenario() -> tuple[bytes, int | None]:
        chan = await Channel.start(server, ["cat"], mode="pty")
        await chan.write(b"typed\n")
        await chan.close_stdin()  # ^D at the start of a line, as a person types it
        out = await asyncio.wait_for(chan.collect(1 << 20), 30)  # (a hang guard)
        chan.close()
        return out.stdout, chan.exit_code

    stdout, code = asyncio.run(scenario())
    assert code == 0 and stdout == b"typed\n"


def test_a_change_in_tangram_is_refused_by_the_server_itself(server: Path, execd: Built) -> None:
    """A container's /.tangram (the server's binary and socket directory) is changed by no
    file operation, refused before any lookup whatever the service let through (the
    server serves the host's root here: nothing is at /.tangram, and nothing is made);
    reads are not refused. The process runtime's directory reserves nothing."""
    assert execd.path is not None

    read = ("stat", "/.tangram/x")
    asked = {  # a request: what its refusal names
        ("remove", "/.tangram/run"): b"remove /.tangram/run",
        ("remove", "/.tangram"): b"remove /.tangram",
        ("write", "/./.tangram/x", "644"): b"write /./.tangram/x",
        ("untar", "/.tangram/x"): b"untar /.tangram/x",
        ("rename", "/.tangram/x", "/tmp/never"): b"rename /.tangram/x",
        ("rename", "/tmp/never", "/.tangram/x"): b"rename to /.tangram/x",
    }

    async def scenario() -> list[bytes]:
        return [await file_answer(await Channel.connect(server), *a) for a in [*asked, read]]

    reserved = (b"/.tangram is reserved for the exec server (its binary and socket): the "
                b"files API changes nothing in it")  # fmt: skip
    *changes, stat = asyncio.run(scenario())
    for answer, said in zip(changes, asked.values(), strict=True):
        assert answer == b"Z %d %s: %s" % (errno.EPERM, said, reserved)
    assert stat.startswith(b"Z %d stat /.tangram/x: No such file" % errno.ENOENT), stat
    with tempfile.TemporaryDirectory() as root:  # the process runtime's: a name as any
        os.mkdir(f"{root}/.tangram")
        connect = env_files.one_shot(execd.path, Path(root))
        asyncio.run(env_files.EnvFiles(connect, "/").remove("/.tangram"))
        assert os.listdir(root) == []

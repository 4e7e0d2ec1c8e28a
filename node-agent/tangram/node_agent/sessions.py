"""Persistent tool sessions inside a trajectory's environment: bash and Python.

A session is a long-lived process the exec server started in the container; its state
(bash's working directory and variables, Python's globals) persists across actions.
It lives in the container's cgroup, so it holds only the idle set between actions and
gets the action's cores while one runs (the runtime writes the cgroup around each).

- bash runs on a pty (job control and interactive programs behave as on a terminal).
  Each command goes through ``eval`` of an ANSI-C-quoted string, so a command with an
  unbalanced quote is a syntax error for that command only, followed by a marker line
  carrying ``$?``. A timeout sends Ctrl-C through the pty to the foreground job.
- Python runs a small driver over pipes: one JSON request per line, one JSON reply per
  line; stdout and stderr of the code are captured separately and the value of a final
  expression is printed, as in a REPL. A timeout sends SIGINT (KeyboardInterrupt).
A session that does not answer after its interrupt is killed and reported lost; the next
action starts a fresh one.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import signal
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from tangram.node_agent.exec_server import Channel
from tangram.node_agent.execution import ExecError

INTERRUPT_GRACE_S = 2.0  # how long an interrupted session may take to answer
LINE_BYTES = 2000  # per line sent to bash's terminal; its line buffer holds 4095
_MARKER = re.compile(rb"\x1etangram-[0-9a-f]{16}:\d+\x1e\n")
_MARKER_TAIL = 256  # longer than any marker line: where one that is still coming can start
_SUPERSEDED_SLACK = 4096  # room for the markers of interrupted commands, cut from a reply

_PY_DRIVER = r"""
import ast, contextlib, io, json, os, sys, tempfile, traceback
proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
# What child processes write lands in a spill file, read back into the reply in order,
# so it can neither mix with the replies nor trail behind them.
spill = tempfile.TemporaryFile()
os.dup2(spill.fileno(), 1)
os.dup2(spill.fileno(), 2)
ns = {"__name__": "__main__", "__builtins__": __builtins__}

def run(code):
    tree = ast.parse(code, "<session>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<session>", "exec"), ns)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<session>", "eval"), ns)
        if value is not None:
            print(repr(value))

def spilled():
    os.lseek(1, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(1, 1 << 16):
        chunks.append(chunk)
    os.ftruncate(1, 0)
    os.lseek(1, 0, os.SEEK_SET)
    return b"".join(chunks).decode(errors="replace")

while True:
    try:
        line = sys.stdin.readline()
        if not line:
            break
        req = json.loads(line)
        os.environ.update(req["env"])
        out, err, ok = io.StringIO(), io.StringIO(), True
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                run(req["code"])
        except BaseException:
            ok = False
            err.write(traceback.format_exc())
        cap = req["cap"]
        o, e = out.getvalue(), spilled() + err.getvalue()
        reply = {"ok": ok, "stdout": o[:cap], "stderr": e[:cap],
                 "stdout_truncated": len(o) > cap, "stderr_truncated": len(e) > cap}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()
    except KeyboardInterrupt:
        continue
"""


@dataclass(frozen=True, slots=True)
class Reply:
    exit_code: int | None  # None: the session did not answer and was killed
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    lost: bool = False  # killed: its state is gone, the next action starts a fresh one


def _how(kind: bytes, data: bytes) -> str:
    """How a session's process ended, from its exit frame (none: its connection ended)."""
    if kind != b"X":
        return "its exec server's connection ended"
    code = int(data)
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _escaped(ch: str) -> str:
    if ch in "\\'":
        return "\\" + ch
    if ch == "\n":
        return "\\n"
    if ch.isprintable() and ord(ch) < 0x80:
        return ch
    return "".join(f"\\x{b:02x}" for b in ch.encode())


def ansi_c_quote(text: str) -> str:
    """Quote ``text`` as bash's ``$'...'`` so that any bytes survive one line."""
    return "$'" + "".join(_escaped(ch) for ch in text) + "'"


def quoted_pieces(text: str, limit: int = LINE_BYTES) -> list[str]:
    """``text`` as ``$'...'`` pieces of at most ``limit`` bytes each: a terminal takes
    lines of at most 4095 bytes, and a longer one never reaches the shell."""
    pieces: list[str] = []
    current: list[str] = []
    size = 0
    for ch in text:
        esc = _escaped(ch)
        if current and size + len(esc) > limit:
            pieces.append("$'" + "".join(current) + "'")
            current, size = [], 0
        current.append(esc)
        size += len(esc)
    pieces.append("$'" + "".join(current) + "'")
    return pieces


class Session:
    kind: str

    def __init__(self, chan: Channel) -> None:
        self.chan = chan
        self.alive = True
        self._lock = asyncio.Lock()  # one action at a time per session

    async def _interrupt(self) -> None:
        raise NotImplementedError

    async def _reply(self, cap: int) -> Reply:
        raise NotImplementedError

    async def _send(self, code: str, cap: int, env: Mapping[str, str]) -> None:
        raise NotImplementedError

    async def run(
        self,
        code: str,
        *,
        timeout_s: float | None,
        output_cap: int,
        env: Mapping[str, str] | None = None,
    ) -> Reply:
        """Run ``code``; ``env`` is exported into the session first (e.g. TANGRAM_DOP)."""
        if not self.alive:
            raise ExecError(f"{self.kind} session: it has ended")
        async with self._lock:
            # Once the request is on its way, an exchange left unfinished (an error, a
            # cancel, also one during the interrupt's grace) ends the session: half a
            # request may have reached it, or its reply would answer the next action.
            pending: asyncio.Future[Reply] | None = None
            try:
                await self._send(code, output_cap, env or {})
                pending = asyncio.ensure_future(self._reply(output_cap))
                try:
                    return await asyncio.wait_for(asyncio.shield(pending), timeout_s)
                except TimeoutError:
                    pass
                await self._interrupt()
                try:
                    reply = await asyncio.wait_for(pending, INTERRUPT_GRACE_S)
                except TimeoutError:
                    await self.kill()
                    return Reply(None, "", "", False, False, True, lost=True)
                return replace(reply, exit_code=None, timed_out=True)
            except BaseException:
                if pending is not None:
                    pending.cancel()
                await self.kill()
                raise

    async def kill(self) -> None:
        self.alive = False
        try:
            await self.chan.kill()
        finally:
            self.chan.close()  # (also when cancelled meanwhile: hanging up kills it too)


class BashSession(Session):
    kind = "bash"

    @classmethod
    async def start(
        cls, sock: Path, cwd: str, env: Mapping[str, str], server_pid: int | None = None
    ) -> BashSession:
        argv = ["bash", "--norc", "--noprofile", "--noediting", "-i"]
        quiet = {"PS1": "", "PS2": "", "PROMPT_COMMAND": "", "TERM": "dumb", **env}
        chan = await Channel.start(
            sock, argv, cwd=cwd, env=quiet, mode="pty", server_pid=server_pid
        )
        session = cls(chan)
        try:
            first = await session.run("true", timeout_s=30, output_cap=1 << 16)  # noise
        except ExecError:
            first = Reply(session.chan.exit_code, "", "", False, False, False)
        except BaseException:
            chan.close()  # nobody will use it: hanging up ends the shell
            raise
        if not session.alive or first.exit_code != 0:
            chan.close()
            raise ExecError(
                f"bash session: bash did not start (exit {first.exit_code}): {first.stdout[-300:]}"
            )
        return session

    def __init__(self, chan: Channel) -> None:
        super().__init__(chan)
        self._marker = ""
        self._buffer = bytearray()

    async def _send(self, code: str, cap: int, env: Mapping[str, str]) -> None:
        # The code arrives as pieces appended to a variable, one short line each, then one
        # line evaluates it: a command of any length fits the terminal's line buffer.
        lines = ["__tangram_code=''"]
        lines += [f"__tangram_code+={piece}" for piece in quoted_pieces(code)]
        exports = "".join(f"export {k}={ansi_c_quote(v)}; " for k, v in env.items())
        lines.append(f'{exports}eval "$__tangram_code"; {self._new_marker()}')
        await self.chan.write("\n".join(lines).encode())

    def _new_marker(self) -> str:
        """A fresh marker, and the command line that prints it with ``$?``."""
        self._marker = "\x1etangram-" + secrets.token_hex(8)
        return f"printf '{self._marker}:%d\\036\\n' \"$?\"\n"

    async def _interrupt(self) -> None:
        # Ctrl-C: SIGINT to the terminal's foreground job. An interactive shell then drops
        # the rest of the line, marker included: ask for a new one on a line of its own.
        await self.chan.write(b"\x03" + self._new_marker().encode())

    async def _reply(self, cap: int) -> Reply:
        # What the reply can show (superseded markers are cut from it) is kept, and a tail
        # that may hold the start of the marker; the middle of a long output is dropped as
        # it comes, and only the new bytes are searched: a command that prints gigabytes
        # costs the agent neither their memory nor a scan of all of them per frame.
        head, cut, scan, marker = cap + _SUPERSEDED_SLACK, False, 0, ""
        while True:
            if marker != self._marker:  # a new one, asked for by an interrupt meanwhile
                marker, scan = self._marker, 0
                pattern = re.compile(re.escape(marker.encode()) + rb":(\d+)\x1e\n")
            found = pattern.search(self._buffer, scan)
            if found:  # (read before the buffer shrinks: a match reads it lazily)
                code, start, end = int(found.group(1)), found.start(), found.end()
                out = _MARKER.sub(b"", bytes(self._buffer[:start]))  # superseded ones
                del self._buffer[:end]
                text = out[:cap].decode(errors="replace")
                return Reply(code, text, "", cut or len(out) > cap, False, False)
            if len(self._buffer) > head + _MARKER_TAIL:
                del self._buffer[head : len(self._buffer) - _MARKER_TAIL]
                cut = True
            scan = max(0, len(self._buffer) - _MARKER_TAIL)
            kind, data = await self.chan.frame()
            if kind == b"1":
                self._buffer += data
            elif kind in (b"X", b""):  # the shell exited (``exit`` in the command)
                self.alive = False
                if self.chan.exit_code is None:  # (no exit status: not an end of its own)
                    raise ExecError(
                        "bash session: its connection ended before the shell's exit status "
                        "(its environment may be gone)"
                    )
                out = bytes(self._buffer)
                truncated = cut or len(out) > cap
                text = out[:cap].decode(errors="replace")
                return Reply(self.chan.exit_code, text, "", truncated, False, False)


class PythonSession(Session):
    kind = "python"

    @classmethod
    async def start(
        cls, sock: Path, cwd: str, env: Mapping[str, str], server_pid: int | None = None
    ) -> PythonSession:
        argv = ["python3", "-u", "-c", _PY_DRIVER]
        chan = await Channel.start(
            sock, argv, cwd=cwd, env=dict(env), mode="pipe", server_pid=server_pid
        )
        return cls(chan)

    def __init__(self, chan: Channel) -> None:
        super().__init__(chan)
        self._lines = bytearray()
        self._stray = bytearray()  # what child processes wrote to the real stdout/stderr

    async def _send(self, code: str, cap: int, env: Mapping[str, str]) -> None:
        request = {"code": code, "cap": cap, "env": dict(env)}
        await self.chan.write((json.dumps(request) + "\n").encode())

    async def _interrupt(self) -> None:
        await self.chan.kill(signal.SIGINT)

    async def _reply(self, cap: int) -> Reply:
        while b"\n" not in self._lines:
            kind, data = await self.chan.frame()
            if kind == b"1":
                self._lines += data
            elif kind == b"2":
                self._stray += data
            elif kind in (b"X", b""):
                self.alive = False
                said = bytes(self._stray[-500:]).decode(errors="replace").strip()
                raise ExecError(
                    f"python session: the interpreter ended ({_how(kind, data)})"
                    f"{': ' + said if said else ''}; the next step starts a fresh session"
                )
        line, _, rest = bytes(self._lines).partition(b"\n")
        self._lines = bytearray(rest)
        body = json.loads(line)
        stray = bytes(self._stray).decode(errors="replace")
        self._stray.clear()
        stderr = stray + body["stderr"]
        return Reply(
            0 if body["ok"] else 1,
            body["stdout"],
            stderr[:cap],
            body["stdout_truncated"],
            body["stderr_truncated"] or len(stderr) > cap,
            False,
        )

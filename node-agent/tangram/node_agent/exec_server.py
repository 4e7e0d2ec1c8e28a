"""The agent's side of the in-container exec server (``exec_server.c``): build and talk.

The fast allocate-on-execution path starts each command through a tiny static server
that is the container's PID 1, reached over a Unix socket in a directory the agent
shares with the container. ``build`` compiles it once per source version into a cache
(or takes a prebuilt binary from ``TANGRAM_EXECD``); ``Channel`` speaks its frame
protocol: a request, then stdout/stderr/exit frames from the server and stdin/kill
frames from the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tangram.api.resources import RESERVED_DIR
from tangram.node_agent.execution import ExecError, Output, cap

log = logging.getLogger("tangram.agent")
SOURCE = Path(__file__).with_name("exec_server.c")
# exec_server.c includes the others
SOURCES = tuple(SOURCE.with_name(n) for n in ("exec_server.c", "exec_files.c", "exec_tar.c"))
IN_CONTAINER_BIN = "/.tangram/execd"
IN_CONTAINER_RUN = f"{RESERVED_DIR}/run"
SOCKET_NAME = "exec.sock"


def socket_in(proc_root: Path, pid: int) -> Path:
    """The exec server's socket in the environment whose PID 1 is ``pid`` (as ``proc_root``
    sees it), reached through that process's root: the runtimes share no directory with
    the environment."""
    return proc_root / str(pid) / "root" / IN_CONTAINER_RUN.lstrip("/") / SOCKET_NAME


_HEAD = struct.Struct(">cI")
FRAME_BYTES = 512 << 10  # stdin frames; exec_server.c refuses frames over 1 MiB
MAX_FRAME = 1 << 20  # exec_server.c's MAX_FRAME: a larger one is hung up on, unanswered
MAX_ARGS = 4096  # exec_server.c's MAX_ARGS: arguments, and variables, of a command
KILL_SEND_S = 5.0  # a kill frame the server does not take by then: hang up instead
UNANSWERED = "exec server: it closed the connection without an answer"
# The exec server forks a handler per connection, and closes the connection unanswered
# when that fork fails (exec_server.c's accept loop writes nothing then).
NO_HANDLER = (
    f"{UNANSWERED}; a likely cause is that the sandbox's process limit (pids) was "
    "reached, so it could not fork a handler for the request"
)


@dataclass(frozen=True, slots=True)
class Built:
    path: Path | None
    reason: str  # why there is no binary (empty when there is one)


def build(cache_dir: Path) -> Built:
    """The exec server binary in ``cache_dir``: a copy of ``TANGRAM_EXECD`` if set (the
    agent image's prebuilt one), else compiled there.

    Docker bind-mounts it into every environment from the *host*, so it must live on a
    host path: in a pod the cache sits in the agent's state directory (a hostPath mounted
    at the same path), while the image's own files exist only inside the agent container.
    Compiled statically so that it runs in any image of the host's architecture; keyed by
    the content's hash so an upgraded agent never runs a stale server.
    """
    prebuilt = os.environ.get("TANGRAM_EXECD")
    if prebuilt:
        path = Path(prebuilt)
        if not os.access(path, os.X_OK) or not path.is_file():
            return Built(None, f"TANGRAM_EXECD={prebuilt} is not an executable file")
        data = path.read_bytes()
        target = cache_dir / f"tangram-execd-{hashlib.sha256(data).hexdigest()[:16]}"

        def copy_to(tmp: str) -> str | None:
            Path(tmp).write_bytes(data)
            return None

        if not target.exists():
            _install(cache_dir, target, copy_to)
        return Built(target, "")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:16]
    target = cache_dir / f"tangram-execd-{digest}"
    if target.exists():
        return Built(target, "")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return Built(None, "no C compiler to build the exec server (set TANGRAM_EXECD)")

    def compile_to(tmp: str) -> str | None:
        done = subprocess.run(
            [cc, "-static", "-O2", "-o", tmp, str(SOURCE)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            return f"building the exec server failed: {done.stderr.strip()[-300:]}"
        return None

    error = _install(cache_dir, target, compile_to)
    return Built(None, error) if error else Built(target, "")


def _install(cache_dir: Path, target: Path, make: Callable[[str], str | None]) -> str | None:
    """Make ``target`` through a temporary file and an atomic rename (concurrent agents
    never see half a binary); ``make`` writes the file or returns an error."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".execd-")
    os.close(fd)
    try:
        error = make(tmp)
        if error:
            return error
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return None


def _connect(path: Path, server_pid: int | None = None) -> socket.socket:
    """Connect without following a link the container may have put in the shared directory.

    The socket's directory is writable from inside the container; opening the final name
    with O_NOFOLLOW and connecting through /proc/self/fd pins the inode we checked. With
    ``server_pid`` (the exec server, as this agent's /proc sees it), the socket must have
    been listened on by that process (SO_PEERCRED): a command that planted its own server
    under the socket's name answers from another pid and is refused.

    A refusal goes back to the tenant whose command broke the socket: it says what is
    wrong, never ``path``, which is the agent's (its state directory, a host pid's /proc);
    the agent's log has that.
    """

    def refused(why: str) -> ExecError:
        log.warning("exec server socket %s: %s", path, why)
        return ExecError(f"exec server socket: {why}")

    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise refused(e.strerror or str(e)) from None
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise refused("not a socket")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(f"/proc/self/fd/{fd}")
        except OSError as e:
            sock.close()
            raise refused(e.strerror or str(e)) from None
        if server_pid is not None:
            pid = peer_pid(sock)
            if pid != server_pid:
                sock.close()
                raise refused(
                    f"answered by pid {pid}, not by the environment's exec server "
                    f"(pid {server_pid}); refused"
                )
        sock.setblocking(False)
        return sock
    finally:
        os.close(fd)


def peer_pid(sock: socket.socket) -> int:
    """The pid that listened on the server end of a connected Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _, _ = struct.unpack("3i", creds)
    return int(pid)


def _request(mode: str, argv: Sequence[str], cwd: str, env: Mapping[str, str]) -> bytes:
    for k, v in env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise ExecError(f"env: {k!r} is not a valid variable")
    if any("\0" in a for a in argv) or "\0" in cwd:
        raise ExecError("argv: arguments cannot contain NUL bytes")
    for name, count in (("argv", len(argv)), ("env", len(env))):
        if count > MAX_ARGS:  # (else refused as "bad argv count", whichever it was)
            raise ExecError(f"{name}: {count} entries, over the exec server's {MAX_ARGS}")
    fields = [
        mode,
        cwd,
        str(len(argv)),
        *argv,
        str(len(env)),
        *(f"{k}={v}" for k, v in env.items()),
    ]
    payload = b"".join(f.encode() + b"\0" for f in fields)
    if len(payload) > MAX_FRAME:  # (else hung up on unanswered: read as a pids limit)
        raise ExecError(
            f"argv and env: {len(payload)} bytes in all, over the exec server's "
            f"{MAX_FRAME} (pass large inputs as stdin or a file)"
        )
    return payload


class Channel:
    """One command running under the exec server."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, unanswered: str = ""
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.exit_code: int | None = None  # set by the exit frame; negative: a signal
        # Why the connection may end before any frame (see ``frame``).
        self._unanswered = unanswered or UNANSWERED
        self._answered = False

    @classmethod
    async def start(
        cls,
        sock_path: Path,
        argv: Sequence[str],
        *,
        cwd: str = "",
        env: Mapping[str, str] | None = None,
        mode: Literal["pipe", "pty"] = "pipe",
        server_pid: int | None = None,
        stdin: bool = True,
    ) -> Channel:
        """Start ``argv``; ``stdin`` False: its standard input ends at once, as /dev/null's
        (no command waits for its timeout on input nobody will send)."""
        payload = _request(mode, argv, cwd, env or {})
        chan = await cls.connect(sock_path, server_pid)
        try:
            # The end of input goes with the request: no second write, and a server
            # that fails the request never reads it.
            await chan._send_all((b"R", payload), *([] if stdin else [(b"E", b"")]))
            kind, data = await chan.frame()
        except BaseException:
            # A cancel after the request: the server may start the command anyway, and
            # kills it only when its connection ends.
            chan.close()
            raise
        if kind != b"S":
            chan.close()
            raise ExecError(f"exec server: {data.decode(errors='replace')}")
        return chan

    @classmethod
    async def connect(cls, sock_path: Path, server_pid: int | None = None) -> Channel:
        """A connection to the exec server, checked to be its own (see ``_connect``)."""
        return await cls.over(_connect(sock_path, server_pid), NO_HANDLER)

    @classmethod
    async def over(cls, sock: socket.socket, unanswered: str = "") -> Channel:
        """A channel on a connected socket (a one-shot ``tangram-execd --files``)."""
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer, unanswered)

    async def ask_files(self, op: str, path: str, arg: str = "") -> None:
        """Send a file operation's request (``exec_files.c``)."""
        if "\0" in path or "\0" in arg:
            raise ExecError("path: cannot contain NUL bytes")
        await self._send(b"F", b"".join(f.encode() + b"\0" for f in (op, path, arg)))

    async def _send(self, kind: bytes, data: bytes) -> None:
        await self._send_all((kind, data))

    async def _send_all(self, *frames: tuple[bytes, bytes]) -> None:
        try:
            if self._writer.is_closing():  # (uvloop raises RuntimeError at the write)
                raise ConnectionResetError
            self._writer.write(b"".join(_HEAD.pack(k, len(d)) + d for k, d in frames))
            await self._writer.drain()
        except ConnectionError:
            if not self._answered:  # (a request the server hung up on unread)
                raise ExecError(self._unanswered) from None
            raise ExecError("exec server: the command has ended") from None

    async def frame(self) -> tuple[bytes, bytes]:
        """The next frame from the server; ``(b"", b"")`` once the connection ends, and
        ``ExecError`` saying why if it ends before the first (nothing answered at all)."""
        try:
            head = await self._reader.readexactly(_HEAD.size)
            kind, n = _HEAD.unpack(head)
            data = await self._reader.readexactly(n)
        except (asyncio.IncompleteReadError, ConnectionError):
            if not self._answered:
                raise ExecError(self._unanswered) from None
            return b"", b""
        self._answered = True
        if kind == b"X":
            self.exit_code = int(data)
        return kind, data

    async def write(self, data: bytes) -> None:
        for start in range(0, max(len(data), 1), FRAME_BYTES):  # the server takes ≤ 1 MiB
            await self._send(b"I", data[start : start + FRAME_BYTES])

    async def close_stdin(self) -> None:
        await self._send(b"E", b"")

    async def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the command's process group and every descendant it left behind. A
        server that takes no frame now (it holds 16 MiB of stdin its command does not
        read) is hung up on instead, which kills the command as surely."""
        with contextlib.suppress(ExecError):
            try:
                await asyncio.wait_for(self._send(b"K", str(int(sig)).encode()), KILL_SEND_S)
            except TimeoutError:
                self._writer.transport.abort()
                if self.exit_code is None:  # no exit frame will come: its end is this kill
                    self.exit_code = -signal.SIGKILL

    async def collect(
        self, limit: int, on_output: Callable[[int, bytes], Awaitable[None]] | None = None
    ) -> Output:
        """Read stdout and stderr (each capped at ``limit`` bytes) until the command ends;
        ``on_output`` also gets each piece as it comes (streaming exec)."""
        out, err = bytearray(), bytearray()
        out_cut = err_cut = False
        while True:
            kind, data = await self.frame()
            if kind in (b"1", b"2") and on_output is not None:
                await on_output(1 if kind == b"1" else 2, data)
            if kind == b"1":
                out_cut |= cap(out, data, limit)
            elif kind == b"2":
                err_cut |= cap(err, data, limit)
            elif kind == b"Z":
                raise ExecError(f"exec server: {data.decode(errors='replace')}")
            elif kind in (b"X", b""):
                return Output(bytes(out), out_cut, bytes(err), err_cut)

    def close(self) -> None:
        """Disconnect; a command still running is killed by the server."""
        self._writer.close()

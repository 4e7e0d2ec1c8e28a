"""A streamed exec's live side in the service: its output to its caller as the agent sends
it, and its caller's input and signals to the agent once it runs.

The caller may send input or a signal while the action still waits in the queue: they
are kept, in order, and go to the agent when the action is dispatched (input within
``MAX_QUEUED_INPUT`` bytes). Once it runs, a signal goes at once, ahead of input its
command has not taken yet. Cores are taken only when it runs, as for any exec; what
waits holds none. Its output is taken from the agent only as fast as the caller reads
it (``room``), so a caller that stops reading stalls its own command, nothing else.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tangram.api.wire import AgentReply
from tangram.service.agents import AgentGoneError, LinkStream
from tangram.service.records import EngineError

Output = Callable[[str, str], None]  # ("stdout" or "stderr", text)
MAX_QUEUED_INPUT = 16 << 20  # input bytes held for a command that has not taken them


async def _always() -> None:
    return None


@dataclass(slots=True)
class LiveExec:
    output: Output | None  # None: input and signals only (not streamed out)
    interactive: bool = False  # its stdin stays open for input until eof
    room: Callable[[], Awaitable[None]] = _always  # until its caller can take more output
    # In order: input (bytes), its end (None), signals sent before it ran (int).
    _queue: asyncio.Queue[bytes | int | None] = field(default_factory=asyncio.Queue)
    _queued_bytes: int = 0
    _stream: LinkStream | None = None
    _pump: asyncio.Task[None] | None = None
    _decoders: dict[int, codecs.IncrementalDecoder] = field(default_factory=dict)
    # Why part of its input was refused: its command is then killed and its result is an
    # error, since a command that read the rest of its input without that part would end
    # as if it had all of it.
    input_lost: str | None = None

    def write(self, data: bytes) -> None:
        if self.input_lost is not None:  # its command is being killed for it
            raise EngineError("too_large", "stdin", self.input_lost)
        if self._queued_bytes + len(data) > MAX_QUEUED_INPUT:
            why = f"over {MAX_QUEUED_INPUT} bytes of input waited for the command to read it"
            if self.input_lost is None:
                self.input_lost = why
                self._kill_first()
            raise EngineError("too_large", "stdin", why)
        self._queued_bytes += len(data)
        self._queue.put_nowait(data)

    def _kill_first(self) -> None:
        """Kill its command ahead of the input waiting for it, which it will never read
        (behind that input, a kill waited for a command that does not read)."""
        while not self._queue.empty():
            dropped = self._queue.get_nowait()
            if isinstance(dropped, bytes):
                self._queued_bytes -= len(dropped)
        self.signal(signal.SIGKILL)  # (queued: the first thing it gets when it starts)

    def close_stdin(self) -> None:
        self._queue.put_nowait(None)

    def signal(self, number: int) -> None:
        """For the command's process group: now if it runs, else as it starts."""
        if self._stream is None:
            self._queue.put_nowait(number)
            return
        with contextlib.suppress(AgentGoneError):  # the link went: the action ends with it
            self._stream.signal(number)

    def attach(self, stream: LinkStream) -> None:
        """The action runs: what waited goes to the agent, in order, then what comes."""
        self._stream = stream
        self._pump = asyncio.create_task(self._forward(stream))

    async def _forward(self, stream: LinkStream) -> None:
        with contextlib.suppress(AgentGoneError):  # the link went: the action ends with it
            while True:
                item = await self._queue.get()
                if item is None:
                    stream.end_input()
                elif isinstance(item, int):
                    stream.signal(item)
                else:
                    sent = await stream.send(item)
                    self._queued_bytes -= len(item)
                    if not sent:
                        return  # it ended

    async def take(self, stream: LinkStream) -> AgentReply | None:
        """Its next chunk, once its caller has room for it (then acknowledged, so the
        agent may send more); None at its end."""
        await self.room()
        return await stream.next()

    def arrived(self, chunk: AgentReply) -> None:
        """A chunk of its output, decoded as UTF-8 across chunk boundaries."""
        if self.output is not None and chunk.data is not None:
            self._emit(chunk.fd, base64.b64decode(chunk.data), final=False)

    def _emit(self, fd: int, data: bytes, *, final: bool) -> None:
        assert self.output is not None
        decoder = self._decoders.get(fd)
        if decoder is None:
            decoder = self._decoders[fd] = codecs.getincrementaldecoder("utf-8")("replace")
        text = decoder.decode(data, final)
        if text:
            self.output("stderr" if fd == 2 else "stdout", text)

    def detach(self) -> None:
        """It ended: what an output ended in the middle of a character is said too."""
        if self._pump is not None:
            self._pump.cancel()
        self._stream = None
        for fd in list(self._decoders):
            self._emit(fd, b"", final=True)

"""A streamed exec's live side in the service: its output to its caller as the agent sends
it, and its caller's input and signals to the agent once it runs.

The caller may send input or a signal while the action still waits in the queue: they
are kept, in order, and go to the agent when the action is dispatched. Cores are taken
only when it runs, as for any exec; the input waits without holding any.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from tangram.api.wire import AgentInput, AgentReply
from tangram.service.agents import LinkStream

Output = Callable[[str, str], None]  # ("stdout" or "stderr", text)
_EOF = object()


@dataclass(slots=True)
class LiveExec:
    output: Output | None  # None: input and signals only (not streamed out)
    interactive: bool = False  # its stdin stays open for input until eof
    _stream: LinkStream | None = None
    _inputs: asyncio.Queue[bytes | object] = field(default_factory=asyncio.Queue)
    _signals: list[int] = field(default_factory=list)  # before it runs
    _pump: asyncio.Task[None] | None = None
    _decoders: dict[int, codecs.IncrementalDecoder] = field(default_factory=dict)

    def write(self, data: bytes) -> None:
        self._inputs.put_nowait(data)

    def close_stdin(self) -> None:
        self._inputs.put_nowait(_EOF)

    def signal(self, number: int) -> None:
        """For the command's process group: now if it runs, else as it starts."""
        if self._stream is None:
            self._signals.append(number)
        else:
            self._send_signal(self._stream, number)

    def _send_signal(self, stream: LinkStream, number: int) -> None:
        with contextlib.suppress(Exception):  # the link went: the action ends with it
            stream.link._post(AgentInput(target=stream.rid, signal=number).model_dump_json())

    def attach(self, stream: LinkStream) -> None:
        """The action runs: what waited goes to the agent, then what comes."""
        self._stream = stream
        for number in self._signals:
            self._send_signal(stream, number)
        self._signals.clear()
        if self.interactive:
            self._pump = asyncio.ensure_future(self._forward(stream))

    async def _forward(self, stream: LinkStream) -> None:
        while True:
            data = await self._inputs.get()
            if data is _EOF:
                await stream.end_input()
                return
            assert isinstance(data, bytes)
            if not await stream.send(data):
                return  # it ended

    def arrived(self, chunk: AgentReply) -> None:
        """A chunk of its output, decoded as UTF-8 across chunk boundaries."""
        if self.output is None or chunk.data is None:
            return
        decoder = self._decoders.get(chunk.fd)
        if decoder is None:
            decoder = self._decoders[chunk.fd] = codecs.getincrementaldecoder("utf-8")("replace")
        text = decoder.decode(base64.b64decode(chunk.data))
        if text:
            self.output("stderr" if chunk.fd == 2 else "stdout", text)

    def detach(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        self._stream = None

"""A streamed exec's live side in the service: what its caller sends before it runs goes
to the agent in order once it does; afterwards a signal goes at once; input that waits is
bounded."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from tangram.service.agents import LinkStream
from tangram.service.live import MAX_QUEUED_INPUT, LiveExec
from tangram.service.records import EngineError


class Stream:
    """What the live side asks of its link stream, recorded."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.taking = asyncio.Event()  # the command takes input (the window has room)
        self.taking.set()

    async def send(self, data: bytes) -> bool:
        await self.taking.wait()
        self.sent.append(data)
        return True

    def end_input(self) -> None:
        self.sent.append("eof")

    def signal(self, number: int) -> None:
        self.sent.append(number)


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_what_waited_goes_in_order_and_a_later_signal_at_once() -> None:
    async def scenario() -> None:
        live, stream = LiveExec(None, interactive=True), Stream()
        live.write(b"one")
        live.signal(15)
        live.write(b"two")
        live.close_stdin()
        live.attach(cast(LinkStream, stream))
        await _settle()
        assert stream.sent == [b"one", 15, b"two", "eof"]
        stream.taking.clear()  # the command stops reading its input
        live.write(b"three")
        await _settle()
        live.signal(2)  # not behind the input it has not taken
        assert stream.sent[-1] == 2
        live.detach()

    asyncio.run(scenario())


def test_input_waiting_for_the_command_is_bounded() -> None:
    live = LiveExec(None, interactive=True)
    live.write(bytes(MAX_QUEUED_INPUT))
    with pytest.raises(EngineError) as refused:
        live.write(b"x")
    assert (refused.value.kind, refused.value.field) == ("too_large", "stdin")


def test_output_cut_inside_a_character_is_said_at_the_end() -> None:
    import base64

    from tangram.api.wire import AgentReply

    said: list[tuple[str, str]] = []
    live = LiveExec(lambda fd, text: said.append((fd, text)))
    euro = "€".encode()
    for piece in (euro[:1], euro[1:], b"\xe2"):  # a whole one, then a dangling byte
        data = base64.b64encode(piece).decode()
        live.arrived(AgentReply(rid=1, ok=True, more=True, data=data))
    live.detach()
    assert said == [("stdout", "€"), ("stdout", "\ufffd")]

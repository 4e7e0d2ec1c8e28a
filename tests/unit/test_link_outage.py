"""How an agent speaks of a scheduler it cannot reach: each failure counted, the first
few and then one a minute as warnings, the rest at debug."""

from __future__ import annotations

from tangram.node_agent.link import Outage


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_first_failures_warn_then_one_a_minute_and_a_connect_starts_again() -> None:
    clock = Clock()
    down = Outage(clock)
    loud = []
    for _ in range(40):  # 40 failures 5 s apart: 195 s
        down.failed()
        loud.append((clock.now, down.loud()))
        clock.now += 5.0
    said = [at for at, is_loud in loud if is_loud]
    assert said == [0.0, 5.0, 10.0, 70.0, 130.0, 190.0]
    assert "40 failed attempts over 200 s" in down.ended()
    assert down.failed() == "" and down.loud()  # a new outage: warned from its first again
    assert down.failed().startswith(" (2 failed attempts") and down.loud()

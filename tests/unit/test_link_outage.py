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
    down.settled()  # the link served long enough
    assert down.failed() == "" and down.loud()  # a new outage: warned from its first again
    assert down.failed().startswith(" (2 failed attempts") and down.loud()


def test_a_link_that_connects_and_soon_fails_again_keeps_the_quota() -> None:
    """A node refused after its hello, or a scheduler crash-looping: each cycle connects,
    which ends the count, but warns no more than a link that never connected."""
    clock = Clock()
    down = Outage(clock)
    said = []
    for _ in range(30):  # a connect and a failure every 5 s, 145 s
        down.failed()
        if down.loud():
            said.append(clock.now)
        down.ended()
        clock.now += 5.0
    assert said == [0.0, 5.0, 10.0, 70.0, 130.0]

"""How an agent speaks of a scheduler it cannot reach: each failure counted, the first
few and then one a minute as warnings, the rest at debug; and of reaching it again: at
info when a failure before it was said, else at debug too."""

from __future__ import annotations

import logging

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
    level, text = down.ended()
    assert "40 failed attempts over 200 s" in text and level == logging.INFO
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


def test_a_flapping_links_connects_are_said_at_info_only_as_its_failures_are() -> None:
    """Each connect-fail cycle logged its connect at info, whatever the failures' quota: a
    node refused after its hello flooded the log with "connected ... again". A connect is
    said at info when it is the first, or when a failure since the one before was said;
    the line that is says how many were logged at debug meanwhile."""
    clock = Clock()
    down = Outage(clock)
    connects: list[tuple[float, int, str]] = []
    for _ in range(30):  # a connect and a failure every 5 s, 145 s
        connects.append((clock.now, *down.ended()))
        down.failed()
        down.loud()
        clock.now += 5.0
    said = [(at, text) for at, level, text in connects if level == logging.INFO]
    assert [at for at, _ in said] == [0.0, 5.0, 10.0, 15.0, 75.0, 135.0]  # after 0, 5, 10, 70, 130
    assert said[0][1] == ""  # the first connect
    assert said[1][1] == " again after 1 failed attempt over 5 s"
    assert said[4][1].endswith(" (11 connects logged at debug since the last said)"), said
    assert said[5][1].endswith(" (11 connects logged at debug since the last said)"), said
    quiet = [at for at, level, _ in connects if level == logging.DEBUG]
    assert len(quiet) == 24 and quiet[0] == 20.0 and quiet[-1] == 145.0  # the others


def test_the_reconnect_after_an_outage_is_said_however_the_link_flapped_before() -> None:
    """A link that served a while warns of its next failure (the quota starts again), so
    the connect that ends that outage is said; so is the one after any failure said past
    the quota (one a minute), or after a refusal (an error, whatever the quota)."""
    clock = Clock()
    down = Outage(clock)
    for _ in range(20):  # flapping, 5 s a cycle: the quota is spent
        down.ended()
        down.failed()
        down.loud()
        clock.now += 5.0
    assert down.ended()[0] == logging.DEBUG  # (its failure at debug: the quota is spent)
    clock.now += 600.0  # the link served ten minutes, then failed
    down.settled()
    down.failed()
    assert down.loud()
    clock.now += 1.0
    level, said = down.ended()
    assert level == logging.INFO and said.startswith(" again after 1 failed attempt"), said

    for _ in range(20):  # flapping again
        down.failed()
        down.loud()
        clock.now += 1.0
        down.ended()
    for _ in range(12):  # then down for a minute: one of its failures warns
        down.failed()
        down.loud()
        clock.now += 5.0
    level, said = down.ended()
    assert level == logging.INFO and "12 failed attempts over 60 s" in said, said

    for _ in range(10):  # flapping again: its failures at debug, and its connects
        down.failed()
        down.loud()
        down.ended()
    down.failed()
    assert not down.loud() and down.ended()[0] == logging.DEBUG
    down.failed(said=True)  # refused (an error, whatever the quota)
    assert down.ended()[0] == logging.INFO

"""The action stream names the message it cannot validate by the id at its start."""

from __future__ import annotations

from tangram.service.stream import _line_id


def test_the_id_of_a_broken_message_is_read_from_its_start() -> None:
    assert _line_id(b'{"id":42,"trajectory":') == 42
    assert _line_id(b' { "id" : 7 , "exec": {"argv": [1]}}') == 7
    assert _line_id(b'{"id":9}') == 9


def test_no_id_when_the_start_does_not_say_it() -> None:
    assert _line_id(b'{"trajectory":"t","id":4}') is None  # not first: not guessed
    assert _line_id(b'{"id":"4"}') is None
    assert _line_id(b'{"id":12345678901234567}') is None  # beyond what an id can be
    assert _line_id(b"garbage") is None

"""Keyed runs, written down before they start: an agent that restarts (kill -9, a new
pod, ``tangram up`` again) knows which keys ran, what each answered, and which were cut
off mid-run. A retry of a key is then answered from here, or refused as unknown, and
never runs the command a second time.

An append-only file in the agent's state directory: ``{"s": key, "a": asked}`` before a
run starts, ``{"d": key, "a": asked, "r": reply}`` when it ends (the reply as the agent
sends it; ``asked``, what the key ran, so that a restarted agent still refuses the key
for another request instead of answering with this one's reply), and ``{"f": key}`` when
its trajectory closed (the key is no one's to retry any more). Appends go to
the page cache, which outlives the process: a crash of the agent loses nothing; a crash
of the node loses at most the last writes, with the sandboxes. The file is rewritten
from what is kept once it holds more than twice that, so it stays bounded.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path

from tangram.api.wire import AgentReply
from tangram.private_files import private_dir, write_private

__all__ = ["KeyJournal"]
log = logging.getLogger("tangram.agent")


class KeyJournal:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self._written = 0  # bytes since the last rewrite
        self._torn = False  # the last append landed in part: the file ends mid-line
        self.asked: dict[str, str] = {}  # what each key loaded ran (lines that say so)
        self.malformed: list[int] = []  # numbers of the lines load skipped: not of its form

    def load(self) -> tuple[OrderedDict[str, bytes], set[str]]:
        """(replies of the runs that ended, oldest first; keys of runs that started and
        never ended: cut off by the agent's end, their outcome unknown)."""
        done: OrderedDict[str, bytes] = OrderedDict()
        started: set[str] = set()
        try:
            lines = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            lines = []
        for number, line in enumerate(lines, 1):
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut by the crash: nothing after it was written either
            # Any other line not of the journal's form (the file edited, or written by
            # another program) is skipped, not a failed start: the lines around it count.
            key = entry.get("s", entry.get("d")) if isinstance(entry, dict) else None
            forgotten = entry.get("f") if isinstance(entry, dict) else None
            if isinstance(forgotten, str):
                done.pop(forgotten, None)
                started.discard(forgotten)
                self.asked.pop(forgotten, None)
                continue
            if not isinstance(key, str):
                self.malformed.append(number)  # no key to keep
                continue
            asked = entry.get("a", "")
            reply = None if "s" in entry else _reply(entry.get("r"))
            if not isinstance(asked, str) or ("s" not in entry and reply is None):
                self.malformed.append(number)
                if key not in done:  # its run started, its reply unknown: never run again
                    started.add(key)
                continue
            if "a" in entry:
                self.asked[key] = asked
            if reply is None:  # a start
                started.add(key)
            else:
                started.discard(key)
                done[key] = reply
                done.move_to_end(key)
        if self.malformed:
            shown = ", ".join(map(str, self.malformed[:10]))
            log.warning(
                "the key journal %s: skipped %d line(s) not of its form (line %s%s); a key "
                "named there without a reply is answered as cut off",
                self.path,
                len(self.malformed),
                shown,
                ", ..." if len(self.malformed) > 10 else "",
            )
        return done, started

    def started(self, key: str, asked: str = "") -> None:
        self._append(_line(key, asked))

    def done(self, key: str, reply: bytes, asked: str = "") -> None:
        self._append(_line(key, asked, reply))

    def forget(self, key: str) -> None:
        self._append(b'{"f":' + _quoted(key) + b"}\n")

    def rewrite(
        self, done: Mapping[str, bytes], started: set[str], asked: Mapping[str, str] | None = None
    ) -> None:
        """Replace the file by what is kept (atomically: a crash leaves the old or the new);
        ``asked``: what each key ran."""
        asked = asked or {}
        # 0600: replies hold commands' output. Not synced, as the appends are not: the
        # page cache outlives a crash of the agent.
        write_private(self.path, _lines(done, started, asked))
        self.close()  # (the appends' descriptor: of the file replaced)
        self._written = 0
        self._torn = False  # a new file

    def due(self, kept_bytes: int) -> bool:
        """Whether the file has grown past twice what is kept: time to rewrite it."""
        return self._written > 2 * max(kept_bytes, 1 << 20)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _append(self, line: bytes) -> None:
        if self._fd < 0:
            private_dir(self.path.parent)  # (the agent's state directory, narrowed at its start)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                               0o600)  # fmt: skip
        if self._torn:  # what was left of the last line: this one starts on a line of its own
            line = b"\n" + line
        rest = memoryview(line)
        try:
            while rest:  # a write may take part of it (the disk filling up)
                rest = rest[os.write(self._fd, rest) :]
        except OSError:
            self._torn |= len(rest) < len(line)  # part of it landed: a line cut short
            raise
        self._torn = False
        self._written += len(line)


def _reply(reply: object) -> bytes | None:
    """A done line's reply as the agent keeps it (compact JSON), or None when it is not
    one the agent could replay."""
    kept = json.dumps(reply, separators=(",", ":")).encode()
    try:
        AgentReply.model_validate_json(kept)
    except ValueError:
        return None
    return kept


def _lines(
    done: Mapping[str, bytes], started: set[str], asked: Mapping[str, str]
) -> Iterator[bytes]:
    """The journal's lines for a rewrite, one at a time (the replies may be many MB)."""
    for key in started:
        yield _line(key, asked.get(key, ""))
    for key, reply in done.items():
        yield _line(key, asked.get(key, ""), reply)


def _line(key: str, asked: str, reply: bytes | None = None) -> bytes:
    """A journal line: ``key`` started, or (with its ``reply``) done; ``asked``: what it
    ran."""
    kind, end = (b'{"s":', b"}\n") if reply is None else (b'{"d":', b',"r":' + reply + b"}\n")
    return kind + _quoted(key) + _asked(asked) + end


def _quoted(key: str) -> bytes:
    return json.dumps(key).encode()


def _asked(asked: str) -> bytes:
    return b',"a":' + _quoted(asked) if asked else b""

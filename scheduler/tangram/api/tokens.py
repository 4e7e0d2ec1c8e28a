"""The token file's format, ``TOKEN TENANT`` a line with ``#`` comments: the contract between
the Secret the operator writes, the file the scheduler reads and the one clients read."""

from __future__ import annotations


def token_lines(text: str) -> list[tuple[int, list[str]]]:
    """(line number, fields) of every line that is not blank once its comment is cut."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if fields:
            out.append((n, fields))
    return out


__all__ = ["token_lines"]

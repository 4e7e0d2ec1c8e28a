"""Output is cut to what its JSON encoding lets a link frame carry; output with nothing to
escape is measured by its bytes, as ``output_cap`` measures it."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tangram.api.wire import MAX_OUTPUT, fit_output
from tangram.node_agent.agent import outcome
from tangram.node_agent.execution import ExecResult


def _size(text: str) -> int:
    """Its bytes as JSON writes it, between the quotes."""
    return len(json.dumps(text, ensure_ascii=False).encode()) - 2


@given(st.text(st.characters(codec="utf-8"), max_size=200), st.integers(0, 1200))
def test_the_kept_head_fits_and_is_cut_only_when_the_whole_does_not(text: str, budget: int) -> None:
    kept, cut = fit_output(text, budget)
    assert text.startswith(kept)
    assert cut == (_size(text) > budget)
    if cut:
        assert _size(kept) <= budget
        # Cut no further than needed: the next character would not have fitted (a light
        # head before heavy control bytes was cut short of the budget: "00" of "00\x1f…"
        # with room for 11 bytes).
        assert _size(text[: len(kept) + 1]) > budget
    else:
        assert kept == text


def test_a_light_head_before_heavy_bytes_is_kept_whole() -> None:
    kept, cut = fit_output("00\x1f" + "\0" * 50, budget=11)
    assert cut and kept == "00\x1f"
    kept, cut = fit_output("a" * 1000 + "\0" * 100_000, budget=2000)
    assert cut and kept.startswith("a" * 1000) and _size(kept) > 1994


def test_nul_bytes_are_kept_by_what_they_encode_to() -> None:
    kept, cut = fit_output("\0" * 1000, budget=602)
    assert cut and kept == "\0" * 100  # 6 bytes each
    assert fit_output("a" * 600, budget=600) == ("a" * 600, False)
    assert fit_output("é" * 300, budget=600) == ("é" * 300, False)  # UTF-8: 2 bytes each
    assert fit_output("é" * 301, budget=600) == ("é" * 300, True)


def test_an_output_at_the_largest_cap_comes_back_whole() -> None:
    """16 MiB of output, the most ``output_cap`` lets a command keep, is sent whole and not
    marked cut (the JSON's quotes were counted against it: 2 characters short, "cut"), as 1
    MiB at a cap of 1 MiB is; a byte more is cut to the cap."""
    whole = "a" * MAX_OUTPUT
    assert fit_output(whole) == (whole, False)
    kept, cut = fit_output(whole + "b")
    assert cut and kept == whole
    result = ExecResult(0, whole, "é" * (MAX_OUTPUT // 2), False, False, False, (0,), 0, 0, 0)
    sent = outcome(result)
    assert (len(sent.stdout), sent.stdout_truncated) == (MAX_OUTPUT, False)
    assert (len(sent.stderr), sent.stderr_truncated) == (MAX_OUTPUT // 2, False)

"""Output is cut to what its JSON encoding lets a link frame carry."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tangram.api.wire import fit_output


def _size(text: str) -> int:
    return len(json.dumps(text, ensure_ascii=False).encode())


@given(st.text(st.characters(codec="utf-8"), max_size=200), st.integers(2, 1200))
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
    assert cut and _size(kept) <= 602 and len(kept) >= 95  # 6 bytes each, and the quotes
    assert fit_output("a" * 600, budget=602) == ("a" * 600, False)

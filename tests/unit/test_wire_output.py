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
        # Not cut much further than needed: the next character would not have fitted,
        # or what is kept is within 1 % (and a character) of the budget.
        assert _size(text[: len(kept) + 1]) > budget or _size(kept) >= 0.98 * budget - 6
    else:
        assert kept == text


def test_nul_bytes_are_kept_by_what_they_encode_to() -> None:
    kept, cut = fit_output("\0" * 1000, budget=602)
    assert cut and _size(kept) <= 602 and len(kept) >= 95  # 6 bytes each, and the quotes
    assert fit_output("a" * 600, budget=602) == ("a" * 600, False)

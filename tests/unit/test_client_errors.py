"""What the client's own errors say."""

from __future__ import annotations

import errno
import resource

import pytest

from tangram.client import ActionTimeoutError, TooManyOpenFilesError


def test_a_batch_past_timeout_s_names_its_actions_as_many() -> None:
    """It said "the action with idempotency key 'a', 'b', 'c' and 1 more" and, when the
    cancel failed, to cancel one of them: cancel('key:a')."""
    keys = ["a", "b", "c", "d"]
    failed = str(ActionTimeoutError(keys, 5.0, None))
    assert "to the actions with idempotency keys 'a', 'b', 'c' and 1 more: " in failed
    assert failed.endswith("cancelling them failed; cancel them by key")
    assert str(ActionTimeoutError(keys, 5.0, 3)).endswith(": cancelled 3 of the 4")
    assert str(ActionTimeoutError(keys, 5.0, 0)).endswith(": none was still queued or running")
    one = str(ActionTimeoutError(["a"], 5.0, None))  # one key: as before
    assert one == (
        "no answer within the client's timeout_s=5 s to the action with idempotency key "
        "'a': cancelling it failed; cancel it with cancel('key:a')"
    )


@pytest.mark.parametrize(("soft", "said"), [(1024, "1024"), (resource.RLIM_INFINITY, "unlimited")])
def test_out_of_files_names_the_limit_unlimited_when_there_is_none(
    monkeypatch: pytest.MonkeyPatch, soft: int, said: str
) -> None:
    """A soft RLIMIT_NOFILE of RLIM_INFINITY was said to be "unknown"."""
    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, soft))
    e = TooManyOpenFilesError("http://127.0.0.1:1", errno.EMFILE, 512)
    assert f"this process may have {said} files open at once" in str(e)
    assert e.errno == errno.EMFILE

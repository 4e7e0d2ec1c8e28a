"""``async with client.trajectory(...)``: the body's error is the one raised, even when
closing the trajectory then fails too."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tangram.api.wire import TrajectoryInfo, TrajectoryState
from tangram.client import AsyncClient, TangramError


class _CloseFails(AsyncClient):
    """Opens without a service; every close fails as an unreachable node's would."""

    async def open(self, env: str, **_: Any) -> TrajectoryInfo:
        return TrajectoryInfo(id="t-1", env=env, node="n1", state=TrajectoryState.OPEN,
                              opened_at=time.time())  # fmt: skip

    async def close(self, trajectory: str) -> TrajectoryInfo:
        raise TangramError(503, "unavailable", f"{trajectory}: its node is away", [])


def test_a_failed_close_does_not_hide_the_body_s_error() -> None:
    async def main() -> None:
        async with _CloseFails("http://127.0.0.1:9", "t" * 24) as c:
            with pytest.raises(ValueError, match="the body's") as caught:
                async with c.trajectory("shell"):
                    raise ValueError("the body's")
            notes = getattr(caught.value, "__notes__", [])
            assert any("closing trajectory t-1 failed" in n for n in notes)
            # A body that ended well: the failed close is the error.
            with pytest.raises(TangramError, match="its node is away"):
                async with c.trajectory("shell"):
                    pass

    asyncio.run(main())

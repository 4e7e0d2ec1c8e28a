"""ServiceAccount-token admission: the access policy and the TokenReview cache."""

from __future__ import annotations

import asyncio

import pytest

from tangram.service.config import PoolConfig
from tangram.service.reviews import NotAdmittedError, TokenReviewer, admitted

POOL = PoolConfig(
    name="coding",
    namespace="rl",
    access_namespaces=("eval",),
    access_service_accounts=("batch/trainer",),
)


@pytest.mark.parametrize(
    ("user", "ok"),
    [
        ("system:serviceaccount:rl:worker", True),  # the pool's own namespace
        ("system:serviceaccount:eval:anyone", True),  # an admitted namespace
        ("system:serviceaccount:batch:trainer", True),  # an admitted account
        ("system:serviceaccount:batch:other", False),
        ("system:serviceaccount:rl", False),  # malformed
        ("alice@example.com", False),  # people do not submit actions
        ("system:node:n1", False),
    ],
)
def test_admission(user: str, ok: bool) -> None:
    assert admitted(user, POOL) is ok


def test_star_admits_every_namespace() -> None:
    star = PoolConfig(namespace="rl", access_namespaces=("*",))
    assert admitted("system:serviceaccount:anywhere:x", star)


class _Reviews:
    """A review function that counts its calls and answers after the test lets it."""

    def __init__(self, users: dict[str, str]) -> None:
        self.users, self.calls = users, 0
        self.gate = asyncio.Event()

    async def __call__(self, token: str) -> str | None:
        self.calls += 1
        await self.gate.wait()
        return self.users.get(token)


def test_concurrent_requests_share_one_review_and_the_answer_is_cached() -> None:
    async def main() -> None:
        reviews = _Reviews({"tok": "system:serviceaccount:rl:worker"})
        now = [0.0]
        reviewer = TokenReviewer(reviews, clock=lambda: now[0], ttl_s=60)
        waiting = [asyncio.create_task(reviewer.tenant("tok", POOL)) for _ in range(20)]
        await asyncio.sleep(0)
        reviews.gate.set()
        assert set(await asyncio.gather(*waiting)) == {"system:serviceaccount:rl:worker"}
        assert reviews.calls == 1
        now[0] = 59.0
        await reviewer.username("tok")
        assert reviews.calls == 1
        now[0] = 61.0  # expired: asked again
        await reviewer.username("tok")
        assert reviews.calls == 2

    asyncio.run(main())


def test_invalid_tokens_are_remembered_briefly() -> None:
    async def main() -> None:
        reviews = _Reviews({})
        reviews.gate.set()
        now = [0.0]
        reviewer = TokenReviewer(reviews, clock=lambda: now[0], negative_ttl_s=5)
        assert await reviewer.tenant("bad", POOL) is None
        assert await reviewer.tenant("bad", POOL) is None
        assert reviews.calls == 1
        now[0] = 6.0
        assert await reviewer.tenant("bad", POOL) is None
        assert reviews.calls == 2

    asyncio.run(main())


def test_valid_but_not_admitted_names_the_access_fields() -> None:
    async def main() -> None:
        reviews = _Reviews({"tok": "system:serviceaccount:other:x"})
        reviews.gate.set()
        with pytest.raises(NotAdmittedError, match=r"spec\.access\.namespaces"):
            await TokenReviewer(reviews).tenant("tok", POOL)

    asyncio.run(main())


def test_a_failed_review_reaches_every_waiter_and_is_not_cached() -> None:
    async def main() -> None:
        calls = 0

        async def failing(token: str) -> str | None:
            nonlocal calls
            calls += 1
            await asyncio.sleep(0)
            raise RuntimeError("API server down")

        reviewer = TokenReviewer(failing)
        results = await asyncio.gather(
            *(reviewer.username("t") for _ in range(3)), return_exceptions=True
        )
        assert all(isinstance(r, RuntimeError) for r in results)
        with pytest.raises(RuntimeError):
            await reviewer.username("t")
        assert calls == 2

    asyncio.run(main())


def test_the_cache_is_bounded() -> None:
    async def main() -> None:
        reviews = _Reviews({})
        reviews.gate.set()
        reviewer = TokenReviewer(reviews, max_entries=3)
        for i in range(5):
            await reviewer.username(f"t{i}")
        await reviewer.username("t0")  # evicted, so reviewed again
        assert reviews.calls == 6

    asyncio.run(main())

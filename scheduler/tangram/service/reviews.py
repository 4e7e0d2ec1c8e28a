"""Clients authenticated by their Kubernetes ServiceAccount tokens, as the pool admits them.

In a cluster, rollout workers present their pod's ServiceAccount token. The scheduler asks
the API server who it belongs to (a TokenReview, through :mod:`tangram.service.kube`) and
admits the account when the pool's ``spec.access`` does: its own namespace, a namespace of
``access.namespaces`` (``*`` for all), or an account of ``access.serviceAccounts``. The
tenant is the account's username, ``system:serviceaccount:<ns>:<name>``: two workers with
one account share their trajectories, two accounts never do.

Reviews are cached by a hash of the token for a minute (a rejected token for a few
seconds), and concurrent requests with one new token share one review, so a burst of
actions costs the API server one call. Revoking a token therefore takes up to ``ttl_s``.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tangram.api.access import namespace_admitted
from tangram.service.config import PoolConfig

SA_PREFIX = "system:serviceaccount:"

Review = Callable[[str], Awaitable[str | None]]
"""token -> the authenticated username, or None (asks the API server)."""


class ReviewError(RuntimeError):
    """The API server could not review a token (unreachable, or refused the scheduler)."""


class NotAdmittedError(Exception):
    """An authenticated account the pool's access list does not name."""


def admitted(username: str, config: PoolConfig) -> bool:
    """Whether the pool admits this user (pure)."""
    if not username.startswith(SA_PREFIX):
        return False  # users and nodes do not submit actions; workloads do
    namespace, _, name = username[len(SA_PREFIX) :].partition(":")
    if not namespace or not name:
        return False
    return (
        namespace_admitted(config.namespace, namespace, config.access_namespaces)
        or f"{namespace}/{name}" in config.access_service_accounts
    )


@dataclass(slots=True)
class _Entry:
    username: str | None
    expires: float


class TokenReviewer:
    """Caches and deduplicates TokenReviews; decides admission against the live config."""

    def __init__(
        self,
        review: Review,
        *,
        clock: Callable[[], float] = time.monotonic,
        ttl_s: float = 60.0,
        negative_ttl_s: float = 5.0,
        max_entries: int = 10_000,
    ) -> None:
        self._review = review
        self._clock = clock
        self.ttl_s, self.negative_ttl_s, self.max_entries = ttl_s, negative_ttl_s, max_entries
        self._cache: OrderedDict[bytes, _Entry] = OrderedDict()
        self._pending: dict[bytes, asyncio.Future[str | None]] = {}

    async def username(self, token: str) -> str | None:
        """The token's user, from the cache or one review; None when it is not valid."""
        key = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        entry = self._cache.get(key)
        if entry is not None and entry.expires > self._clock():
            return entry.username
        pending = self._pending.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            user = await self._review(token)
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: waiters get it, nobody else must
            raise
        finally:
            del self._pending[key]
        future.set_result(user)
        ttl = self.ttl_s if user is not None else self.negative_ttl_s
        self._cache[key] = _Entry(user, self._clock() + ttl)
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return user

    async def tenant(self, token: str, config: PoolConfig) -> str | None:
        """The tenant of a valid token the pool admits; None for an invalid token;
        :class:`NotAdmittedError` for a valid one it does not admit."""
        user = await self.username(token)
        if user is None:
            return None
        if not admitted(user, config):
            raise NotAdmittedError(
                f"{user} is not admitted by ActionPool {config.namespace}/{config.name} "
                "(spec.access.namespaces, spec.access.serviceAccounts)"
            )
        return user


__all__ = ["SA_PREFIX", "NotAdmittedError", "ReviewError", "TokenReviewer", "admitted"]

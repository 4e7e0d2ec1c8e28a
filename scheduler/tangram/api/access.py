"""Who may use an ActionPool, and how its tenants share it: ``spec.access``."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Annotated

from pydantic import Field, field_validator

from tangram.api.spec_base import DNS_LABEL_RE, DNS_SUBDOMAIN, Spec


def _all(names: list[str], good: Callable[[str], bool], refusal: str) -> list[str]:
    """``names`` when every one is ``good``; else the error lists the others."""
    bad = [n for n in names if not good(n)]
    if bad:
        raise ValueError(f"{refusal}: {bad}")
    return names


def _is_namespace(name: str) -> bool:
    return name == "*" or (DNS_LABEL_RE.match(name) is not None and len(name) <= 63)


def _is_service_account(name: str) -> bool:
    ns, slash, sa = name.partition("/")
    return bool(slash and DNS_LABEL_RE.match(ns) and re.match(DNS_SUBDOMAIN, sa))


class TenantPolicy(Spec):
    """What one tenant may hold of the pool, and its share when tenants compete."""

    name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=253,
            description="the tenant as the scheduler names it: a token file's tenant, or "
            "system:serviceaccount:NAMESPACE:NAME for a ServiceAccount; '*' is every tenant "
            "not listed",
        ),
    ]
    weight: Annotated[
        float,
        Field(
            gt=0,
            le=1000,
            description="its share under contention: between tenants with actions waiting, "
            "the next to start is the one furthest below its weighted share of the work "
            "started (fair queuing); first come first served within one tenant",
        ),
    ] = 1.0
    max_trajectories: Annotated[
        int | None,
        Field(ge=1, description="trajectories it may have open at once; unset = no limit"),
    ] = None
    max_queued: Annotated[
        int | None,
        Field(ge=1, description="actions it may have waiting at once; unset = no limit"),
    ] = None
    max_streams: Annotated[
        int | None,
        Field(
            ge=1,
            description="action streams (/v1/stream) it may have open at once, each of "
            "which may hold up to 512 MiB of answers its client has not read; the next is "
            "refused with 429 (the Python client then submits over HTTP); unset = no limit",
        ),
    ] = None
    max_share: Annotated[
        float,
        Field(
            gt=0,
            le=1,
            description="the fraction of the pool's cores, GPUs and of each API quota's "
            "concurrency its running actions may hold at once (1 = all of it when nobody "
            "else waits); a smaller share keeps units free for other tenants",
        ),
    ] = 1.0


class Access(Spec):
    """Who may submit actions to the pool and reference it from their resources."""

    namespaces: Annotated[
        list[str],
        Field(description="namespaces admitted besides the pool's own; '*' admits every one"),
    ] = []
    service_accounts: Annotated[
        list[str],
        Field(description="service accounts admitted, as namespace/name"),
    ] = []
    tenants: Annotated[
        list[TenantPolicy],
        Field(
            description="per-tenant limits and shares; tenants not listed (and no '*') "
            "have no limits and weight 1"
        ),
    ] = []

    @field_validator("tenants")
    @classmethod
    def _tenants(cls, v: list[TenantPolicy]) -> list[TenantPolicy]:
        seen = Counter(t.name for t in v)
        twice = sorted(n for n, k in seen.items() if k > 1)
        if twice:
            raise ValueError(f"tenants listed more than once: {twice}")
        return v

    @field_validator("namespaces")
    @classmethod
    def _namespaces(cls, v: list[str]) -> list[str]:
        return _all(v, _is_namespace, "not namespace names")

    @field_validator("service_accounts")
    @classmethod
    def _service_accounts(cls, v: list[str]) -> list[str]:
        return _all(v, _is_service_account, "service accounts must be namespace/name")

    def admits(self, own_namespace: str, namespace: str) -> bool:
        """Whether objects of ``namespace`` may use a pool living in ``own_namespace``."""
        return namespace_admitted(own_namespace, namespace, self.namespaces)


def namespace_admitted(own: str, namespace: str, admitted: Sequence[str]) -> bool:
    """A pool living in ``own`` admits ``namespace``: its own, or listed (``*``: any)."""
    return namespace == own or "*" in admitted or namespace in admitted

"""The operator's config push (``POST /v1/admin/reload``) against the real scheduler: an
ordering or tenantFairness change under load applies in the same push (the queue is
re-ordered under it), the answer says so; the push is capped apart from the pool's
``admission.maxRequestBytes``."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import httpx
import pytest

from tangram.api.cluster import ApiSpec
from tangram.cli.up import pool_reloader
from tangram.client import Client
from tangram.operator.scheduler_link import SchedulerError, SchedulerLink, SchedulerRefusedError
from tangram.service.app import RELOAD_MAX_BYTES
from tangram.service.auth import OPERATOR_TENANT, TokenStore
from tangram.service.config import PoolConfig

from .service_harness import service, until

pytestmark = [pytest.mark.xdist_group("service")]
USER, OPERATOR = "u" * 24, "o" * 24

DOCS = """\
apiVersion: tangram.dev/v1alpha1
kind: ActionPool
metadata: {{name: p, namespace: rl}}
spec:
  apis: [{apis}]
  scheduling: {{ordering: {ordering}, tenantFairness: {fair}}}
"""
SEARCH = "{name: search, concurrency: 1}"


def _docs(apis: str = SEARCH, ordering: str = "fcfs", fair: str = "true") -> str:
    return DOCS.format(apis=apis, ordering=ordering, fair=fair)


@pytest.mark.parametrize(
    ("asked", "said"),
    [
        (
            dict(ordering="trajectory-priority"),
            "spec.scheduling.ordering fcfs -> trajectory-priority: 1 queued action re-ordered",
        ),
        # With a quota added in the same push: all of it applies.
        (
            dict(fair="false", apis=SEARCH + ", {name: browse, concurrency: 2}"),
            "spec.scheduling.tenantFairness true -> false: 1 queued action re-ordered",
        ),
    ],
)
def test_an_ordering_change_under_load_applies_in_the_same_push(
    tmp_path: Path, asked: dict[str, str], said: str
) -> None:
    tokens = TokenStore({USER: "local", OPERATOR: OPERATOR_TENANT})
    config = PoolConfig(name="p", namespace="rl", apis=(ApiSpec(name="search", concurrency=1),))
    with (
        service(config, None, tmp_path, tokens=tokens) as (running, _),
        Client(running.url, USER) as c,
    ):
        running.engine.reloader = pool_reloader([], None)
        link = SchedulerLink()
        link.reload(running.url, OPERATOR, _docs())
        held = c.lease("search", hold_s=60)
        assert held.lease is not None
        waiter = threading.Thread(target=lambda: c.lease("search", hold_s=1), daemon=True)
        waiter.start()
        core = running.engine.core
        until(lambda: len(core.queue) > 0, "a queued lease")
        docs = _docs(**asked)
        answer = httpx.post(f"{running.url}/v1/admin/reload", content=docs.encode(),
                            headers={"Authorization": f"Bearer {OPERATOR}"})  # fmt: skip
        assert answer.status_code == 200
        # Applied at once, the lease still queued: the scheduler runs what was asked.
        expected = (asked.get("ordering", "fcfs"), asked.get("fair", "true") == "true")
        assert (core.config.ordering, core.config.tenant_fairness) == expected
        body = answer.json()
        assert list(body) == ["changes"]  # (an object: nothing is left for later)
        assert f"scheduling ({said})" in body["changes"]
        assert running.engine.config.scheduling == core.config
        assert len(core.queue) == 1 and len(core.actions) == 1
        assert "browse" in core.quotas if "browse" in docs else True  # the rest applied
        # The same push again: nothing left to change.
        assert link.reload(running.url, OPERATOR, docs) == []
        c.release(held.lease)  # the queued lease starts under the new ordering
        waiter.join(10)
        assert not waiter.is_alive()
        until(lambda: len(core.queue) == 0, "the queued lease started")


def test_the_operators_push_is_not_capped_by_the_pools_max_request_bytes(
    tmp_path: Path,
) -> None:
    """A pool's admission.maxRequestBytes (down to 1024) is for its users' requests; the
    push of its own documents (an example pool's are ~1.6 KB) has the fixed cap."""
    tokens = TokenStore({USER: "local", OPERATOR: OPERATOR_TENANT})
    config = PoolConfig(apis=(ApiSpec(name="search", concurrency=1),), max_request_bytes=1024)
    with service(config, None, tmp_path, tokens=tokens) as (running, _):
        running.engine.reloader = lambda _text: config
        link = SchedulerLink()
        docs = "# " + "x" * 2000 + "\n"
        assert link.reload(running.url, OPERATOR, docs) == []
        with pytest.raises(SchedulerError) as over:  # (413, or the reset that cuts it short)
            link.reload(running.url, OPERATOR, "#" * (RELOAD_MAX_BYTES + 1))
        assert not isinstance(over.value, SchedulerRefusedError)
        # Users' requests keep the pool's limit.
        big = httpx.post(f"{running.url}/v1/trajectories", content=b"{" + b" " * 2000 + b"}",
                         headers={"Authorization": f"Bearer {USER}"})  # fmt: skip
        assert big.status_code == 413


def test_a_push_is_logged_applied_with_its_changes_and_refused_with_its_reasons(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reload by ``POST /v1/admin/reload`` (the operator's) logged nothing, applied or
    refused: a SIGHUP's is said by the CLI, this one only the log can tell."""
    caplog.set_level(logging.INFO, logger="tangram.service.reload")
    tokens = TokenStore({USER: "local", OPERATOR: OPERATOR_TENANT})
    config = PoolConfig(name="p", namespace="rl", apis=(ApiSpec(name="search", concurrency=1),))
    with service(config, None, tmp_path, tokens=tokens) as (running, _):
        running.engine.reloader = pool_reloader([], None)
        link = SchedulerLink()
        changes = link.reload(running.url, OPERATOR, _docs(ordering="trajectory-priority"))
        with pytest.raises(SchedulerRefusedError):
            link.reload(running.url, OPERATOR, _docs().replace("ordering:", "'[/]': 1, ordering:"))
    applied, refused = (r for r in caplog.records if r.name == "tangram.service.reload")
    assert applied.levelno == logging.INFO and applied.changes == changes != []  # type: ignore[attr-defined]
    assert applied.getMessage() == "reloaded: " + "; ".join(changes)
    assert refused.levelno == logging.WARNING and refused.getMessage().startswith("reload refused")
    assert any("[/]" in r for r in refused.reasons)  # type: ignore[attr-defined]

"""How the operator talks to a pool's scheduler: its figures, config pushes, drains.

Plain HTTP with the operator's token (``system:operator`` in the pool's tokens Secret),
which may do nothing but these three admin calls. In a cluster the scheduler is reached
through its Service's DNS name. An operator running outside the cluster (development, the
e2e tests) cannot resolve that, so ``--scheduler-endpoints FILE`` maps ``namespace/pool``
to a URL; the file is re-read on every call and only whoever starts the operator can set
it (an annotation on the pool would let anyone who edits pools send the token elsewhere).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from tangram.api.resources import ActionPool
from tangram.api.wire import PoolFigures
from tangram.operator.builders import scheduler_address

TIMEOUT_S = 5.0
END_TIMEOUT_S = 20.0  # the drain's end: its cancels wait up to 5 s each, together


class SchedulerError(RuntimeError):
    """No answer, a refusal, or an answer that is not a scheduler's."""


class SchedulerRefusedError(SchedulerError):
    """The scheduler answered and said no (HTTP 400: the pushed definitions are wrong);
    the message is its own."""


class Endpoints:
    """The base URL of each pool's scheduler."""

    def __init__(self, overrides: Path | None = None, *, loopback: bool = False) -> None:
        self.overrides = overrides
        self.loopback = loopback  # schedulers on the node's 127.0.0.1 (builders.Loopback)

    def cluster_url(self, pool: ActionPool) -> str:
        return f"http://{scheduler_address(pool, self.loopback)}"

    def url(self, pool: ActionPool) -> str:
        if self.overrides is not None:
            try:
                table = yaml.safe_load(self.overrides.read_text(encoding="utf-8")) or {}
            except (OSError, yaml.YAMLError):
                table = {}
            found = table.get(f"{pool.metadata.namespace}/{pool.metadata.name}")
            if isinstance(found, str):
                return found.rstrip("/")
        return self.cluster_url(pool)


class SchedulerLink:
    def __init__(self, timeout_s: float = TIMEOUT_S) -> None:
        self.timeout_s = timeout_s

    def _call(
        self,
        method: str,
        url: str,
        token: str,
        body: bytes | None = None,
        timeout_s: float | None = None,
    ) -> bytes:
        headers = {"Authorization": f"Bearer {token}"}
        if body is not None:
            headers["Content-Type"] = "application/yaml"
        req = urllib.request.Request(url, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                data: bytes = resp.read()
                return data
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:2000]
            if e.code == 400:
                raise SchedulerRefusedError(_message(detail)) from None
            raise SchedulerError(f"{method} {url}: HTTP {e.code} {detail[:500]}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise SchedulerError(f"{method} {url}: {reason}") from None

    def figures(self, base: str, token: str) -> PoolFigures:
        data = self._call("GET", f"{base}/v1/admin/status", token)
        return _figures(f"{base}: not a scheduler's status", data)

    def reload(self, base: str, token: str, documents: str) -> list[str]:
        """Push the pool's documents: what the scheduler changed (all of it applies at once).
        :class:`SchedulerRefusedError` when it refused them (400), any other
        :class:`SchedulerError` when the push failed (no answer, 413, 5xx)."""
        data = self._call("POST", f"{base}/v1/admin/reload", token, documents.encode("utf-8"))
        try:
            answer: object = json.loads(data)
        except ValueError:
            answer = None
        changes = answer.get("changes", []) if isinstance(answer, dict) else None
        if not isinstance(changes, list):
            # A SchedulerError, which the reconciler handles, not one its pass dies of.
            raise SchedulerError(f"{base}: not a scheduler's reload answer: {data[:200]!r}")
        return [str(c) for c in changes]

    def drain(self, base: str, token: str, *, end: bool = False) -> PoolFigures:
        """Refuse new trajectories; ``end``: the drain's time ran out, every action ends
        (answered once each has: a cancel waits for its agent's word, 5 s at most)."""
        url = f"{base}/v1/admin/drain{'?end=true' if end else ''}"
        data = self._call("POST", url, token, b"", END_TIMEOUT_S if end else None)
        # As a SchedulerError a wrong answer counts as none, which the finalizer waits on
        # for at most drainSeconds; anything else would fail it on every retry, forever.
        return _figures(f"{base}: not a scheduler's drain answer", data)


def _figures(otherwise: str, data: bytes) -> PoolFigures:
    """The figures a scheduler answered with; SchedulerError(``otherwise``...) if none."""
    try:
        return PoolFigures.model_validate_json(data)
    except ValueError as e:  # pydantic's ValidationError is one
        raise SchedulerError(f"{otherwise}: {e}") from None


def _message(detail: str) -> str:
    """The message of a scheduler's error body (``{"error": {"message": ...}}``)."""
    try:
        message = json.loads(detail)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return detail[:500]
    return str(message)


__all__ = ["Endpoints", "SchedulerError", "SchedulerLink", "SchedulerRefusedError"]

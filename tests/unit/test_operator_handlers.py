"""The kopf handlers' settings: a drain's "not done yet" is progress, not an error."""

from __future__ import annotations

import logging

import kopf
from kopf._core.engines.posting import K8sPoster  # kopf's own Event poster

from tangram.operator import handlers


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_temporary_error_is_logged_as_progress_and_not_posted_as_an_event() -> None:
    settings = kopf.OperatorSettings()
    handlers.configure(settings=settings)  # type: ignore[call-arg]  # (kopf's other kwargs)
    settings.posting.loggers = True  # as kopf releases before the setting always did
    logger, kept = logging.getLogger("kopf.objects"), _Kept()
    logger.addHandler(kept)
    try:
        ref = {"apiVersion": "tangram.dev/v1alpha1", "kind": "ActionPool", "name": "p",
               "namespace": "rl", "uid": "u"}  # fmt: skip
        extra = {"settings": settings, "k8s_ref": ref}
        logger.error("Handler 'pool_deleted' failed temporarily: 7 trajectories open; 595 s "
                     "left", extra=extra)  # fmt: skip
        logger.error("Handler 'pool_changed' failed with an exception. Will retry.", extra=extra)
    finally:
        logger.removeHandler(kept)
    waiting, failed = kept.records
    assert waiting.levelno == logging.INFO and not K8sPoster().filter(waiting)
    assert failed.levelno == logging.ERROR and K8sPoster().filter(failed)  # still an Event

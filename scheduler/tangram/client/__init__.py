"""The Python client of ARL-Tangram, for rollout workers.

    from tangram.client import AsyncClient

    async with AsyncClient() as client:               # TANGRAM_URL, TANGRAM_TOKEN
        async with client.trajectory("sandbox") as t:  # opens, and closes at the end
            r = await t.exec(["pytest", "-n", "{dop}", "-q"], elastic=(1, 8), amdahl=0.9)
            print(r.status, r.exit_code, r.allocation.dop, r.timings.act_s)
            await t.files.write("patch.diff", patch)   # the environment's files
            live = await t.exec_live(["pytest", "-v"])  # output as it is produced
            async for fd, text in live.output():
                print(text, end="")

``Client`` is the same API without ``await``. Every submission carries an idempotency
key, so the client's retries (connection errors, answers cut off, 429 and 503 with
Retry-After, logged at INFO on ``tangram.client``) never run an action twice; a 429 no
wait clears (the tenant's maxTrajectories) is raised at once. A call given up (its task
cancelled, ``timeout_s``, ``aclose``) cancels its action by key, and an open closes what
it opened. Each result names its key (``r.idempotency_key``): a result whose
``r.error.retryable`` is set (``node_lost``: an exec never ran; a RewardService call may
have, but a call has no side effect) may be submitted again as it is; one
``outcome_unknown`` (its node lost once it was sent: it may have run) only under that
key, which never runs it twice and answers its outcome once its node is back.
Errors: ``TangramError`` for the service's answers (status, code, field),
``ServiceUnreachableError`` when no answer came after every retry (a submission's names
its key: it may have run, unless no try reached the service, ``maybe_sent``),
``ActionTimeoutError`` (a ``TimeoutError``) past the client's ``timeout_s`` (the action is
then cancelled by its key), ``CallTimeoutError`` (a ``TimeoutError`` too) for any other
call past it, naming the call, ``ClientClosedError`` from a client closed (or a ``Client``
forked), ``StreamClosedError`` (a ``ConnectionError``) from a live exec whose stream
dropped, ``TooManyOpenFilesError`` (an ``OSError``, not retried) when this process has no
file descriptor left for a connection.
"""

from tangram.api.wire import ActionResult, ActionStatus, TrajectoryInfo
from tangram.client.aio import AsyncClient, AsyncTrajectory
from tangram.client.common import (
    ActionTimeoutError,
    CallTimeoutError,
    ClientClosedError,
    ServiceUnreachableError,
    StreamClosedError,
    TangramError,
    TooManyOpenFilesError,
)
from tangram.client.stream import LiveAction
from tangram.client.sync import Client, Trajectory

__all__ = [
    "ActionResult",
    "ActionStatus",
    "ActionTimeoutError",
    "AsyncClient",
    "AsyncTrajectory",
    "CallTimeoutError",
    "Client",
    "ClientClosedError",
    "LiveAction",
    "ServiceUnreachableError",
    "StreamClosedError",
    "TangramError",
    "TooManyOpenFilesError",
    "Trajectory",
    "TrajectoryInfo",
]

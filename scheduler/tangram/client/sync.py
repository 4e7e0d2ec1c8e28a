"""The synchronous client: the asyncio client driven on a private event-loop thread.

One implementation of the protocol (``AsyncClient``), so the two clients cannot drift.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import weakref
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

from tangram.api.wire import ActionResult, FileEntry, FileWritten, TrajectoryInfo, Unpacked
from tangram.client.aio import AsyncClient, AsyncTrajectory
from tangram.client.common import ClientClosedError
from tangram.client.files import AsyncFiles

T = TypeVar("T")
LET_GO_S = 5.0  # how long a Client no one holds takes to close, at most


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, **kw: Any) -> None:
        self._pid = os.getpid()  # a fork's child has no loop thread: see _run
        self._closed = False
        self._lock = threading.Lock()  # orders calls submitted against shutdown
        self._calls: set[asyncio.Task[Any]] = set()  # those running (touched on the loop)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="tangram-client"
        )
        self._thread.start()
        try:
            self._async = self._run(self._make(url, token, kw))
        except BaseException:  # (a misspelt keyword): no loop thread left behind
            self._closed = True
            self._stop_loop()
            raise
        # Dropped without shutdown(), its thread, stream and connections were kept for the
        # life of the process (each stream counting against the tenant's maxStreams).
        self._finalizer = weakref.finalize(
            self, _let_go, self._loop, self._thread, self._async, self._pid
        )

    @staticmethod
    async def _make(url: str | None, token: str | None, kw: dict[str, Any]) -> AsyncClient:
        return AsyncClient(url, token, **kw)  # created on the loop that will use it

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if os.getpid() != self._pid:
            coro.close()
            raise ClientClosedError(
                f"this Client was made in process {self._pid}, and its event-loop thread "
                "does not exist in this fork of it: make a new Client here"
            )
        with self._lock:
            if self._closed:
                coro.close()
                raise ClientClosedError("this Client was shut down: make a new one")
            future = asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if self._closed:  # cancelled by shutdown()
                raise ClientClosedError("the Client was shut down while this call waited") from None
            raise

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        try:
            return await coro
        finally:
            self._calls.discard(task)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Cancel the calls still waiting (other threads' calls raise
        ``ClientClosedError``; their actions are cancelled by key, as far as the service
        can be asked), close the connections and stop the loop thread. Calls after it
        raise ``ClientClosedError``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer.detach()
        if os.getpid() != self._pid:
            return  # a fork: the loop and its thread are the parent's, nothing to stop here
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._wind_down(), self._loop).result()
        self._stop_loop()

    async def _wind_down(self) -> None:
        # Every call was submitted before _closed was set, so its task has registered
        # (the loop runs what was submitted in order).
        calls = list(self._calls)
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await self._async.aclose()

    def _stop_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    def open(self, env: str, **kw: Any) -> TrajectoryInfo:
        return self._run(self._async.open(env, **kw))

    def get(self, trajectory: str) -> TrajectoryInfo:
        return self._run(self._async.get(trajectory))

    def close(self, trajectory: str) -> TrajectoryInfo:
        return self._run(self._async.close(trajectory))

    def trajectory(self, env: str, **kw: Any) -> Trajectory:
        """``with client.trajectory(env) as t``: opened on entry, closed on exit."""
        return Trajectory(self, env, kw)

    def files(self, trajectory: str) -> Files:
        """The files of a trajectory's environment (``t.files`` of an open ``t``)."""
        return Files(self, self._async.files(trajectory))

    def exec(self, trajectory: str, argv: Sequence[str] | None = None, **kw: Any) -> ActionResult:
        """Run a command (``AsyncClient.exec``): its result names the idempotency key it
        ran under, the one to retry an ``outcome_unknown`` under."""
        return self._run(self._async.exec(trajectory, argv, **kw))

    def batch(self, items: Sequence[dict[str, Any]]) -> list[ActionResult]:
        return self._run(self._async.batch(items))

    def cancel(self, action: str) -> bool:
        return self._run(self._async.cancel(action))

    def cancel_all(self, trajectory: str) -> int:
        return self._run(self._async.cancel_all(trajectory))

    def lease(self, api: str, units: int = 1, hold_s: float = 300.0, **kw: Any) -> ActionResult:
        return self._run(self._async.lease(api, units, hold_s, **kw))

    def call(self, api: str, path: str = "/", **kw: Any) -> ActionResult:
        return self._run(self._async.call(api, path, **kw))

    def release(self, lease: str) -> ActionResult:
        return self._run(self._async.release(lease))

    def score(self, service: str, inputs: Sequence[Any], **kw: Any) -> ActionResult:
        """One call of a RewardService (see ``AsyncClient.score``)."""
        return self._run(self._async.score(service, inputs, **kw))


class Trajectory:
    """The asyncio ``AsyncTrajectory``, driven on its client's loop thread."""

    def __init__(self, client: Client, env: str, open_kw: dict[str, Any]) -> None:
        self.client = client
        self._async = AsyncTrajectory(client._async, env, open_kw)

    @property
    def info(self) -> TrajectoryInfo | None:
        return self._async.info

    @property
    def id(self) -> str:
        return self._async.id

    def __enter__(self) -> Self:
        self.client._run(self._async.__aenter__())
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.client._run(self._async.__aexit__(typ, exc, tb))
        except ClientClosedError as e:  # the body's error is the one to see, as in async
            if exc is None:
                raise
            exc.add_note(f"then closing the trajectory failed: {e}")

    def exec(self, argv: Sequence[str] | None = None, **kw: Any) -> ActionResult:
        return self.client._run(self._async.exec(argv, **kw))

    def bash(self, code: str, name: str = "main", **kw: Any) -> ActionResult:
        return self.client._run(self._async.bash(code, name, **kw))

    def python(self, code: str, name: str = "main", **kw: Any) -> ActionResult:
        return self.client._run(self._async.python(code, name, **kw))

    @property
    def files(self) -> Files:
        """The environment's files: ``t.files.write("/work/a.py", "print(1)")``."""
        return self.client.files(self.id)


class Files:
    """``AsyncFiles`` driven on its client's loop thread."""

    def __init__(self, client: Client, files: AsyncFiles) -> None:
        self._run, self._async = client._run, files

    def read(self, path: str) -> bytes:
        return self._run(self._async.read(path))

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self._run(self._async.read_text(path, encoding))

    def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> FileWritten:
        return self._run(self._async.write(path, data, mode=mode))

    def list(self, path: str = ".") -> list[FileEntry]:
        return self._run(self._async.list(path))

    def stat(self, path: str) -> FileEntry:
        return self._run(self._async.stat(path))

    def exists(self, path: str) -> bool:
        return self._run(self._async.exists(path))

    def make_dir(self, path: str) -> bool:
        return self._run(self._async.make_dir(path))

    def remove(self, path: str) -> None:
        self._run(self._async.remove(path))

    def rename(self, path: str, to: str) -> None:
        self._run(self._async.rename(path, to))

    def write_tar(self, path: str, data: bytes) -> Unpacked:
        return self._run(self._async.write_tar(path, data))

    def read_tar(self, path: str) -> bytes:
        return self._run(self._async.read_tar(path))

    def upload_dir(
        self, local: str | os.PathLike[str], path: str, *, compress: bool = True
    ) -> Unpacked:
        return self._run(self._async.upload_dir(local, path, compress=compress))

    def download_dir(self, path: str, local: str | os.PathLike[str]) -> Path:
        return self._run(self._async.download_dir(path, local))


def _let_go(
    loop: asyncio.AbstractEventLoop,
    thread: threading.Thread,
    client: AsyncClient,
    pid: int,
) -> None:
    """A ``Client`` no one holds any more (or the interpreter's exit): close its client
    and stop its loop thread. Nothing waits on it: no call can, with the Client gone."""
    if os.getpid() != pid or not thread.is_alive() or loop.is_closed():
        return
    closing = asyncio.run_coroutine_threadsafe(client.aclose(), loop)
    if threading.current_thread() is thread:  # (collected on its own loop: cannot wait)
        closing.add_done_callback(lambda _: loop.stop())
        return
    with contextlib.suppress(Exception):
        closing.result(LET_GO_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(LET_GO_S)
    if not thread.is_alive():
        loop.close()

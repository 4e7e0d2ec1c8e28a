"""A thread pool whose threads nothing waits for when the process exits.

``concurrent.futures.ThreadPoolExecutor`` joins every thread it ever started at
interpreter exit, whatever ``shutdown(wait=False)`` said: a RewardService call that cannot
be stopped (its ``score`` sleeping or looping for minutes) then kept a stopped agent's
process alive after it had said it stopped and released its state directory's lock. The
GPU role's calls are abandoned at the stop instead, as a running call cannot be stopped:
these threads are daemons, and the process exits with them still running.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")
_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class _Running:
    """Work running now in any pool's threads: at exit, one still inside a library (a
    torch op) when the interpreter tears down under it aborts the process (``busy``)."""

    count = 0
    lock = threading.Lock()

    @classmethod
    def add(cls, step: int) -> None:
        with cls.lock:
            cls.count += step


def busy() -> bool:
    """Whether some work given to these threads still runs (an abandoned call)."""
    return _Running.count > 0


class DaemonThreads(Executor):
    """At most ``max_workers`` daemon threads, started only when none is idle (as the
    standard pool does); ``shutdown`` lets them end once the work already given has."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._max = max_workers
        self._prefix = thread_name_prefix
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._prefix} threads: cannot take work after shutdown")
            future: Future[T] = Future()
            self._queue.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                thread = threading.Thread(
                    target=self._work,
                    name=f"{self._prefix}_{len(self._threads)}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)
            return future

    def _work(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:  # shut down: the work queued before it has been taken
                return
            future, fn, args, kwargs = work
            del work
            if future.set_running_or_notify_cancel():
                _Running.add(1)
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # (as the standard pool: the future carries it)
                    future.set_exception(e)
                else:
                    future.set_result(result)
                finally:
                    _Running.add(-1)
            del future, fn, args, kwargs  # no reference kept while idle
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
            if cancel_futures:
                while True:
                    try:
                        work = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if work is not None:
                        work[0].cancel()
            for _ in threads:
                self._queue.put(None)
        if wait:
            for thread in threads:
                thread.join()


__all__ = ["DaemonThreads", "busy"]

"""The client's calls that the caller leaves or ends: a client-side timeout, a cancelled
task, a sync ``Client`` shut down while other threads wait; cancels by keys of any
characters; the unread output of a live exec; oversized chunked bodies. Real service,
real agent (process runtime), the real client, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tangram.api.wire import EnvSpec
from tangram.client import (
    ActionTimeoutError,
    AsyncClient,
    Client,
    ClientClosedError,
    ServiceUnreachableError,
    StreamClosedError,
    TangramError,
)
from tangram.client import stream as client_stream
from tangram.service.config import EnvConfig, PoolConfig
from tangram.service.engine import Engine

from .proxies import Proxy
from .service_harness import action_started, on_processes, until

pytestmark = [pytest.mark.xdist_group("service")]

CONFIG = PoolConfig(
    envs={"shell": EnvConfig(spec=EnvSpec(name="shell", image="unused", memory_gb=0.1))}
)
GUARD_S = 60  # a call not ended by then hangs: a failure, not a wait
FOREVER = ["sleep", "600"]  # a command that ends only when cancelled


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[str, str, Engine]]:
    with on_processes(CONFIG, tmp_path) as served:
        yield served


async def _started_soon(engine: Engine, key: str) -> None:
    async with asyncio.timeout(GUARD_S):
        while not action_started(engine, key):
            await asyncio.sleep(0.01)


async def _first_result(url: str, token: str, trajectory: str, key: str) -> Any:
    """What the key's action ended with: a retry under its key answers with that (and
    would wait for it, had it not ended)."""
    async with AsyncClient(url, token, stream=False) as again:
        r = await asyncio.wait_for(again.exec(trajectory, FOREVER, idempotency_key=key), GUARD_S)
    return r.status.value


@pytest.mark.parametrize("stream", [False, True], ids=["http", "stream"])
def test_a_client_timeout_cancels_the_action_and_names_its_key(
    running: tuple[str, str, Engine], stream: bool
) -> None:
    url, token, _ = running

    async def main() -> None:
        # (the open and close on a client of their own: the timeout is the exec's alone,
        # long enough that the exec reaches the service first on a loaded machine too)
        async with AsyncClient(url, token) as plain:
            t = await plain.open("shell")
            async with AsyncClient(url, token, timeout_s=5.0, stream=stream) as c:
                with pytest.raises(ActionTimeoutError) as caught:
                    slow = c.exec(t.id, FOREVER, idempotency_key="slow/1")
                    await asyncio.wait_for(slow, GUARD_S)
            assert isinstance(caught.value, TimeoutError)  # what callers caught before
            assert "'slow/1'" in str(caught.value) and "timeout_s=5" in str(caught.value)
            assert caught.value.cancelled == 1
            assert await _first_result(url, token, t.id, "slow/1") == "cancelled"
            await plain.close(t.id)

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True], ids=["http", "stream"])
def test_a_cancelled_task_cancels_its_action(
    running: tuple[str, str, Engine], stream: bool
) -> None:
    url, token, engine = running

    async def main() -> None:
        async with AsyncClient(url, token, stream=stream) as c:
            t = await c.open("shell")
            task = asyncio.create_task(c.exec(t.id, FOREVER, idempotency_key="left"))
            await _started_soon(engine, "left")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await _first_result(url, token, t.id, "left") == "cancelled"
            await c.close(t.id)

    asyncio.run(main())


def test_cancel_by_keys_holding_slash_question_mark_and_hash(
    running: tuple[str, str, Engine],
) -> None:
    url, token, engine = running

    async def main() -> None:
        async with AsyncClient(url, token) as c:
            t = await c.open("shell")
            for key in ("rollout-3/step-7", "a?b", "k#1", "50%"):
                task = asyncio.create_task(c.exec(t.id, FOREVER, idempotency_key=key))
                await _started_soon(engine, key)
                assert await c.cancel(f"key:{key}") is True
                r = await asyncio.wait_for(task, GUARD_S)
                assert r.status.value == "cancelled", key
            await c.close(t.id)

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True], ids=["http", "stream"])
def test_shutdown_ends_the_calls_other_threads_wait_for(
    running: tuple[str, str, Engine], stream: bool
) -> None:
    url, token, engine = running
    c = Client(url, token, stream=stream)
    t = c.open("shell")
    got: list[BaseException] = []

    def wait() -> None:
        try:
            c.exec(t.id, FOREVER, idempotency_key="waiting")
        except BaseException as e:
            got.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    until(lambda: action_started(engine, "waiting"), "the action starts")
    c.shutdown()
    waiter.join(GUARD_S)
    assert not waiter.is_alive(), "a call still waits after shutdown()"
    assert len(got) == 1 and isinstance(got[0], ClientClosedError), got
    with pytest.raises(ClientClosedError):
        c.get(t.id)
    c.shutdown()  # a second time: nothing
    # The action nobody waits for any more was cancelled by its key.
    assert asyncio.run(_first_result(url, token, t.id, "waiting")) == "cancelled"
    with Client(url, token) as other:
        other.close(t.id)


def test_a_trajectory_left_after_shutdown_keeps_the_body_s_error(
    running: tuple[str, str, Engine],
) -> None:
    url, token, _ = running
    c = Client(url, token)
    # The body's error, not the close's (the client is shut down by then).
    with pytest.raises(ValueError, match="the body's") as caught, c.trajectory("shell") as t:
        c.shutdown()
        raise ValueError("the body's")
    assert any("closing the trajectory failed" in n for n in caught.value.__notes__)
    with Client(url, token) as other:
        other.close(t.id)


def test_unread_live_output_is_bounded_and_marked(
    running: tuple[str, str, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, token, _ = running
    bound = 4096
    monkeypatch.setattr(client_stream, "LIVE_BUFFER_CHARS", bound)
    total = 4 << 20

    async def main() -> None:
        async with AsyncClient(url, token) as c, c.trajectory("shell") as t:
            argv = ["sh", "-c", f"head -c {total} /dev/zero | tr '\\0' a"]
            live = await t.exec_live(argv, output_cap=0)
            r = await asyncio.wait_for(live.result(), GUARD_S)  # output() not read
            assert r.status.value == "ok"
            pieces = [text async for _, text in live.output()]
            marks = [p for p in pieces if p.startswith("\n[tangram: ")]
            kept = [p for p in pieces if p not in marks]
            assert marks and all("characters of output dropped" in m for m in marks)
            assert 0 < live.dropped < total
            # Kept: what fit under the bound, past it at most the one piece that crossed it.
            assert sum(map(len, kept)) <= bound + max(map(len, kept))
            assert "".join(kept) == "a" * (total - live.dropped)  # nothing lost unsaid

    asyncio.run(main())


def test_a_chunked_body_over_the_limit_is_413(running: tuple[str, str, Engine]) -> None:
    url, token, _ = running
    body = b'{"env": "shell", "labels": {"x": "' + b"y" * (2 << 20) + b'"}}'

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts as it reads
        for at in range(0, len(body), 65536):
            yield body[at : at + 65536]

    auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, headers=auth, timeout=GUARD_S) as http:
        r = http.post("/v1/trajectories", content=chunks())
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "too_large" and str(1 << 20) in error["message"]


def test_a_batch_given_up_on_has_every_action_cancelled(
    running: tuple[str, str, Engine],
) -> None:
    url, token, _ = running

    async def main() -> None:
        async with AsyncClient(url, token) as plain:
            t = await plain.open("shell")
            items = [{"trajectory": t.id, "exec": {"argv": FOREVER}} for _ in range(3)]
            async with AsyncClient(url, token, timeout_s=5.0) as c:
                with pytest.raises(ActionTimeoutError) as caught:
                    await asyncio.wait_for(c.batch(items), GUARD_S)
            assert caught.value.cancelled == 3 and len(caught.value.idempotency_keys) == 3
            await plain.close(t.id)

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True], ids=["http", "stream"])
def test_non_ascii_input_counts_its_utf8_bytes_against_the_bound(
    running: tuple[str, str, Engine], stream: bool
) -> None:
    """800 kB of Cyrillic (400,000 characters) is under the pool's 1 MiB: it was sent as
    \\u escapes, 2.4 MB, and refused 413."""
    url, token, _ = running
    text = "ж" * 400_000
    with Client(url, token, stream=stream) as c, c.trajectory("shell") as t:
        r = t.exec(["wc", "-c"], stdin=text)
        assert (r.exit_code, r.stdout.strip()) == (0, str(len(text.encode()))), r


def test_what_cannot_be_sent_as_asked_is_refused_before_anything_is_sent(
    running: tuple[str, str, Engine],
) -> None:
    """A path of a lone surrogate (``os.fsdecode`` of a name that is not UTF-8) lost that
    character from the query and named another file; a string argv ran its first letter."""
    url, token, engine = running
    with Client(url, token) as c, c.trajectory("shell") as t:
        t.files.write("notes.txt", "precious")
        actions = len(engine.state.actions)
        for call in (
            lambda: t.files.write("\udcffnotes.txt", "overwritten"),
            lambda: t.files.remove("\udcffnotes.txt"),
            lambda: t.files.read("\udcffnotes.txt"),
        ):
            with pytest.raises(ValueError, match=r"path: .*lone surrogate"):
                call()
        assert t.files.read_text("notes.txt") == "precious"
        with pytest.raises(ValueError, match=r"argv.1: .*lone surrogate"):
            t.exec(["echo", "\udcff"])
        with pytest.raises(TypeError, match="argv: a list of arguments, not a string"):
            t.exec("echo hello")
        with pytest.raises(ValueError, match="elastic: give"):
            t.exec(["true"], elastic=(1,))
        assert len(engine.state.actions) == actions  # none reached the scheduler


def test_a_mode_the_files_api_cannot_set_is_refused_naming_it(
    running: tuple[str, str, Engine],
) -> None:
    """Masked to 0o777, 0o4755 was written as 0o755 and 0o10000 as 0, without a word."""
    url, token, _ = running
    bad = ((0o10000, "0o10000"), (0o4755, "0o4755"), (-1, "-1"))
    with Client(url, token) as c, c.trajectory("shell") as t:
        for mode, named in bad:
            with pytest.raises(ValueError, match=f"mode: {named} is not permission bits"):
                t.files.write("s3.sh", "x", mode=mode)
        assert not t.files.exists("s3.sh")  # nothing was sent
        t.files.write("s3.sh", "x", mode=0o755)
        assert t.files.stat("s3.sh").mode == 0o755

    async def go() -> None:
        async with AsyncClient(url, token) as c, c.trajectory("shell") as t:
            with pytest.raises(ValueError, match="mode: 0o4755 is not permission bits"):
                await t.files.write("s3.sh", "x", mode=0o4755)
            with pytest.raises(TypeError, match="mode: an int"):
                await t.files.write("s3.sh", "x", mode="755")  # type: ignore[arg-type]
            assert not await t.files.exists("s3.sh")

    asyncio.run(go())


def test_a_401_for_no_token_says_where_the_client_looked(
    running: tuple[str, str, Engine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for a client run as another user than `make run`: a bare 401 did not tell a
    token file that is not there from a wrong token."""
    url, _, _ = running
    monkeypatch.delenv("TANGRAM_TOKEN", raising=False)
    gone = tmp_path / "nonexistent"
    monkeypatch.setenv("TANGRAM_TOKEN_FILE", str(gone))
    said = rf"401 unauthorized: .*TANGRAM_TOKEN is unset, and {gone} \(TANGRAM_TOKEN_FILE\) "
    with Client(url) as c, pytest.raises(TangramError, match=f"{said}does not exist") as caught:
        c.get("t-1")
    assert caught.value.status == 401
    agents_only = tmp_path / "tokens"
    agents_only.write_text("agent-token-of-this-test system:agent\n")
    monkeypatch.setenv("TANGRAM_TOKEN_FILE", str(agents_only))

    async def go() -> None:
        async with AsyncClient(url) as c:  # an exec: the stream's refusal, then HTTP's 401
            with pytest.raises(TangramError, match=f"{agents_only} .*has no client token"):
                await c.exec("t-1", ["true"])

    asyncio.run(go())
    # A token was sent: the 401 as it was.
    with Client(url, "a-wrong-token") as c, pytest.raises(TangramError, match=r"required$"):
        c.get("t-1")
    # TANGRAM_TOKEN set but empty is unset: the file is read (it was not, and its token
    # said missing from a file that held it).
    _, token, _ = running
    (tmp_path / "client").write_text(f"{token} local\n")
    monkeypatch.setenv("TANGRAM_TOKEN", "")
    monkeypatch.setenv("TANGRAM_TOKEN_FILE", str(tmp_path / "client"))
    with Client(url) as c, pytest.raises(TangramError) as unknown:
        c.get("t-1")
    assert unknown.value.status == 404, unknown.value


@pytest.mark.parametrize("stream", [False, True], ids=["http", "stream"])
def test_a_key_reused_in_a_trajectory_opened_again_under_its_id_runs_there(
    running: tuple[str, str, Engine], stream: bool
) -> None:
    """Keys of the form trajectory id + step: in the trajectory opened again under the
    closed one's id (the next RL step's rollout of the same task), the same key replayed
    the closed environment's result, and the command never ran."""
    url, token, _ = running
    with Client(url, token, stream=stream) as c:
        for content in ("first environment", "second environment"):
            with c.trajectory("shell", id="task-7") as t:
                t.files.write("state.txt", content)
                r = t.exec(["cat", "state.txt"], idempotency_key="task-7-step-1")
                assert r.stdout == content, r
                again = t.exec(["cat", "state.txt"], idempotency_key="task-7-step-1")
                assert again.id == r.id  # (within one, a retry is still the same action)


@pytest.mark.parametrize("stream", [False, True], ids=["http", "stream"])
def test_aclose_ends_the_calls_waiting_and_cancels_their_actions(
    running: tuple[str, str, Engine], stream: bool
) -> None:
    """They raised a bare RuntimeError ("Session is closed"), and the command ran on."""
    url, token, engine = running

    async def scenario() -> None:
        c = AsyncClient(url, token, stream=stream)
        t = await c.open("shell")
        waiting = asyncio.ensure_future(c.exec(t.id, FOREVER, idempotency_key="closed-on"))
        await _started_soon(engine, "closed-on")
        await c.aclose()
        with pytest.raises(ClientClosedError):
            await asyncio.wait_for(waiting, GUARD_S)
        with pytest.raises(ClientClosedError):
            await c.get(t.id)
        assert await _first_result(url, token, t.id, "closed-on") == "cancelled"
        async with AsyncClient(url, token) as other:
            await other.close(t.id)

    asyncio.run(scenario())


def test_aclose_ends_every_call_under_way(running: tuple[str, str, Engine]) -> None:
    """Not only the keyed ones: a file's read stuck mid-answer hung for good after
    aclose, and a live exec's result raised the stream's own error."""
    url, token, _ = running

    async def scenario() -> None:
        async with AsyncClient(url, token) as direct, Proxy(url) as proxy:
            t = await direct.open("shell")
            await direct.files(t.id).write("big.bin", b"x" * (4 << 20))
            proxy.stall_after = 1 << 20  # of each connection's answers: the rest held back
            c = AsyncClient(proxy.url, token)
            live = await c.exec_live(t.id, FOREVER)
            reading = asyncio.ensure_future(c.files(t.id).read("big.bin"))
            await asyncio.wait_for(proxy.stalled.wait(), GUARD_S)  # mid-answer
            await asyncio.wait_for(c.aclose(), GUARD_S)
            with pytest.raises(ClientClosedError):
                await asyncio.wait_for(reading, GUARD_S)
            with pytest.raises(ClientClosedError):
                await asyncio.wait_for(live.result(), GUARD_S)
            await direct.close(t.id)

    asyncio.run(scenario())


def test_a_download_cut_off_is_tried_again_then_named(running: tuple[str, str, Engine]) -> None:
    """It raised aiohttp's own ClientPayloadError at once: no retry, and none of the
    client's errors (a worker catching TangramError and ServiceUnreachableError died)."""
    url, token, _ = running
    content = bytes(range(256)) * (16 << 10)  # 4 MiB

    async def scenario() -> None:
        async with AsyncClient(url, token) as direct, Proxy(url) as proxy:
            t = await direct.open("shell")
            await direct.files(t.id).write("big.bin", content)
            proxy.cut_after, proxy.cuts = 1 << 20, 1  # the first answer's first MiB only
            async with AsyncClient(proxy.url, token, retries=2, backoff_s=0.01) as c:
                assert await asyncio.wait_for(c.files(t.id).read("big.bin"), GUARD_S) == content
                assert proxy.cut == 1
                proxy.cuts = 3  # every try's
                with pytest.raises(ServiceUnreachableError) as caught:
                    await asyncio.wait_for(c.files(t.id).read("big.bin"), GUARD_S)
            assert proxy.cut == 4
            assert caught.value.cut_off and "every answer was cut off" in str(caught.value)
            await direct.close(t.id)

    asyncio.run(scenario())


def test_a_live_exec_cut_off_by_a_dropped_stream_says_so(
    running: tuple[str, str, Engine],
) -> None:
    """Its output() ended as a finished command's does, and result() raised an error of
    aiohttp's family that tangram.client did not export."""
    url, token, _ = running

    async def scenario() -> None:
        async with AsyncClient(url, token) as direct, Proxy(url) as proxy:
            t = await direct.open("shell")
            async with AsyncClient(proxy.url, token) as c:
                live = await c.exec_live(t.id, ["sh", "-c", "echo started; exec sleep 600"])
                pieces, seen = live.output(), ""
                while "started" not in seen:
                    seen += (await asyncio.wait_for(anext(pieces), GUARD_S))[1]
                proxy.abort()  # the stream's connection drops
                with pytest.raises(StreamClosedError):
                    async with asyncio.timeout(GUARD_S):
                        async for _ in pieces:
                            pass
                with pytest.raises(StreamClosedError) as caught:
                    await asyncio.wait_for(live.result(), GUARD_S)
            assert isinstance(caught.value, ConnectionError)
            await direct.close(t.id)

    asyncio.run(scenario())


def test_a_client_dropped_without_shutdown_lets_its_thread_and_connections_go(
    running: tuple[str, str, Engine],
) -> None:
    """200 Clients dropped unclosed left 200 threads and streams for the process's life."""
    import gc

    url, token, _ = running
    c = Client(url, token)
    with c.trajectory("shell") as t:
        assert t.exec(["true"]).exit_code == 0  # (its stream open)
    thread, inner = c._thread, c._async
    del c, t
    gc.collect()
    thread.join(GUARD_S)
    assert not thread.is_alive()
    assert inner._closed


def test_an_async_client_used_on_a_second_loop_says_so_and_sends_nothing(
    running: tuple[str, str, Engine],
) -> None:
    """Reused after its first asyncio.run ended: "Event loop is closed" from inside aiohttp,
    with the open possibly sent (a trajectory left open, its id never told)."""
    url, token, engine = running
    c = AsyncClient(url, token)

    async def first() -> None:
        await c.close((await c.open("shell")).id)

    async def second() -> None:
        with pytest.raises(RuntimeError, match="made for another event loop"):
            await c.open("shell")

    asyncio.run(first())
    asyncio.run(second())
    assert not engine.trajectories  # the second open never went out

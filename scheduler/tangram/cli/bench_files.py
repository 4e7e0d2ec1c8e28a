"""``tangram bench files``: the files API's throughput against ``docker cp``, and the time
to the first byte of a streamed exec's output.

The real service on 127.0.0.1 with a Docker node agent in a process of its own (as in a
cluster); one trajectory of a busybox environment. For each size, a file of random bytes
is uploaded and downloaded through the client (HTTP → scheduler → agent link → the
container's exec server), and the same bytes copied in and out of the same container with
``docker cp``, alternately (each first every other time), both to and from a file, so
both see the same machine at the same time. The figure is the median MB/s of each, and
their ratio; ``docker cp`` of an empty file says how much of its time is its fixed cost
(the CLI's start and the Docker API's round trips), which a 1 MB copy is mostly.

A directory of many small files (a repository's shape) goes in and out as one tar
(``upload_dir``/``download_dir``), against ``docker cp`` of the directory (a tar too) and
against writing its files one request each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tangram.api.wire import EnvSpec
from tangram.cli.bench_agent import bench_pool, nearest_rank
from tangram.cli.files import InputError
from tangram.cli.progress import bar
from tangram.client.aio import AsyncClient
from tangram.client.files import AsyncFiles
from tangram.node_agent.env_template import TRAJECTORY_PREFIX
from tangram.service.config import EnvConfig, PoolConfig

SIZES_MB = (1, 10, 50, 200)
TREE = (20, 25, 4096)  # directories, files in each, bytes a file: 500 files, 2 MB
USER = "bench"
POOL = "bench-files"  # its containers are labelled with it


def _docker_cp(src: str, dst: str) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(["docker", "cp", "-q", src, dst], capture_output=True, check=False)
    if done.returncode != 0:
        raise InputError(f"bench files: docker cp {src} {dst}: {done.stderr.decode()[-300:]}")
    return time.perf_counter() - t0


async def _measure(args: argparse.Namespace, work: Path, image: str) -> dict[str, Any]:
    spec = EnvSpec(name="box", image=image, memory_gb=0.5, workdir="/work", pool=POOL)
    config = PoolConfig(name="files", envs={"box": EnvConfig(spec=spec)}, max_file_bytes=1 << 40)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(SIZES_MB)
    rows: list[dict[str, Any]] = []
    pool = bench_pool(config, work, (USER,), runtime="docker", what="files")
    async with pool as (running, token), AsyncClient(running.url, token[USER]) as client:
        tid = (await client.open("box")).id
        files = AsyncFiles(client, tid)
        container = TRAJECTORY_PREFIX + tid
        with bar("bench files", len(sizes) * args.repeats) as update:
            for size_mb in sizes:
                rows.append(await _one_size(files, container, size_mb, args.repeats, work))
                update(len(rows) * args.repeats, len(sizes) * args.repeats)
        tree = await _one_tree(files, container, args.repeats, work)
        empty = work / "empty"
        empty.touch()
        fixed = [_docker_cp(str(empty), f"{container}:/work/empty") for _ in range(args.repeats)]
        live = await _first_bytes(client, tid, args.repeats * 4)
        await client.close(tid)
    return {
        "sizes": rows,
        "tree": tree,
        "docker_cp_empty_file_s": statistics.median(fixed),  # the CLI and API round trips
        "live": live,
        "transport": "HTTP on 127.0.0.1, agent in its own process",
    }


async def _one_size(
    files: AsyncFiles, container: str, size_mb: int, repeats: int, work: Path
) -> dict[str, Any]:
    """A file of ``size_mb`` through the files API and through ``docker cp``, each way,
    ``repeats`` times, to and from a file on this host."""
    data = os.urandom(size_mb << 20)
    local, out = work / "in.bin", work / "out.bin"
    local.write_bytes(data)
    up, down, cp_in, cp_out = [], [], [], []

    async def api(_: int) -> None:
        t0 = time.perf_counter()
        await files.write("f.bin", data)
        up.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out.write_bytes(await files.read("f.bin"))  # to a file, as docker cp
        down.append(time.perf_counter() - t0)
        if out.read_bytes() != data:
            raise InputError("bench files: the download differs from the upload")
        out.unlink()

    def cp(_: int) -> None:
        cp_in.append(_docker_cp(str(local), f"{container}:/work/cp.bin"))
        cp_out.append(_docker_cp(f"{container}:/work/cp.bin", str(out)))
        out.unlink()

    await _alternately(repeats, api, cp)
    local.unlink()

    def rate(times: list[float]) -> float:
        return size_mb / statistics.median(times)

    return {
        "size_mb": size_mb,
        "upload_mb_s": rate(up),
        "download_mb_s": rate(down),
        "docker_cp_in_mb_s": rate(cp_in),
        "docker_cp_out_mb_s": rate(cp_out),
        "upload_vs_docker_cp": rate(up) / rate(cp_in),
        "download_vs_docker_cp": rate(down) / rate(cp_out),
        "repeats": repeats,
    }


async def _one_tree(files: AsyncFiles, container: str, repeats: int, work: Path) -> dict[str, Any]:
    """The ``TREE`` directory in and out: as one tar through the files API, with
    ``docker cp``, and (in only) as one write per file; median seconds of each."""
    dirs, per_dir, size = TREE
    src = work / "tree"
    for d in range(dirs):
        (src / f"pkg{d}").mkdir(parents=True)
        for f in range(per_dir):
            (src / f"pkg{d}" / f"mod{f}.py").write_bytes(os.urandom(size))
    names = sorted(str(p.relative_to(src)) for p in src.rglob("*.py"))
    up, down, cp_in, cp_out, one_by_one = [], [], [], [], []

    async def api(i: int) -> None:
        t0 = time.perf_counter()
        await files.upload_dir(src, f"tree{i}", compress=False)  # as docker cp: no gzip
        up.append(time.perf_counter() - t0)
        back = work / f"back{i}"
        t0 = time.perf_counter()
        await files.download_dir(f"tree{i}", back)
        down.append(time.perf_counter() - t0)
        if sorted(str(p.relative_to(back)) for p in back.rglob("*.py")) != names:
            raise InputError("bench files: the downloaded tree differs from the uploaded one")
        shutil.rmtree(back)
        t0 = time.perf_counter()
        for d in range(dirs):
            await files.make_dir(f"files{i}/pkg{d}")
        for name in names:
            await files.write(f"files{i}/{name}", (src / name).read_bytes())
        one_by_one.append(time.perf_counter() - t0)

    def cp(i: int) -> None:
        # A fresh path each time: docker cp into an existing directory nests the copy in it.
        cp_in.append(_docker_cp(str(src), f"{container}:/work/cp-tree{i}"))
        back = work / f"cp-back{i}"
        cp_out.append(_docker_cp(f"{container}:/work/cp-tree{i}", str(back)))
        shutil.rmtree(back)

    await _alternately(repeats, api, cp)
    shutil.rmtree(src)
    med = statistics.median
    return {
        "files": len(names),
        "mb": len(names) * size / (1 << 20),
        "upload_dir_s": med(up),
        "docker_cp_in_s": med(cp_in),
        "one_write_per_file_s": med(one_by_one),
        "download_dir_s": med(down),
        "docker_cp_out_s": med(cp_out),
        "upload_vs_docker_cp": med(cp_in) / med(up),
        "upload_vs_one_write_per_file": med(one_by_one) / med(up),
        "download_vs_docker_cp": med(cp_out) / med(down),
        "repeats": repeats,
    }


async def _alternately(
    repeats: int, ours: Callable[[int], Awaitable[None]], theirs: Callable[[int], None]
) -> None:
    """Run both ``repeats`` times, each going first every other time, so that both see the
    machine in the same state."""
    for i in range(repeats):
        if i % 2:
            theirs(i)
        await ours(i)
        if not i % 2:
            theirs(i)


async def _first_bytes(client: AsyncClient, tid: str, runs: int) -> dict[str, Any]:
    """Time to the first byte of a streamed exec's output (``echo first; sleep 60``,
    interrupted once it has come), against a plain ``echo`` (what the first byte cannot
    beat: one exec's whole round trip) and the same exec not streamed (its answer comes
    after the sleep: here ``sleep 1``, a few times)."""
    first, echo, whole = [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        action = await client.exec_live(tid, ["sh", "-c", "echo first; sleep 60"])
        async for _ in action.output():
            first.append(time.perf_counter() - t0)
            break
        await action.signal("SIGINT")
        await action.result()
        t0 = time.perf_counter()
        await client.exec(tid, ["echo", "first"])
        echo.append(time.perf_counter() - t0)
    for _ in range(3):
        t0 = time.perf_counter()
        await client.exec(tid, ["sh", "-c", "echo first; sleep 1"])
        whole.append(time.perf_counter() - t0)
    return {
        "runs": runs,
        "first_byte_p50_ms": 1e3 * nearest_rank(first, 0.5),
        "first_byte_max_ms": 1e3 * max(first),
        "echo_p50_ms": 1e3 * nearest_rank(echo, 0.5),
        "not_streamed_p50_ms": 1e3 * nearest_rank(whole, 0.5),
    }


def run_files_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tangram.cli.bench_exec import BENCH_IMAGE
    from tangram.node_agent.docker_runtime import local_busybox

    if shutil.which("docker") is None:
        raise InputError("bench files needs the docker command (docker cp is the baseline)")
    image = args.image or local_busybox(BENCH_IMAGE)
    if image is None:
        raise InputError("--image: none given, and busybox-static is not installed to make one")
    with tempfile.TemporaryDirectory(prefix="tangram-bench-files-") as tmp:
        return asyncio.run(_measure(args, Path(tmp) / "pool", image))

"""What ``tangram bench coding-seeds`` and ``gpu-seeds`` share: their flags, replays run in
parallel processes with progress, and the report's header, command line and Markdown
table written beside the JSON."""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, TypeVar

from tangram.cli.files import InputError, Interrupted, check_writable
from tangram.cli.progress import note

J = TypeVar("J", bound=Hashable)
R = TypeVar("R")


def numbers(text: str | None, default: tuple[int, ...], name: str, least: int) -> tuple[int, ...]:
    """``--batches`` / ``--seeds``: comma-separated whole numbers >= ``least``, repeats
    dropped."""
    if not text:
        return default
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"--{name}: comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < least:
        raise InputError(f"--{name}: give at least one, each >= {least}")
    return tuple(dict.fromkeys(values))  # a repeat would be replayed, and counted, twice


def check_out(args: argparse.Namespace) -> None:
    """``--out`` names the JSON report; its table goes beside it. Both are checked before
    any replay, so that a bad path does not throw the replays away."""
    if not args.out:
        return
    if Path(args.out).suffix == ".md":
        raise InputError("--out: the JSON report's path; its table is written beside it as .md")
    check_writable(args.out, "--out")
    check_writable(Path(args.out).with_suffix(".md"), "--out")


def run_jobs(
    replay: Callable[[J], R],
    jobs: Sequence[J],
    workers: int | None,
    describe: Callable[[J, R], str],
) -> dict[J, R]:
    """Each job's result, replayed in ``workers`` processes (default: one per CPU), with a
    progress line per job as it ends."""
    got: dict[J, R] = {}
    pool = ProcessPoolExecutor(workers or os.cpu_count() or 1)
    wait = True
    try:
        futures = {pool.submit(replay, job): job for job in jobs}
        for done, future in enumerate(as_completed(futures), 1):
            job = futures[future]
            got[job] = future.result()
            note(f"[{done}/{len(jobs)}] {describe(job, got[job])}")
    except KeyboardInterrupt:  # Ctrl-C: each finished replay's figures were noted above
        wait = False  # (the workers had their Ctrl-C too)
        raise Interrupted(
            f"interrupted after {len(got)} of {len(jobs)} replays"
            + (" (each one's figures are above)" if got else "")
        ) from None
    finally:
        pool.shutdown(wait=wait, cancel_futures=True)
    return got


def header(
    args: argparse.Namespace, name: str, started: float, **flags: tuple[Any, Any]
) -> dict[str, Any]:
    """The report's command line (with each of ``flags``, ``(value, default)``, that is not
    its default), machine, Python and wall time since ``started``."""
    parts = [f"tangram bench {name}"]
    for flag in ("batches", "seeds"):
        if getattr(args, flag):
            parts.append(f"--{flag} {getattr(args, flag)}")
    parts += [f"--{f.replace('_', '-')} {v}" for f, (v, default) in flags.items() if v != default]
    if args.out:
        parts.append(f"--out {args.out}")
    return {
        "command": " ".join(parts),
        "machine": f"{platform.machine()} {platform.node()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def write_table(args: argparse.Namespace, text: str) -> None:
    """The report's Markdown beside its JSON (``--out``), when there is one. Written after
    the report: failing here only warns, the report stands (it was printed, and written)."""
    if not args.out:
        return
    table = Path(args.out).with_suffix(".md")
    try:
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text(text, encoding="utf-8")
    except OSError as e:
        note(f"tangram: warning: --out: cannot write {table}: {e.strerror} ({args.out} was)")


def header_line(report: dict[str, Any]) -> str:
    """The first line of a report's table: its command, machine, Python and wall time."""
    return (
        f"`{report['command']}` on {report['machine']}, Python {report['python']}, "
        f"{report['wall_s']:.0f} s."
    )

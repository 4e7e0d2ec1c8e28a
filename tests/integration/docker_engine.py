"""A real Docker Engine for the tests (DESIGN.md §6), and a locally built test image.

Uses a running engine when there is one; otherwise, as root with Debian's docker.io
installed, starts ``dockerd --bridge=none --iptables=false`` (no private-range bridge)
and stops it afterwards. No image is pulled: the busybox image is ``docker import``ed
from a root file system holding busybox-static and its applet links.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BUSYBOX_IMAGE = "tangram-test/busybox:1"


def _client() -> Any:
    import docker

    client = docker.from_env()
    client.ping()
    return client


def _wait(seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        try:
            return _client()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def engine() -> Iterator[Any]:
    """Yield a client of a reachable engine, starting dockerd if needed; None if impossible."""
    try:
        yield _client()
        return
    except Exception:
        pass
    dockerd = shutil.which("dockerd")
    if os.geteuid() != 0 or dockerd is None:
        yield None
        return
    log = open(Path(tempfile.gettempdir()) / "tangram-dockerd.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [dockerd, "--bridge=none", "--iptables=false"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield _wait(60)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def busybox_image(client: Any) -> str | None:
    """Import the busybox test image once; None when busybox-static is not installed."""
    import docker.errors

    try:
        client.images.get(BUSYBOX_IMAGE)
        return BUSYBOX_IMAGE
    except docker.errors.ImageNotFound:
        pass
    busybox = Path("/bin/busybox")
    if not busybox.exists() or not _looks_static(busybox):
        return None
    applets = subprocess.run(
        [str(busybox), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "tmp", "work", "proc", "sys", "dev", "etc"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        tar.add(busybox, arcname="bin/busybox")
        for name in applets:
            if name == "busybox":
                continue
            link = tarfile.TarInfo(f"bin/{name}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
    repository, tag = BUSYBOX_IMAGE.rsplit(":", 1)
    client.api.import_image_from_data(buf.getvalue(), repository=repository, tag=tag)
    return BUSYBOX_IMAGE


def _looks_static(path: Path) -> bool:
    """No ELF interpreter segment (PT_INTERP) means a static binary."""
    data = path.read_bytes()[:4096]
    return b"/lib64/ld-linux" not in data and b"/lib/ld-linux" not in data

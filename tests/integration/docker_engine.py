"""A real Docker Engine for the tests (docs/architecture.md), and a locally built test image.

Uses a running engine when there is one; otherwise, as root with Debian's docker.io
installed, starts ``dockerd --bridge=none --iptables=false`` (no private-range bridge)
and stops it afterwards. No image is pulled: the busybox image is ``docker import``ed
from a root file system holding busybox-static and its applet links; the coding image
from a Debian root file system made by ``debootstrap --variant=minbase`` with python3,
pytest and pytest-xdist, cached as a tarball so that a lost image is re-imported
without running debootstrap again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tangram.node_agent.docker_runtime import import_busybox

BUSYBOX_IMAGE = "tangram-test/busybox:1"

CODING_IMAGE = "tangram-test/coding:1"
CODING_SUITE = "bookworm"
CODING_PACKAGES = ("python3", "python3-pytest", "python3-pytest-xdist")
# Names the cached root file system: change it whenever the recipe below changes.
CODING_VERSION = f"{CODING_SUITE}-minbase-pytest-xdist-agent-1"
AGENT_UID = AGENT_GID = 1000
DEFAULT_MIRROR = "http://deb.debian.org/debian"
IMAGE_CHANGES = [
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
]


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
    """The busybox test image, imported once; None when busybox-static is not installed."""
    return import_busybox(client, BUSYBOX_IMAGE)


# ---- the coding-environment image -------------------------------------------------


def cache_dir() -> Path:
    return Path(os.environ.get("TANGRAM_CACHE_DIR", "/var/cache/tangram"))


def coding_image(client: Any) -> str | None:
    """Import the coding image once, from the cached root file system, built if missing.

    None when neither the image nor its cached tarball exists and it cannot be built
    here: building needs root and debootstrap (and Debian's mirror, once).
    """
    import docker.errors

    try:
        client.images.get(CODING_IMAGE)
        return CODING_IMAGE
    except docker.errors.ImageNotFound:
        pass
    tarball = cache_dir() / f"coding-{CODING_VERSION}.tar"
    if not tarball.exists():
        if os.geteuid() != 0 or shutil.which("debootstrap") is None:
            return None
        _build_coding_tarball(tarball)
    t0 = time.monotonic()
    _progress(f"importing {tarball} ({tarball.stat().st_size / 2**20:.0f} MiB) as {CODING_IMAGE}")
    repository, tag = CODING_IMAGE.rsplit(":", 1)
    answer = client.api.import_image_from_file(
        str(tarball), repository=repository, tag=tag, changes=IMAGE_CHANGES
    )
    try:
        client.images.get(CODING_IMAGE)
    except docker.errors.ImageNotFound:
        raise RuntimeError(f"docker import of {tarball} failed: {answer}") from None
    _progress(f"imported {CODING_IMAGE} in {time.monotonic() - t0:.1f}s")
    return CODING_IMAGE


def _progress(message: str) -> None:
    print(f"[coding image] {message}", file=sys.stderr, flush=True)


def debian_mirror() -> str:
    """The Debian archive this machine's apt uses for the suite; Debian's CDN otherwise."""
    sources = Path("/etc/apt")
    files = [sources / "sources.list"]
    files += sorted((sources / "sources.list.d").glob("*.list"))
    files += sorted((sources / "sources.list.d").glob("*.sources"))
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for uri, suites in _apt_entries(text):
            if CODING_SUITE in suites and uri.startswith(("http://", "https://")):
                return uri.rstrip("/")
    return DEFAULT_MIRROR


def _apt_entries(text: str) -> Iterator[tuple[str, list[str]]]:
    """(URI, suites) of the binary entries of a one-line or a deb822 sources file."""
    for line in text.splitlines():  # one-line style: deb [options] uri suite components
        words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
        if len(words) >= 3 and words[0] == "deb":
            yield words[1], [words[2]]
    for stanza in re.split(r"\n\s*\n", text):  # deb822 style
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if ":" in line and not line.startswith(("#", " ", "\t")):
                key, value = line.split(":", 1)
                fields[key.strip().lower()] = value.strip()
        if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes") != "no":
            for uri in fields.get("uris", "").split():
                yield uri, fields.get("suites", "").split()


def _build_coding_tarball(tarball: Path) -> None:
    """debootstrap, add the user, clean, tar; the cache file appears whole or not at all.

    Builds in a directory beside the cache file and renames the finished tarball into
    place; a lock keeps two test sessions from building at once, and whoever holds it
    removes what an interrupted build left.
    """
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with open(tarball.parent / ".coding-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if tarball.exists():  # another session built it while we waited
            return
        for stale in tarball.parent.glob(".coding-build-*"):
            _progress(f"removing {stale}, left by an interrupted build")
            _remove_tree(stale)
        build = Path(tempfile.mkdtemp(prefix=".coding-build-", dir=tarball.parent))
        try:
            rootfs = build / "rootfs"
            _debootstrap(rootfs, build / "debootstrap.log")
            _add_agent_user(rootfs)
            _clean(rootfs)
            _progress("packing the root file system")
            partial = build / "rootfs.tar"
            subprocess.run(
                [
                    "tar",
                    "--numeric-owner",
                    "--xattrs",
                    "--one-file-system",
                    "--exclude=./dev/*",
                    "--exclude=./proc/*",
                    "--exclude=./sys/*",
                    "-C",
                    str(rootfs),
                    "-cf",
                    str(partial),
                    ".",
                ],
                check=True,
            )
            with partial.open("rb") as f:
                os.fsync(f.fileno())
            os.replace(partial, tarball)
            _progress(f"cached {tarball} ({tarball.stat().st_size / 2**20:.0f} MiB)")
        finally:
            _remove_tree(build)


def _debootstrap(rootfs: Path, log: Path) -> None:
    mirror = debian_mirror()
    argv = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(CODING_PACKAGES)}",
        CODING_SUITE,
        str(rootfs),
        mirror,
    ]
    _progress(f"building the root file system (takes minutes): {' '.join(argv)}")
    t0 = time.monotonic()
    per_package = re.compile(r"^I: (Retrieving|Validating|Extracting|Unpacking|Configuring) ")
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if not per_package.match(line):  # the phases, not one line a package
                _progress(f"debootstrap: {line.rstrip()}")
        code = proc.wait()
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-20:]
        raise RuntimeError(f"debootstrap failed with exit code {code}:\n" + "\n".join(tail))
    _progress(f"debootstrap finished in {time.monotonic() - t0:.0f}s")


def _add_agent_user(rootfs: Path) -> None:
    """The unprivileged ``agent`` user (uid and gid 1000), owning its home and /work."""
    etc = rootfs / "etc"
    entries = {
        "passwd": f"agent:x:{AGENT_UID}:{AGENT_GID}:Tangram agent:/home/agent:/bin/bash",
        "group": f"agent:x:{AGENT_GID}:",
        "shadow": "agent:!::0:99999:7:::",
        "gshadow": "agent:!::",
    }
    for name, entry in entries.items():
        path = etc / name
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        if any(line.split(":", 1)[0] == "agent" for line in text.splitlines()):
            continue
        path.write_text(text + ("" if text.endswith("\n") or not text else "\n") + entry + "\n")
    home = rootfs / "home" / "agent"
    shutil.copytree(etc / "skel", home, dirs_exist_ok=True)
    work = rootfs / "work"
    work.mkdir(exist_ok=True)
    for path in (home, *home.rglob("*"), work):
        os.lchown(path, AGENT_UID, AGENT_GID)
    home.chmod(0o755)
    work.chmod(0o755)


def _clean(rootfs: Path) -> None:
    """Drop apt's caches and lists, documentation, translations and logs: none is needed."""
    for pattern in (
        "var/cache/apt/archives/*.deb",
        "var/cache/apt/*.bin",
        "var/lib/apt/lists/*_*",
        "usr/share/doc/*",
        "usr/share/man/*",
        "usr/share/info/*",
        "usr/share/locale/*/LC_MESSAGES",
        "var/log/*.log",
        "var/log/apt/*",
    ):
        for path in rootfs.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def _mountpoints() -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return [
            re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            for line in f
        ]


def _remove_tree(path: Path) -> None:
    """rm -rf that first unmounts what an interrupted debootstrap left mounted inside.

    Never follows a mount into the host: what cannot be unmounted is left in place.
    """
    root = os.path.realpath(path)
    inside = [m for m in _mountpoints() if m == root or m.startswith(root + "/")]
    for mount in sorted(inside, key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], check=False, capture_output=True)
    if any(m == root or m.startswith(root + "/") for m in _mountpoints()):
        _progress(f"{path}: something is still mounted inside; left in place")
        return
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)

"""The pod runtime reads an image's /etc/passwd from the host through /proc/<pid>/root:
only a regular file of the image's own, never through a link (an absolute one resolves
on the host: the agent's own files), nor a FIFO or a device (it used to hang reading
them); without one it falls back as when the image has no passwd."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tangram.api.wire import EnvSpec
from tangram.node_agent.env_template import DEFAULT_USER, User
from tangram.node_agent.fast_path import Reachable
from tangram.node_agent.pod_runtime import PodRuntime

SPEC = EnvSpec(name="swe", image="swe:1", workdir="/work")  # no user: the image's is chosen
IMAGE_PASSWD = "root:x:0:0::/root:/bin/sh\nagent:x:1000:1000::/home/agent:/bin/sh\n"
HOST_PASSWD = "root:x:0:0::/root:/bin/sh\nhostuser:x:4242:4242::/home:/bin/sh\n"


def _pod(proc: Path) -> tuple[PodRuntime, Reachable, Path]:
    """A runtime that sees one sandbox, pid 42, running as root: its root directory."""
    rt = object.__new__(PodRuntime)  # only the facts and /proc: no cluster, no cgroups
    rt.proc_root = proc
    rt._facts = {}
    (proc / "42" / "root" / "etc").mkdir(parents=True)
    (proc / "42" / "status").write_text("Name:\texecd\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n")
    return rt, Reachable("c", proc / "sock", 42, "g", "/work", proc_root=proc), proc / "42" / "root"


def _user(rt: PodRuntime) -> User | None:
    return rt._facts[PodRuntime._facts_key(SPEC)][0]


def test_the_images_own_passwd_is_read(tmp_path: Path) -> None:
    rt, reach, root = _pod(tmp_path / "proc")
    (root / "etc" / "passwd").write_text(IMAGE_PASSWD)
    rt._learn_facts(SPEC, reach)
    assert _user(rt) == User(1000, 1000)


@pytest.mark.parametrize("linked", ["etc/passwd", "etc"])
def test_a_link_out_of_the_image_is_not_followed(tmp_path: Path, linked: str) -> None:
    rt, reach, root = _pod(tmp_path / "proc")
    host_etc = tmp_path / "host-etc"
    host_etc.mkdir()
    (host_etc / "passwd").write_text(HOST_PASSWD)  # the agent's own, as a link would reach
    if linked == "etc":
        (root / "etc").rmdir()
        (root / "etc").symlink_to(host_etc)
    else:
        (root / "etc" / "passwd").symlink_to(host_etc / "passwd")
    rt._learn_facts(SPEC, reach)
    assert _user(rt) == DEFAULT_USER  # as with no passwd: not hostuser


def test_a_fifo_or_a_device_is_not_read(tmp_path: Path) -> None:
    rt, reach, root = _pod(tmp_path / "proc")
    fifo = root / "etc" / "passwd"
    os.mkfifo(fifo)
    looked = threading.Thread(target=rt._learn_facts, args=(SPEC, reach), daemon=True)
    looked.start()
    looked.join(60)  # (a guard: reading a FIFO nobody writes waits for ever)
    if looked.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # let it go: EOF
        looked.join()
        pytest.fail("the FIFO was opened and read")
    assert _user(rt) == DEFAULT_USER
    fifo.unlink()
    (root / "etc" / "passwd").symlink_to("/dev/zero")  # endless, were it followed
    rt._facts.clear()
    rt._learn_facts(SPEC, reach)
    assert _user(rt) == DEFAULT_USER


def test_a_passwd_over_the_cap_is_read_up_to_it_in_whole_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tangram.node_agent import pod_runtime

    rt, reach, root = _pod(tmp_path / "proc")
    monkeypatch.setattr(pod_runtime, "PASSWD_MAX_BYTES", len(IMAGE_PASSWD) - 5)
    (root / "etc" / "passwd").write_text(IMAGE_PASSWD + "later:x:1001:1001::/:/bin/sh\n")
    rt._learn_facts(SPEC, reach)
    # The cut line (agent's) is dropped, not read as uid 1000 with a cut shell.
    assert _user(rt) == DEFAULT_USER

"""What a trajectory environment is built from, and the container spec it turns into (pure).

An ``EnvSpec`` (the node side of the TrajectoryEnv custom resource) is what an
environment is built from; ``spec`` turns one into the keyword arguments of Docker's
create call: hardened by default (no network, every capability dropped,
no-new-privileges, a pids limit, memory reserved and limited with no swap, the idle core
set with a minimal quota) and, when the exec server is available, with it as PID 1
listening in a tiny tmpfs of the container's own (``RUN_TMPFS``), which the agent reaches
through the container's PID 1 (``/proc/<pid>/root``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tangram.api.wire import EnvSpec
from tangram.node_agent.cgroups import PERIOD_US, format_cpulist
from tangram.node_agent.exec_server import IN_CONTAINER_BIN, IN_CONTAINER_RUN, SOCKET_NAME
from tangram.node_agent.execution import IDLE_QUOTA_CORES, ExecError

LABEL = "dev.tangram"  # label prefix that marks and identifies our containers
TRAJECTORY_PREFIX = "tangram-t-"  # container name of an open trajectory's environment
WARM_PREFIX = "tangram-w-"  # container name of a ready, unassigned environment
MAKING_PREFIX = "tangram-m-"  # container name until its setup is done (never adopted)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# The exec server's socket directory: the socket needs one inode and no data. A tmpfs of
# the container's own, so that what a command writes there is bounded by the kernel (and
# charged to the container's memory), and nothing of the host's is shared with it: a
# directory of the agent's state bind-mounted there held whatever a command wrote,
# uncounted by the disk limit.
RUN_TMPFS = "size=64k,nr_inodes=16,mode=0700"


def digest(template: EnvSpec) -> str:
    """Identifies what a container was built from (everything but the warm pool size):
    warm containers of an older version of the environment are never handed out."""
    body = template.model_dump(exclude={"warm"})
    if body.get("disk_gb") is None:  # added later: digests of envs without one stay as they were
        body.pop("disk_gb", None)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class User:
    uid: int
    gid: int

    @property
    def spec(self) -> str:
        return f"{self.uid}:{self.gid}"


def run_tmpfs(user: User | None) -> str:
    """The socket directory's tmpfs options: owned by the user the exec server runs as
    (None: root), who makes the socket. Owned, not world-writable, because runc before
    1.1.8 gives a tmpfs the mode of the directory it is mounted on, which a restarted
    container has (runc made it 0755, root's, at the first start): a mode option is lost
    then, an owner is not (opencontainers/runc#3911)."""
    return RUN_TMPFS + (f",uid={user.uid},gid={user.gid}" if user else "")


def check_trajectory_id(trajectory: str) -> None:
    if not _NAME.fullmatch(trajectory):
        raise ExecError(
            f"trajectory: {trajectory!r} must be 1-128 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )


# The sandbox's user when neither the environment nor the image names one, and the image
# has no regular user: unprivileged, and in no image's /etc/passwd that we know of (as
# distroless's "nonroot"). Root is never a default: an environment asks for it by name.
DEFAULT_USER = User(65532, 65532)


@dataclass(frozen=True, slots=True)
class Workdir:
    """The image's own working directory: its owner and permission bits."""

    uid: int
    gid: int
    mode: int

    def writable_by(self, user: User | None) -> bool:
        if user is None:  # root
            return True
        if user.uid == self.uid:
            return bool(self.mode & 0o200)
        if user.gid == self.gid:
            return bool(self.mode & 0o020)
        return bool(self.mode & 0o002)


def pick_user(passwd: str, requested: str | None, image: str | None = None) -> User | None:
    """The user commands run as; None means root, and only when ``requested`` (the
    environment's ``security.user``: a name, ``uid`` or ``uid:gid``) names root.

    Else: ``requested``; else the image's own USER (``image``), unless that is root; else
    the image's first regular user (uid 1000-59999 in its ``/etc/passwd``); else
    :data:`DEFAULT_USER`."""
    entries: dict[str, User] = {}
    for line in passwd.splitlines():
        parts = line.split(":")
        if len(parts) >= 4 and parts[2].isdigit() and parts[3].isdigit():
            entries[parts[0]] = User(int(parts[2]), int(parts[3]))
    if requested:
        return _named(entries, requested, "security.user")
    chosen = _named(entries, image, "the image's USER") if image else None
    if chosen is not None:
        return chosen
    regular = sorted((u for u in entries.values() if 1000 <= u.uid < 60000), key=lambda u: u.uid)
    return regular[0] if regular else DEFAULT_USER


def _named(entries: Mapping[str, User], name_or_id: str, what: str) -> User | None:
    name, _, group = name_or_id.partition(":")
    if name.isdigit():
        uid = int(name)
        by_uid = {u.uid: u for u in entries.values()}
        gid = int(group) if group.isdigit() else by_uid.get(uid, User(uid, uid)).gid
        return None if uid == 0 else User(uid, gid)
    if name not in entries:
        raise ExecError(  # (not worth a retry: the open fails, naming the setting)
            f"{what}: {name!r} is not in the image's /etc/passwd",
            reason="SandboxStartFailed",
        )
    user = entries[name]
    if group.isdigit():
        user = User(user.uid, int(group))
    return None if user.uid == 0 else user


def spec(
    template: EnvSpec,
    *,
    name: str,
    labels: Mapping[str, str],
    idle_cores: Sequence[int],
    user: User | None,
    execd: str | None,
) -> dict[str, Any]:
    """Keyword arguments for ``client.containers.create``; ``execd``: the exec server
    binary's host path (None: the container runs without it)."""
    mem = int(template.memory_gb * 1024**3)
    kwargs: dict[str, Any] = {
        "name": name,
        "labels": {
            f"{LABEL}/env": template.name,
            f"{LABEL}/pool": template.pool,
            f"{LABEL}/template": digest(template),
            **labels,
        },
        "network_mode": template.network,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "pids_limit": template.pids_limit,
        "mem_limit": mem,
        "mem_reservation": mem,
        "memswap_limit": mem,  # no swap: the limit is the trajectory's memory
        "cpuset_cpus": format_cpulist(idle_cores),
        "cpu_period": PERIOD_US,
        "cpu_quota": int(IDLE_QUOTA_CORES * PERIOD_US),
        "working_dir": template.workdir,
        "environment": dict(template.env),
        "read_only": template.read_only_root,
        "init": False,
    }
    tmpfs: dict[str, str] = {}
    if template.read_only_root:
        owner = f",uid={user.uid},gid={user.gid}" if user else ""
        tmpfs |= {template.workdir: f"rw,exec{owner}", "/tmp": "rw,mode=1777"}
    if execd:
        # The exec server is PID 1: it reaps orphans and starts commands on request.
        kwargs["entrypoint"] = [IN_CONTAINER_BIN, f"{IN_CONTAINER_RUN}/{SOCKET_NAME}"]
        kwargs["command"] = []
        kwargs["volumes"] = {execd: {"bind": IN_CONTAINER_BIN, "mode": "ro"}}
        tmpfs[IN_CONTAINER_RUN] = run_tmpfs(user)
    else:
        kwargs["entrypoint"] = ["sleep"]  # PID 1 only keeps the environment alive
        kwargs["command"] = ["2147483647"]
    if tmpfs:
        kwargs["tmpfs"] = tmpfs
    if user:
        kwargs["user"] = user.spec
    return kwargs

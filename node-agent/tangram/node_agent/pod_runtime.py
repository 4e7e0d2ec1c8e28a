"""Trajectory environments as Kubernetes pods on the agent's own node (any CRI runtime).

The node agent (a DaemonSet pod with the host's PID namespace and cgroup tree) creates
each sandbox pod bound to its node, finds the sandbox container's exec server among the
host's processes, and from then on works as the Docker runtime's fast path does:
allocate-on-execution by writing the container's cgroup, commands started by the exec
server, reached at ``/proc/<pid>/root/.tangram/run/exec.sock`` and checked to be that
process's socket. It needs no Docker socket and no container runtime API.

A warm pod is claimed by relabelling it (one API call); a cold open creates a pod and
waits for it. Pods outlive the agent: a restarted agent lists the pods of its pool on its
node and takes them back with their files; nothing deletes them but a close, the pool's
deletion (ownerReference) or an agent that finds them dead. A pod is labelled warm or
open only once it is set up: one still ``preparing`` when its agent died is deleted by the
next, which cannot know how far its setup got.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from tangram.api.wire import EnvSpec, Problem
from tangram.node_agent.cgroups import CgroupError
from tangram.node_agent.env_template import User, Workdir, digest, pick_user
from tangram.node_agent.exec_server import socket_in
from tangram.node_agent.execution import (
    IDLE_QUOTA_CORES,
    ExecError,
    ExecResult,
    check_setup,
)
from tangram.node_agent.fast_path import Command, Reachable, cgroup_of, start_time
from tangram.node_agent.kubelet_state import cpu_manager_policy
from tangram.node_agent.pod_template import LABEL, SANDBOX, label_value, sandbox_pod
from tangram.node_agent.warm_pool import SandboxRuntime

__all__ = ["DEFAULT_EXECD_PATH", "PodApi", "PodRuntime"]

log = logging.getLogger("tangram.agent")

DEFAULT_EXECD_PATH = "/usr/local/libexec/tangram/tangram-execd"  # in the agent's image
STATE = f"{LABEL}/state"  # preparing | warm | open
# Made, but its workdir, pids limit or setup commands not done yet: neither claimable nor
# any trajectory's (agents from before this state create pods warm or open at once).
PREPARING = "preparing"
AGENT = f"{LABEL}/agent"  # which agent's sandbox (label_value of PodRuntime.agent)
PASSWD_MAX_BYTES = 1 << 20  # of an image's /etc/passwd, read from the host


# An open pod's trajectory: its id in full as an annotation, and as a label (for
# ``kubectl get -l``) when the id is a label value, else a digest of it.
TRAJECTORY = f"{LABEL}/trajectory"


# When the pod was last opened (ISO 8601, UTC): of two pods open for one trajectory after
# a lost answer, the one opened last is the one whose open succeeded.
OPENED_AT = f"{LABEL}/opened-at"


def _opened(trajectory: str) -> tuple[dict[str, str], dict[str, str]]:
    """The labels and annotations of a pod open for ``trajectory``."""
    return {STATE: "open", TRAJECTORY: label_value(trajectory)}, {TRAJECTORY: trajectory}


def _opening(trajectory: str) -> tuple[dict[str, str], dict[str, str]]:
    """``_opened`` with the time of this open."""
    labels, notes = _opened(trajectory)
    return labels, {**notes, OPENED_AT: datetime.now(UTC).isoformat(timespec="microseconds")}


def _open_since(obj: Mapping[str, Any]) -> tuple[datetime, str]:
    """When a pod was opened (its creation for pods of agents that did not say), then its
    name: what orders the open pods of one trajectory."""
    meta = obj.get("metadata") or {}
    said = (meta.get("annotations") or {}).get(OPENED_AT) or meta.get("creationTimestamp")
    try:
        when = datetime.fromisoformat(str(said))
    except ValueError:
        when = datetime.min
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when, str(meta.get("name", ""))


class PodApi(Protocol):
    """The few Kubernetes calls the runtime makes (``kube_pods.kube_pod_api`` is the real
    one; a runtime is handed it, so this module imports no Kubernetes client)."""

    def create(self, manifest: dict[str, Any]) -> None: ...
    def get(self, name: str) -> dict[str, Any] | None: ...
    def events(self, name: str) -> list[dict[str, Any]]: ...
    def list(self, selector: str) -> list[dict[str, Any]]: ...
    def label(
        self, name: str, labels: Mapping[str, str], annotations: Mapping[str, str]
    ) -> None: ...
    def delete(self, name: str) -> None: ...


@dataclass(slots=True)
class Pod:
    """A sandbox pod the agent holds, open or warm."""

    name: str
    template: str  # digest() of the EnvSpec it was built from
    env_name: str
    reach: Reachable


class PodRuntime(SandboxRuntime[Pod]):
    def __init__(
        self,
        idle_cores: Sequence[int],
        *,
        api: PodApi,
        node: str,
        namespace: str,
        execd_image: str,
        execd_path: str = DEFAULT_EXECD_PATH,
        owner: Mapping[str, Any] | None = None,
        agent: str = "",
        cgroup_root: Path = Path("/sys/fs/cgroup"),
        proc_root: Path = Path("/proc"),
        start_timeout_s: float = 120.0,
    ) -> None:
        super().__init__(idle_cores, cgroup_root, proc_root)
        self.api = api
        self.node = node
        self.namespace = namespace
        self.execd_image = execd_image
        self.execd_path = execd_path
        self.owner = dict(owner) if owner else None
        # Names this agent's sandboxes apart from other agents' on the same node (other
        # pools, a pool's CPU and GPU agents): adoption and deletion touch only these.
        self.agent = agent or f"{namespace}.{node}"
        self._undeleted: set[str] = set()  # pods whose deletion failed: tried again
        self.start_timeout_s = start_timeout_s
        self.settle_s = 5.0  # how long an ended pod's status may lag behind (gone)
        self._dying: dict[str, float] = {}  # pod -> when its exec server was found ended
        self.problem: Problem | None = None  # why this node cannot run actions
        if cpu_manager_policy(proc_root) == "static":
            self.problem = Problem(
                reason="CPUManagerStatic",
                message=f"node {node}: the kubelet's CPU manager policy is static, which resets "
                "container cpusets every reconcile period and would undo each action's "
                "cores; run the pool on nodes whose kubelet has cpuManagerPolicy: none "
                "(spec.cpu.nodeSelector)",
            )

    # ---- lifecycle: the warm pool's hooks (warm_pool.SandboxRuntime) --------------
    def _make(self, template: EnvSpec, trajectory: str | None) -> Pod:
        return self._create(template, trajectory)

    def _claim(self, pod: Pod, trajectory: str) -> bool:
        if not pod.reach.alive():  # evicted or killed while warm: the next one, or a cold open
            return False
        try:
            self.api.label(pod.name, *_opening(trajectory))
        except ExecError as e:
            if e.retryable:  # the API server, not the pod: keep it for the next open
                raise
            return False
        return True

    def _discard(self, pod: Pod) -> None:
        self._delete(pod.name)

    def _key(self, pod: Pod) -> str:
        return pod.reach.key

    def _env_name(self, pod: Pod) -> str:
        return pod.env_name

    def adopt(self) -> list[str]:
        """Take back the sandbox pods of this pool on this node (after a restart).

        Running pods whose exec server answers are taken as they are, open or warm; pods
        that ended or never started are deleted (their environment is gone, and the caller
        reports their trajectories lost), and so are pods still preparing (how far their
        setup got is unknown; their open never answered) and all but the last opened of
        a trajectory's pods (the others' opens failed: a lost answer, then a retry).
        """
        # Every agent of a pool has the same id (the DaemonSet gives each node the same
        # state dir): the node label keeps it to this node's pods, and a pod bound to
        # another node is never touched (its own agent holds it).
        selector = (
            f"{LABEL}/sandbox=true,{AGENT}={label_value(self.agent)},"
            f"{LABEL}/node={label_value(self.node)}"
        )
        taken: list[tuple[str | None, dict[str, Any]]] = []  # warm ones first, then open ones
        opened: dict[str, list[dict[str, Any]]] = {}
        for obj in self.api.list(selector):
            meta = obj["metadata"]
            if (obj.get("spec") or {}).get("nodeName", self.node) != self.node:
                continue
            labels = meta.get("labels") or {}
            # (a pod opened by an agent from before the annotation has the id as its label)
            notes = meta.get("annotations") or {}
            trajectory = notes.get(TRAJECTORY) or labels.get(TRAJECTORY)
            if labels.get(STATE) == "open" and trajectory:
                opened.setdefault(trajectory, []).append(obj)
            elif labels.get(STATE) == "warm":
                taken.append((None, obj))
            else:  # preparing (or a state this agent does not know)
                self._delete(meta["name"])
        for trajectory, objs in opened.items():
            *stale, last = sorted(objs, key=_open_since)
            for obj in stale:
                log.warning("sandbox pod %s/%s: trajectory %s is open in %s, opened later",
                            self.namespace, obj["metadata"]["name"], trajectory,
                            last["metadata"]["name"])  # fmt: skip
                self._delete(obj["metadata"]["name"])
            taken.append((trajectory, last))
        for trajectory, obj in taken:
            meta = obj["metadata"]
            name, labels = meta["name"], meta.get("labels") or {}
            try:
                reach = self._reach(obj, wait_s=2.0)
            except ExecError:
                self._delete(name)
                continue
            try:  # a previous agent may have died mid-action: back to the idle set
                self._limit(reach, IDLE_QUOTA_CORES)
            except ExecError as e:
                log.warning("sandbox pod %s/%s not taken back: %s", self.namespace, name, e)
                self._delete(name)
                continue
            pod = Pod(name, labels.get(f"{LABEL}/template", ""), labels.get(f"{LABEL}/env", ""),
                      reach)  # fmt: skip
            if trajectory:
                self.envs[trajectory] = pod
            else:
                self.warm_pool.setdefault(pod.template, []).append(pod)
        return sorted(self.envs)

    def _survey(self) -> Callable[[Pod], str | None]:
        """The check is local (is each exec server still the process it was?); only an
        ended one costs a read of its pod (``_ending``)."""
        return lambda pod: None if pod.reach.alive() else "exec server ended"

    def _ending(self, pod: Pod, seen: str) -> tuple[str, str] | None:
        """(reason, message) of an ended sandbox, from the kubelet's reason. A pod whose
        status does not show the end yet, or shows only its container's exit (the
        kubelet writes an eviction a moment later), is looked at again, for up to
        ``settle_s``; None till then."""
        name = pod.name
        try:
            obj = self.api.get(name)
        except ExecError:
            obj = {}  # the API server is unreachable: say what we know
        first = self._dying.setdefault(name, time.monotonic())
        where = f"{self.namespace}/{name}"
        why = ending(obj, where)
        if why is None or why[0] == "SandboxExited":
            # An eviction may show only as the container's exit (a sandbox that ends at
            # SIGTERM even makes the pod Succeeded, with no reason): the kubelet's Event
            # says it was one (no Events when the API server is unreachable).
            why = evicted_by_event(self.api.events(name), where) or why
            unsettled = time.monotonic() - first < self.settle_s  # its status may still lag
            if (why is None or why[0] == "SandboxExited") and unsettled:
                return None
        self._dying.pop(name, None)
        return why or ("SandboxExited", f"pod {self.namespace}/{name}: its processes ended")

    def _create(self, template: EnvSpec, trajectory: str | None) -> Pod:
        facts = self._facts.get(self._facts_key(template))  # None: its image not seen yet
        user, workdir = facts or (None, None)
        # The random part is never cut: a long pool name is (pod names hold 63 here).
        name = f"tangram-{template.pool[:40].rstrip('-.')}-{secrets.token_hex(5)}"
        manifest = sandbox_pod(
            template,
            name=name,
            namespace=self.namespace,
            node=self.node,
            execd_image=self.execd_image,
            execd_path=self.execd_path,
            # Warm or open only once prepared: an agent that dies before leaves it preparing.
            extra_labels={STATE: PREPARING, AGENT: label_value(self.agent)},
            annotations={TRAJECTORY: trajectory} if trajectory else None,
            owner=self.owner,
            user=user,
            own_workdir=facts is not None and workdir is None,
        )
        try:
            self.api.create(manifest)  # refused: the API server's reason (RuntimeClass, quota)
        except ExecError as e:
            if e.retryable:  # a lost answer (a timeout, a 5xx) may hide a stored pod
                self._delete(name)
            raise
        try:
            reach = self._reach(self._running(name), wait_s=10.0)
            # Made before its image's facts were known (the first pod of the image, or one
            # made while another thread learnt them): redo it unless it is as the next
            # ones will be.
            try:
                relearn = facts is None and self._learn_facts(template, reach)
            except OSError as e:  # /proc/<pid> gone: it ended before its facts were read
                raise self._ended_at_start(name, e) from None
            if relearn:
                self._delete(name)
                return self._create(template, trajectory)
            self._prepare(reach, template)
            self.api.label(name, *(_opening(trajectory) if trajectory else ({STATE: "warm"}, {})))
        except BaseException:
            self._delete(name)
            raise
        return Pod(name, digest(template), template.name, reach)

    @staticmethod
    def _facts_key(template: EnvSpec) -> str:
        # A read-only root's pods mount an emptyDir at the workdir: what they show of it
        # is not the image's, so an env of the same image with a writable root learns its own.
        ro = "|ro" if template.read_only_root else ""
        return f"{template.image}|{template.user}|{template.workdir}{ro}"

    def _learn_facts(self, template: EnvSpec, reach: Reachable) -> bool:
        """Read the image's users and workdir from a pod made without them (no runAsUser:
        it runs as the image's USER), unless they are known by now; True when that pod is
        not as the next ones will be (it runs as another user, or lacks the workdir)."""
        key = self._facts_key(template)
        running_as = self._ids(reach.pid)
        if key not in self._facts:  # (another open or warm-up may have learnt them since)
            root = self.proc_root / str(reach.pid) / "root"
            try:
                passwd = _read_file_in(root, "/etc/passwd", PASSWD_MAX_BYTES)
            except OSError:  # none, or not a regular file of the image's own
                passwd = ""
            configured = f"{running_as[0]}:{running_as[1]}" if running_as[0] else None
            user = pick_user(passwd, template.user, configured)
            self._facts[key] = (user, _workdir(root, template.workdir))
        user, workdir = self._facts[key]
        wanted = (user.uid, user.gid) if user else (0, 0)
        return wanted != running_as or workdir is None

    def _ids(self, pid: int) -> tuple[int, int]:
        """The (uid, gid) process ``pid`` runs as."""
        ids = {}
        for line in (self.proc_root / str(pid) / "status").read_text().splitlines():
            if line.startswith(("Uid:", "Gid:")):
                ids[line[:3]] = int(line.split()[1])
        if len(ids) != 2:
            raise ExecError(f"pid {pid}: no Uid or Gid in its status")
        return ids["Uid"], ids["Gid"]

    def _prepare(self, reach: Reachable, template: EnvSpec) -> None:
        """The workdir the sandbox's user's, idle limits and the pids limit; then the
        environment's setup commands, on the idle cores without the idle quota (bounded
        work at open time)."""
        user, workdir = self._facts.get(self._facts_key(template), (None, None))
        if user and workdir and not workdir.writable_by(user) and not template.read_only_root:
            self._own_workdir(reach, template.workdir, user)
        self._pids_limit(reach.cgroup, template.pids_limit)
        if template.setup:  # each on the idle cores, without the idle quota (group_enter)
            for argv in template.setup:
                timeout = self.setup_timeout_s
                cmd = Command(list(argv), self.idle_cores, timeout, dict(template.env), 1 << 16)
                res = asyncio.run(self.fast.exec(reach, cmd))
                check_setup(argv, res.exit_code, res.timed_out, timeout, res.stderr)
        self._limit(reach, IDLE_QUOTA_CORES)

    def _own_workdir(self, reach: Reachable, path: str, user: User) -> None:
        """Make the image's workdir (the directory only: what the image put in it stays as
        it is) the sandbox user's, from the host: the sandbox has no capability to."""
        try:
            fd = _open_dir_in(self.proc_root / str(reach.pid) / "root", path)
            try:
                os.fchown(fd, user.uid, user.gid)
            finally:
                os.close(fd)
        except OSError as e:
            raise ExecError(
                f"workdir {path}: cannot make it the sandbox user's ({user.spec}): {e.strerror} "
                "(set the TrajectoryEnv's security.user to a user who may write it)",
                reason="SandboxStartFailed",
            ) from None

    def _limit(self, reach: Reachable, quota_cores: float | None) -> None:
        try:
            self.cgroups.limit(reach.cgroup, self.idle_cores, quota_cores)
        except CgroupError as e:
            raise ExecError(
                f"{e} (the agent needs the host's cgroup tree mounted writable)",
                reason="CgroupsUnwritable",
            ) from None

    def _pids_limit(self, group: str, limit: int) -> None:
        # Kubernetes has no per-pod pids field (only the node-wide podPidsLimit).
        path = (
            self.cgroup_root / "pids" / group / "pids.max"
            if self.cgroups.version == 1
            else self.cgroup_root / group / "pids.max"
        )
        try:
            path.write_text(str(limit))
        except FileNotFoundError:  # no pids controller: the node's limit holds
            pass
        except OSError as e:  # (the CRD bounds it to what the kernel takes)
            log.warning("%s: pidsLimit %d not applied: %s", group, limit, e.strerror)

    def _running(self, name: str) -> dict[str, Any]:
        """The pod once its sandbox container runs; a clear error, with the kubelet's
        reason, as soon as it is plain that it never will."""
        start = time.monotonic()
        deadline = start + self.start_timeout_s
        events_at = start + 2.0  # a pod still not running by now: read its Events too
        delay = 0.02
        where = f"pod {self.namespace}/{name}"
        while True:
            try:
                obj = self.api.get(name)
            except ExecError as e:
                # A busy or restarting API server (429, 5xx, a timeout) says nothing of the
                # pod: ask again till the deadline.
                if not e.retryable or time.monotonic() > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 1.5, 0.25)
                continue
            if obj is None:
                raise ExecError(f"{where}: deleted while starting", reason="SandboxDeleted",
                                retryable=True)  # fmt: skip
            status = obj.get("status") or {}
            for c in status.get("containerStatuses") or []:
                if c.get("name") == SANDBOX and "running" in (c.get("state") or {}):
                    return obj
            failed = not_starting(obj, where)
            if failed is not None:
                raise failed
            warning = ""
            if time.monotonic() > events_at:
                events_at = time.monotonic() + 2.0
                warning, failed = _sandbox_event(self.api.events(name), where)
                if failed is not None:
                    raise failed
            if time.monotonic() > deadline:
                raise ExecError(
                    f"{where}: not running after {self.start_timeout_s:.0f} s: "
                    f"{warning or _why(status) or status.get('phase')}",
                    reason="SandboxStartTimeout",
                    retryable=True,
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def _reach(self, obj: dict[str, Any], *, wait_s: float) -> Reachable:
        """Where the sandbox container's exec server and cgroup are, seen from here."""
        status = obj.get("status") or {}
        ids = [
            c.get("containerID", "")
            for c in status.get("containerStatuses") or []
            if c.get("name") == SANDBOX and "running" in (c.get("state") or {})
        ]
        if not ids or "://" not in ids[0]:
            raise ExecError(f"pod {obj['metadata']['name']}: the sandbox is not running")
        container_id = ids[0].split("://", 1)[1]
        name = obj["metadata"]["name"]
        try:
            pid = self._init_pid(container_id)
            group = cgroup_of(pid, self.cgroups, self.proc_root)
        except ExecError as e:
            raise ExecError(f"pod {self.namespace}/{name}: {e}", reason=e.reason) from None
        except OSError as e:  # its processes ended between the reads
            raise self._ended_at_start(name, e) from None
        socket = socket_in(self.proc_root, pid)
        deadline = time.monotonic() + wait_s
        while not socket.exists():
            if time.monotonic() > deadline:
                raise ExecError(f"pod {obj['metadata']['name']}: the exec server did not start")
            time.sleep(0.002)
        workdir = obj["spec"]["containers"][0].get("workingDir") or "/"
        started = start_time(pid, self.proc_root)
        if not started:  # /proc/<pid> gone: 0 would read as "always alive" later
            raise self._ended_at_start(name, "its init process is gone")
        return Reachable(container_id, socket, pid, group, workdir, started, self.proc_root)

    def _ended_at_start(self, name: str, e: OSError | str) -> ExecError:
        why = e if isinstance(e, str) else e.strerror or str(e)
        return ExecError(
            f"pod {self.namespace}/{name}: its sandbox ended as it started ({why})",
            reason="SandboxStartFailed",
        )

    def _init_pid(self, container_id: str) -> int:
        """The container's PID 1 among the host's processes (needs the host PID
        namespace): the process in a cgroup named by the container id whose own
        namespace calls it 1."""
        for entry in self.proc_root.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if container_id not in (entry / "cgroup").read_text():
                    continue
                status = (entry / "status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                # The host's pid, then 1 in the container's own namespace: exactly two.
                fields = line.split()
                if fields[0] == "NSpid:" and len(fields) == 3 and fields[2] == "1":
                    return int(entry.name)
        raise ExecError(
            f"container {container_id[:12]}: no process of it is visible here: it ended as "
            "it started, or the agent lacks the host's PID namespace (hostPID)",
            reason="SandboxStartFailed",
        )

    def _delete(self, name: str) -> None:
        """Delete a pod; one whose deletion fails (the API server unreachable) is kept and
        tried again with the next deletion, so no closed sandbox lives on to be adopted."""
        self._dying.pop(name, None)
        for pod in sorted(self._undeleted | {name}):
            try:
                self.api.delete(pod)
            except ExecError as e:
                self._undeleted.add(pod)
                log.warning("sandbox pod %s/%s: %s (will retry)", self.namespace, pod, e)
            else:
                self._undeleted.discard(pod)

    # ---- execution ---------------------------------------------------------------
    async def run(self, trajectory: str, cmd: Command, path: str) -> ExecResult:
        """A pod has only the fast path (a portable one would need the container runtime's
        API, which the agent does without)."""
        if path not in ("auto", "fast"):
            raise ExecError(f"path: {path!r}: the pod runtime has only the fast path")
        return await self.fast.exec(self.envs[trajectory].reach, cmd)

    def _reached(self, held: Pod, need: str) -> Reachable:
        return held.reach


def _open_dir_in(root: Path, path: str) -> int:
    """A descriptor of directory ``path`` inside a container's root (``/proc/<pid>/root``),
    each component opened without following a link: from here, an absolute link of the
    image would resolve on the host."""
    parts = Path(path).parts[1:]
    if ".." in parts:
        raise OSError(errno.EINVAL, "'..' in the path")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            step = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                           dir_fd=fd)  # fmt: skip
            os.close(fd)
            fd = step
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_file_in(root: Path, path: str, limit: int) -> str:
    """The text of regular file ``path`` inside a container's root, its first ``limit``
    bytes (whole lines), no component followed if it is a link (as ``_open_dir_in``): a
    link to a host file, a FIFO or a device is refused (OSError), never read."""
    parent, name = os.path.split(path)
    if name in ("", ".", ".."):
        raise OSError(errno.EINVAL, "not a file name")
    dir_fd = _open_dir_in(root, parent or "/")
    try:
        # O_PATH first: a FIFO or a device is not even opened (that could block, or act).
        pinned = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(pinned).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        fd = os.open(f"/proc/self/fd/{pinned}", os.O_RDONLY | os.O_CLOEXEC)  # that inode
    finally:
        os.close(pinned)
    with open(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # cut: keep whole lines
        data = data[:limit].rpartition(b"\n")[0]
    return data.decode(errors="replace")


def _workdir(root: Path, path: str) -> Workdir | None:
    """The image's workdir as the container sees it; None when it has none (or it is a
    link, which a volume then covers)."""
    try:
        fd = _open_dir_in(root, path)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return Workdir(st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode))


# What the kubelet's eviction messages say when a pod went over its ephemeral-storage
# limit ("Pod ephemeral local storage usage exceeds the total limit of containers …",
# "Container sandbox exceeded its local ephemeral storage limit …").
_DISK_EVICTION = ("ephemeral local storage", "local ephemeral storage")

# Waiting reasons after which the sandbox container will not start by itself.
_IMAGE_WAITS = frozenset(
    {"ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff", "InvalidImageName"}
)
_START_WAITS = frozenset({"CreateContainerConfigError", "CreateContainerError",
                          "RunContainerError"})  # fmt: skip
# How container runtimes say a RuntimeClass's handler is missing (containerd, CRI-O).
_NO_HANDLER = ("no runtime for", "runtime handler")


def not_starting(obj: Mapping[str, Any], where: str) -> ExecError | None:
    """The error of a sandbox pod that will not run by itself (None: it may yet)."""
    status = obj.get("status") or {}
    phase = status.get("phase")
    if phase in ("Failed", "Succeeded"):
        evicted = status.get("reason") == "Evicted"
        return ExecError(f"{where}: {phase}: {_why(status)}",
                         reason="SandboxEvicted" if evicted else "SandboxStartFailed",
                         retryable=evicted)  # fmt: skip
    waiting = _waiting(status)
    if waiting in _IMAGE_WAITS:
        return ExecError(
            f"{where}: {waiting}: {_why(status)} (image {_image(obj)}: images must be on "
            "the node or pullable)",
            reason="ImageUnavailable",
        )
    if waiting in _START_WAITS:
        return ExecError(f"{where}: {waiting}: {_why(status)}", reason="SandboxStartFailed")
    return None


def ending(obj: Mapping[str, Any] | None, where: str) -> tuple[str, str] | None:
    """(reason, message) of a sandbox pod whose processes ended, from what the kubelet
    wrote; None while its status still shows the sandbox running (not written yet)."""
    if obj is None:
        return "SandboxDeleted", f"pod {where} was deleted"
    status = obj.get("status") or {}
    if status.get("reason") == "Evicted":
        return _evicted(str(status.get("message") or ""), where)
    if (obj.get("metadata") or {}).get("deletionTimestamp"):
        return "SandboxDeleted", f"pod {where} was deleted"
    for c in status.get("containerStatuses") or []:
        if c.get("name") != SANDBOX:
            continue
        end = (c.get("state") or {}).get("terminated")
        if end is None:
            return None
        if end.get("reason") == "OOMKilled":
            return "SandboxOOMKilled", (
                f"pod {where}: the sandbox ran out of memory (OOMKilled): raise the "
                "TrajectoryEnv's memoryGB"
            )
        said = " ".join(str(end.get(k) or "") for k in ("reason", "message")).strip()
        return "SandboxExited", (
            f"pod {where}: the sandbox ended with exit code {end.get('exitCode')}"
            + (f" ({said})" if said else "")
        )
    return None


def _evicted(said: str, where: str) -> tuple[str, str]:
    if any(marker in said for marker in _DISK_EVICTION):
        return "DiskLimitExceeded", (
            f"pod {where} was evicted for its disk use: {said.strip()} (the TrajectoryEnv's "
            "diskGiB)"
        )
    return "SandboxEvicted", f"pod {where} was evicted: {said}"


def evicted_by_event(events: Sequence[Mapping[str, Any]], where: str) -> tuple[str, str] | None:
    """(reason, message) when the pod's Events say the kubelet evicted it."""
    for e in events:
        if e.get("reason") == "Evicted":
            return _evicted(str(e.get("message") or ""), where)
    return None


def _sandbox_event(events: Sequence[Mapping[str, Any]], where: str) -> tuple[str, ExecError | None]:
    """The newest Warning Event of a starting pod, and its error when it says the pod
    cannot start here (its RuntimeClass's handler is missing on this node)."""
    warnings = [e for e in events if e.get("type") == "Warning"]
    if not warnings:
        return "", None
    last = max(warnings, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    said = f"{last.get('reason', '')}: {last.get('message', '')}"
    for e in warnings:
        message = str(e.get("message") or "")
        if e.get("reason") == "FailedCreatePodSandBox" and any(h in message for h in _NO_HANDLER):
            return said, ExecError(
                f"{where}: {message} (the TrajectoryEnv's runtimeClassName needs a handler "
                "configured in this node's container runtime)",
                reason="RuntimeClassUnavailable",
            )
    return said, None


def _waiting(status: Mapping[str, Any]) -> str:
    for c in [*(status.get("initContainerStatuses") or []),
              *(status.get("containerStatuses") or [])]:  # fmt: skip
        reason = ((c.get("state") or {}).get("waiting") or {}).get("reason")
        if reason:
            return str(reason)
    return ""


def _why(status: Mapping[str, Any]) -> str:
    """The most telling message of a pod's status: a container's, else the pod's."""
    for c in [*(status.get("initContainerStatuses") or []),
              *(status.get("containerStatuses") or [])]:  # fmt: skip
        for state in (c.get("state") or {}).values():
            if not isinstance(state, dict) or state.get("exitCode") == 0:
                continue  # (an init container that did its work: "Completed" tells nothing)
            if state.get("message") or state.get("reason"):
                return f"{c.get('name')}: {state.get('reason', '')} {state.get('message', '')}"
    for cond in status.get("conditions") or []:
        if cond.get("status") == "False" and cond.get("message"):
            return str(cond["message"])
    return str(status.get("message") or status.get("reason") or "")


def _image(obj: Mapping[str, Any]) -> str:
    return ", ".join(c.get("image", "") for c in obj["spec"]["containers"])

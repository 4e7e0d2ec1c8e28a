"""A real Kubernetes node on this machine: kubelet + containerd + runc, loopback only.

:class:`RealNode` joins the :class:`~harness.controlplane.ControlPlane` with a kubelet
(built from the Go module proxy by ``e2e/build-tools.sh``) driving its own containerd
(Debian's ``containerd``, ``runc`` and ``containernetworking-plugins``). Nothing is pulled:
images come from the local Docker Engine (``docker save`` piped into ``ctr images
import``), the pod sandbox ("pause") image included, built from a static binary compiled
here.

What differs from a production node, and why:

- containerd's CRI plugin has ``restrict_oom_score_adj``: processes here lack
  CAP_SYS_RESOURCE, and runc's attempt to lower ``oom_score_adj`` fails every sandbox;
- pods get a network that leads nowhere: containerd 1.6 refuses a sandbox whose CNI
  result has no ``eth0`` address, so the bridge plugin gives each pod one on a bridge the
  host has no address on (no gateway, no masquerade) in 198.18.0.0/24, a benchmarking
  range. Tests talk only to 127.0.0.1: pods are reached through the API server (exec,
  logs, port-forward), never at these addresses;
- the kubelet refuses a loopback ``--node-ip`` when it sets the node's addresses, so the
  harness writes ``InternalIP: 127.0.0.1`` into the Node's status itself (the API server
  reaches the kubelet there for exec, logs and port-forward);
- cgroup v1 with the cgroupfs driver (no systemd here): ``failCgroupV1: false``;
- everything the node writes lives under its work directory (containerd's root, state
  and socket, the kubelet's root and pod logs), and :meth:`RealNode.stop` undoes what the
  kubelet changes on the host: its ``kubepods`` cgroups, mounts, the iptables chains it
  adds and the sysctls it sets.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.controlplane import (
    HOST,
    Component,
    ControlPlane,
    ControlPlaneError,
    _b64,
    _Pki,
    free_ports,
)

__all__ = ["PAUSE_IMAGE", "NodeError", "RealNode", "node_prerequisites"]

PAUSE_IMAGE = "docker.io/local/pause:1"
CGROUP_ROOT = Path("/sys/fs/cgroup")
CNI_BIN = Path("/usr/lib/cni")
# What the kubelet (and the bridge plugin: ip_forward) set on the host; restored at stop.
KUBELET_SYSCTLS = (
    "vm/overcommit_memory",
    "kernel/panic",
    "kernel/panic_on_oops",
    "net/ipv4/ip_forward",
)
POD_BRIDGE = "tangram-e2e0"
POD_SUBNET = "198.18.0.0/24"  # RFC 2544 benchmarking range: no private range, never routed
KUBELET_CHAINS = {  # table -> chains the kubelet adds (they stay after it exits)
    "filter": ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY"),
    "mangle": ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"),
    "nat": ("KUBE-KUBELET-CANARY",),
}
CONTAINER_LOGS = Path("/var/log/containers")  # the kubelet's symlinks; its path is fixed

# The sandbox's PID 1: sleeps, reaps, exits on SIGINT/SIGTERM (what the pause image does).
_PAUSE_C = r"""
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void stop(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
    struct sigaction s = {0};
    s.sa_handler = stop;
    sigaction(SIGINT, &s, 0);
    sigaction(SIGTERM, &s, 0);
    s.sa_handler = reap;
    s.sa_flags = SA_NOCLDSTOP;
    sigaction(SIGCHLD, &s, 0);
    for (;;) pause();
}
"""


class NodeError(ControlPlaneError):
    """The node could not be set up or started."""


def node_prerequisites() -> list[str]:
    """What this machine lacks to run a real node (empty when nothing)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    for tool in ("containerd", "ctr", "runc", "cc"):
        if shutil.which(tool) is None:
            missing.append(tool)
    if not (CNI_BIN / "loopback").exists():
        missing.append("containernetworking-plugins")
    if shutil.which("iptables") is None and not Path("/usr/sbin/iptables").exists():
        missing.append("iptables")
    return missing


class RealNode:
    """One kubelet + containerd node named ``name``, registered with ``cp``'s apiserver.

    ``labels`` become the Node's labels. ``start`` returns once the node is Ready;
    ``import_image`` makes a local Docker image available to its pods under a full name
    (the kubelet expands short names to ``docker.io/...``: use ``imagePullPolicy: Never``).
    """

    def __init__(
        self,
        cp: ControlPlane,
        work_dir: Path,
        *,
        name: str = "node-0",
        labels: Mapping[str, str] | None = None,
        start_timeout: float = 120.0,
    ) -> None:
        self.cp = cp
        self.name = name
        self.labels = dict(labels or {})
        self.work = work_dir.resolve()
        self.start_timeout = start_timeout
        self.containerd_dir = self.work / "containerd"
        self.socket = self.containerd_dir / "containerd.sock"
        self.kubelet_root = self.work / "kubelet"
        self.log_dir = self.work / "logs"
        self._components: list[Component] = []
        self._sysctls: dict[str, str] = {}

    # -- public API ---------------------------------------------------------------

    def start(self) -> None:
        missing = node_prerequisites()
        if missing:
            raise NodeError(f"a real node needs {', '.join(missing)} (e2e/README.md)")
        deadline = time.monotonic() + self.start_timeout
        self._sysctls = {k: _read_sysctl(k) for k in KUBELET_SYSCTLS}
        try:
            for d in (self.containerd_dir, self.kubelet_root, self.log_dir, self.work / "net.d"):
                d.mkdir(parents=True, exist_ok=True)
            self._start_containerd(deadline)
            self._import_pause()
            self._start_kubelet(deadline)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the kubelet, every container it started and containerd; undo the host
        changes. Safe to call repeatedly."""
        components, self._components = self._components, []
        kubelet = next((c for c in components if c.name == "kubelet"), None)
        if kubelet is not None:
            kubelet.stop()
            # Gone from the cluster too: nothing is scheduled onto a node that no longer
            # runs, and the pod garbage collector removes the pods still bound to it.
            with contextlib.suppress(ControlPlaneError, subprocess.TimeoutExpired):
                self.cp.kubectl("delete", "node", self.name, "--wait=false", check=False)
        if any(c.name == "containerd" and c.alive() for c in components):
            self._kill_containers()
        for c in reversed(components):
            c.stop()
        self._unmount_all()
        _remove_cgroups("kubepods")
        for key, value in self._sysctls.items():
            with contextlib.suppress(OSError):
                _write_sysctl(key, value)
        _remove_chains()
        if CONTAINER_LOGS.is_dir():  # only the links into this node's pod logs
            for link in CONTAINER_LOGS.iterdir():
                with contextlib.suppress(OSError):
                    if link.is_symlink() and str(self.log_dir) in os.readlink(link):
                        link.unlink()
        shutil.rmtree(self.work / "cni-state", ignore_errors=True)
        subprocess.run(["ip", "link", "delete", POD_BRIDGE], capture_output=True, check=False)

    def ctr(self, *args: str, stdin: Any = None, timeout: float = 300) -> str:
        argv = ["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args]
        done = subprocess.run(
            argv, stdin=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)}: {done.stderr.strip()[-500:]}")
        return done.stdout

    def import_image(self, docker_client: Any, image: str, name: str) -> str:
        """Copy the Docker image ``image`` into the node's containerd as ``name`` (a full
        reference such as ``docker.io/local/busybox:1``); returns ``name``."""
        docker_client.images.get(image).tag(*name.rsplit(":", 1))
        with self._docker_save(docker_client, name) as tar:
            self.ctr("images", "import", str(tar))
        if name not in self.ctr("images", "ls", "-q").split():
            raise NodeError(f"{name}: not in containerd after the import")
        return name

    def import_execd_image(self, execd: Path, name: str, path_in_image: str) -> str:
        """An image holding only the exec server at ``path_in_image`` (where the agent's
        image has it): what a sandbox pod's init container copies it from."""
        archive = self.work / "execd-image.tar"
        write_image_archive(
            archive, name, {path_in_image.lstrip("/"): execd}, entrypoint=[path_in_image]
        )
        self.ctr("images", "import", str(archive))
        return name

    def cgroup_dir(self, controller: str, pod_uid: str, container_id: str) -> Path | None:
        """Where a pod container's cgroup lies in ``controller`` (cgroup v1, cgroupfs)."""
        base = CGROUP_ROOT / controller / "kubepods"
        for qos in ("", "burstable", "besteffort"):
            path = base / qos / f"pod{pod_uid}" / container_id
            if path.is_dir():
                return path
        return None

    def log_tail(self) -> str:
        return "\n".join(f"--- {c.name}\n{c.log_tail()}" for c in self._components)

    # -- containerd -------------------------------------------------------------------

    def _start_containerd(self, deadline: float) -> None:
        d = self.containerd_dir
        cni = self.work / "net.d"
        network = {
            "cniVersion": "1.0.0",
            "name": "tangram-e2e",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": POD_BRIDGE,
                    "isGateway": False,  # the host gets no address: pods reach nothing
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_SUBNET}]],
                        "dataDir": str(self.work / "cni-state"),
                    },
                },
                {"type": "loopback"},
            ],
        }
        (cni / "10-tangram-e2e.conflist").write_text(json.dumps(network))
        config = d / "config.toml"
        config.write_text(
            f"""version = 2
root = "{d / "root"}"
state = "{d / "state"}"
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d / "opt"}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  stream_server_address = "{HOST}"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{cni}"
"""
        )
        proc = self._launch("containerd", [_which("containerd"), "--config", str(config)])
        self._wait("containerd's socket", proc, self._containerd_up, deadline)

    def _containerd_up(self) -> bool:
        if not self.socket.exists():
            return False
        try:
            self.ctr("version", timeout=10)
        except (NodeError, subprocess.TimeoutExpired):
            return False
        return True

    def _import_pause(self) -> None:
        """The sandbox image: a static pause binary in an image of its own, written as a
        Docker archive (``ctr images import`` reads that format) without a Docker Engine."""
        src = self.work / "pause.c"
        binary = self.work / "pause"
        src.write_text(_PAUSE_C)
        done = subprocess.run(
            ["cc", "-static", "-O2", "-o", str(binary), str(src)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise NodeError(f"building the pause binary failed (libc6-dev?): {done.stderr}")
        archive = self.work / "pause.tar"
        write_image_archive(archive, PAUSE_IMAGE, {"pause": binary}, entrypoint=["/pause"])
        self.ctr("images", "import", str(archive))

    def _kill_containers(self) -> None:
        """SIGKILL every task, then remove tasks and containers (their mounts go too)."""
        with contextlib.suppress(NodeError, subprocess.TimeoutExpired):
            for line in self.ctr("tasks", "ls", timeout=30).splitlines()[1:]:
                task = line.split()[0]
                with contextlib.suppress(NodeError, subprocess.TimeoutExpired):
                    self.ctr("tasks", "kill", "--signal", "SIGKILL", task, timeout=30)
            deadline = time.monotonic() + 15
            for task in self.ctr("tasks", "ls", "-q", timeout=30).split():
                while time.monotonic() < deadline:
                    try:
                        self.ctr("tasks", "rm", "-f", task, timeout=30)
                        break
                    except NodeError:
                        time.sleep(0.2)
            for container in self.ctr("containers", "ls", "-q", timeout=30).split():
                with contextlib.suppress(NodeError, subprocess.TimeoutExpired):
                    self.ctr("containers", "rm", container, timeout=30)

    @contextlib.contextmanager
    def _docker_save(self, client: Any, name: str) -> Iterator[Path]:
        path = self.work / f"image-{hashlib.sha256(name.encode()).hexdigest()[:12]}.tar"
        try:
            with path.open("wb") as out:  # saved by this reference: it names the import
                for chunk in client.api.get_image(name):
                    out.write(chunk)
            yield path
        finally:
            path.unlink(missing_ok=True)

    # -- kubelet ----------------------------------------------------------------------

    def _start_kubelet(self, deadline: float) -> None:
        pki_dir = self.work / "pki"
        pki_dir.mkdir(exist_ok=True)
        for name in ("ca.crt", "ca.key", "openssl.cnf"):
            shutil.copy(self.cp.pki_dir / name, pki_dir / name)
        pki = _Pki(pki_dir)
        cert, key = pki.issue(
            "kubelet-client",
            common_name=f"system:node:{self.name}",
            organization="system:nodes",
            client=True,
        )
        serving_cert, serving_key = pki.issue(
            "kubelet-serving", common_name=self.name, dns_names=(self.name,),
            ip_addresses=(HOST,), server=True,
        )  # fmt: skip
        kubeconfig = self.work / "kubelet.kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "e2e",
                            "cluster": {
                                "server": self.cp.server,
                                "certificate-authority-data": _b64(self.cp.ca_cert),
                            },
                        }
                    ],
                    "users": [
                        {
                            "name": "kubelet",
                            "user": {
                                "client-certificate-data": _b64(cert),
                                "client-key-data": _b64(key),
                            },
                        }
                    ],
                    "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "kubelet"}}],
                    "current-context": "e2e",
                }
            )
        )
        port, healthz = free_ports(2)
        config = self.work / "kubelet-config.json"
        config.write_text(
            json.dumps(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    "address": HOST,
                    "port": port,
                    "readOnlyPort": 0,
                    "healthzBindAddress": HOST,
                    "healthzPort": healthz,
                    "tlsCertFile": str(serving_cert),
                    "tlsPrivateKeyFile": str(serving_key),
                    "authentication": {
                        "anonymous": {"enabled": False},
                        "webhook": {"enabled": True},
                        "x509": {"clientCAFile": str(self.cp.ca_cert)},
                    },
                    "authorization": {"mode": "Webhook"},
                    "containerRuntimeEndpoint": f"unix://{self.socket}",
                    "cgroupDriver": "cgroupfs",  # no systemd on this machine
                    "failCgroupV1": False,
                    "failSwapOn": False,
                    "podLogsDir": str(self.log_dir / "pods"),
                    "clusterDomain": "cluster.local",
                    "resolvConf": "",
                    # A test machine's disk and memory run full: never evict for that.
                    "evictionHard": {
                        "memory.available": "50Mi",
                        "nodefs.available": "1%",
                        "imagefs.available": "1%",
                        "nodefs.inodesFree": "1%",
                    },
                    "imageGCHighThresholdPercent": 100,
                    "imageGCLowThresholdPercent": 99,
                    "serializeImagePulls": False,
                    "syncFrequency": "10s",
                    "fileCheckFrequency": "10s",
                    "nodeStatusUpdateFrequency": "5s",
                }
            )
        )
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        kubelet = self._launch(
            "kubelet",
            [
                str(self.cp.bin_dir / "kubelet"),
                f"--config={config}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={self.kubelet_root}",
                f"--cert-dir={pki_dir}",
                f"--hostname-override={self.name}",
                f"--node-ip={HOST}",
                *([f"--node-labels={labels}"] if labels else []),
                "--v=1",
            ],
        )
        self._wait(f"node {self.name} to register", kubelet, self._registered, deadline)
        addresses = {"status": {"addresses": [
            {"type": "InternalIP", "address": HOST}, {"type": "Hostname", "address": self.name},
        ]}}  # fmt: skip
        self.cp.kubectl("patch", "node", self.name, "--subresource=status", "--type=merge",
                        "-p", json.dumps(addresses))  # fmt: skip
        self._wait(f"node {self.name} to be Ready", kubelet, self._ready, deadline)

    def _registered(self) -> bool:
        return self.cp.kubectl("get", "node", self.name, check=False).returncode == 0

    def _ready(self) -> bool:
        done = self.cp.kubectl("get", "node", self.name, "-o", "json", check=False)
        if done.returncode != 0:
            return False
        conditions = json.loads(done.stdout).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    # -- plumbing ---------------------------------------------------------------------

    def _launch(self, name: str, argv: Sequence[str]) -> Component:
        component = Component(name, argv, self.log_dir / f"{name}.log")
        self._components.append(component)
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        env["PATH"] = f"{env.get('PATH', '')}:/usr/sbin:/sbin"
        component.start(env, self.work)
        return component

    def _wait(self, what: str, component: Component, probe: Any, deadline: float) -> None:
        while not probe():
            code = component.returncode()
            if code is not None:
                raise NodeError(
                    f"{component.name} exited with status {code} while waiting for {what}:\n"
                    f"{component.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise NodeError(f"timed out waiting for {what}:\n{component.log_tail()}")
            time.sleep(0.25)

    def _unmount_all(self) -> None:
        """Unmount everything under the work directory, deepest first (secret volumes,
        shm, container root file systems left by a killed runtime)."""
        mounts = []
        with contextlib.suppress(OSError):
            for line in Path("/proc/self/mountinfo").read_text().splitlines():
                point = line.split()[4].replace("\\040", " ")
                if point == str(self.work) or point.startswith(f"{self.work}/"):
                    mounts.append(point)
        for point in sorted(set(mounts), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def write_image_archive(
    path: Path, name: str, files: Mapping[str, Path], *, entrypoint: Sequence[str]
) -> None:
    """A one-layer image in Docker's archive format (what ``docker save`` writes), which
    ``ctr images import`` takes."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for arcname, source in sorted(files.items()):
            tar.add(source, arcname=arcname)
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64" if os.uname().machine == "x86_64" else "arm64",
            "os": "linux",
            "config": {"Entrypoint": list(entrypoint)},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        }
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps(
        [{"Config": config_name, "RepoTags": [name], "Layers": ["layer/layer.tar"]}]
    ).encode()
    with tarfile.open(path, mode="w") as out:
        for member, data in (
            ("layer/layer.tar", layer_bytes),
            (config_name, config),
            ("manifest.json", manifest),
        ):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))


def _which(tool: str) -> str:
    found = shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")
    if found is None:
        raise NodeError(f"{tool} is not installed")
    return found


def _read_sysctl(key: str) -> str:
    return (Path("/proc/sys") / key).read_text().strip()


def _write_sysctl(key: str, value: str) -> None:
    (Path("/proc/sys") / key).write_text(value)


def _remove_cgroups(name: str) -> None:
    """rmdir the ``name`` group and everything below it in every v1 hierarchy (or v2)."""
    roots = [p / name for p in CGROUP_ROOT.iterdir() if (p / name).is_dir()]
    if (CGROUP_ROOT / name).is_dir():
        roots.append(CGROUP_ROOT / name)
    for root in roots:
        for dirpath, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


def _remove_chains() -> None:
    iptables = shutil.which("iptables") or "/usr/sbin/iptables"
    for table, chains in KUBELET_CHAINS.items():
        for chain in chains:
            # Jumps to the chain first (from the built-in chains), then the chain.
            for builtin in ("INPUT", "OUTPUT", "FORWARD", "PREROUTING", "POSTROUTING"):
                while (
                    subprocess.run(
                        [iptables, "-t", table, "-D", builtin, "-j", chain],
                        capture_output=True,
                        check=False,
                    ).returncode
                    == 0
                ):
                    pass
            subprocess.run([iptables, "-t", table, "-F", chain], capture_output=True, check=False)
            subprocess.run([iptables, "-t", table, "-X", chain], capture_output=True, check=False)

"""A real Kubernetes control plane on 127.0.0.1, for end-to-end tests.

:class:`ControlPlane` runs etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok as child processes, from the binaries that
``e2e/build-tools.sh`` builds. Nodes are fake: kwok plays the kubelet for every
Node that carries the annotation ``kwok.x-k8s.io/node=fake``
(:meth:`ControlPlane.add_fake_node` creates one), so pods scheduled there turn
Running and Ready without a container runtime.

Everything listens on 127.0.0.1 and nothing needs host network configuration:
the service CIDR is only a range the apiserver allocates ClusterIPs from, fake
nodes report 127.0.0.1 as their address, and no proxy or CNI runs.

Layout of the work directory::

    pki/                 CA, serving and client certificates, service-account key pair
    etcd-data/           etcd's data directory
    logs/<component>.log stdout and stderr of each component
    admin.kubeconfig     cluster-admin (O=system:masters), certificates embedded
    *.kubeconfig         one per component, each with its own identity
    kwok-stages.yaml     how kwok moves fake nodes and pods through their lifecycle
    home/                HOME of the children (keeps ~/.kube and ~/.kwok of the host out)

Example::

    cp = ControlPlane(bin_dir, tmp_path)
    cp.start()
    try:
        cp.add_fake_node("node-1")
        cp.kubectl("create", "deployment", "web", "--image=web", "--replicas=2")
    finally:
        cp.stop()
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import functools
import json
import os
import random
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

__all__ = [
    "FAKE_NODE_ANNOTATION",
    "ControlPlane",
    "ControlPlaneError",
    "KubectlError",
    "Ports",
]

HOST = "127.0.0.1"
#: The annotation (key, value) that puts a Node in kwok's hands.
FAKE_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
CLUSTER_NAME = "tangram-e2e"

_LOG_TAIL_LINES = 40
_POLL_INTERVAL_S = 0.25

# The stages kwok plays on the objects it manages. Nodes turn Ready once and
# then stay so through the node Leases kwok renews; pods on a fake node go
# Pending -> Running with every container ready; a pod marked for deletion is
# deleted at once (there is no container to stop).
_KWOK_STAGES = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: tangram-node-ready
spec:
  resourceRef:
    apiGroup: v1
    kind: Node
  selector:
    matchExpressions:
    - key: '.status.conditions.[] | select(.type == "Ready") | .status'
      operator: NotIn
      values: ["True"]
  next:
    statusTemplate: |
      {{ $now := Now }}
      phase: Running
      conditions:
      - type: Ready
        status: "True"
        reason: KubeletReady
        message: kwok plays the kubelet of this fake node
        lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $now | Quote }}
      {{ range list "MemoryPressure" "DiskPressure" "PIDPressure" "NetworkUnavailable" }}
      - type: {{ . }}
        status: "False"
        reason: FakeNode
        message: fake node
        lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $now | Quote }}
      {{ end }}
      addresses:
      - type: InternalIP
        address: {{ NodeIP | Quote }}
      - type: Hostname
        address: {{ .metadata.name | Quote }}
      nodeInfo:
        architecture: amd64
        operatingSystem: linux
        osImage: kwok
        kernelVersion: kwok
        containerRuntimeVersion: kwok
        kubeletVersion: kwok
        kubeProxyVersion: kwok
        machineID: ""
        systemUUID: ""
        bootID: ""
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: tangram-pod-running
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: .metadata.deletionTimestamp
      operator: DoesNotExist
    - key: .status.phase
      operator: In
      values: ["Pending"]
  next:
    statusTemplate: |
      {{ $now := Now }}
      phase: Running
      startTime: {{ $now | Quote }}
      hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
      podIP: {{ PodIPWith .spec.nodeName (or .spec.hostNetwork false)
                  .metadata.uid .metadata.name .metadata.namespace | Quote }}
      conditions:
      {{ range list "PodScheduled" "Initialized" "ContainersReady" "Ready" }}
      - type: {{ . }}
        status: "True"
        lastTransitionTime: {{ $now | Quote }}
      {{ end }}
      {{ range .spec.readinessGates }}
      - type: {{ .conditionType | Quote }}
        status: "True"
        lastTransitionTime: {{ $now | Quote }}
      {{ end }}
      initContainerStatuses:
      {{ range .spec.initContainers }}
      - name: {{ .name | Quote }}
        image: {{ .image | Quote }}
        ready: true
        restartCount: 0
        state:
          terminated:
            exitCode: 0
            reason: Completed
            startedAt: {{ $now | Quote }}
            finishedAt: {{ $now | Quote }}
      {{ end }}
      containerStatuses:
      {{ range .spec.containers }}
      - name: {{ .name | Quote }}
        image: {{ .image | Quote }}
        ready: true
        started: true
        restartCount: 0
        state:
          running:
            startedAt: {{ $now | Quote }}
      {{ end }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: tangram-pod-deleted
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: .metadata.deletionTimestamp
      operator: Exists
  next:
    delete: true
"""


class ControlPlaneError(RuntimeError):
    """The control plane could not be set up, started or queried."""


class KubectlError(subprocess.CalledProcessError):
    """A kubectl command exited non-zero; its message carries kubectl's stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {(self.stderr or '').strip()}"


@dataclass(frozen=True)
class Ports:
    """The TCP ports (all on 127.0.0.1) the components listen on."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int


def free_ports(count: int) -> list[int]:
    """Pick ``count`` distinct TCP ports that are free on 127.0.0.1.

    The ports come from below the kernel's ephemeral range: a port from bind(0)
    is an ephemeral one, and until its server binds it, any outgoing connection
    (the apiserver's to etcd, say) may take it as its source port.
    """
    low = 32768
    with contextlib.suppress(OSError, ValueError, IndexError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    first = 10000 if low > 12000 else 1024
    rng = random.SystemRandom()
    ports: list[int] = []
    for port in rng.sample(range(first, low), min(low - first, 200)):
        if _port_is_free(port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise ControlPlaneError(f"found no {count} free ports on {HOST} in [{first}, {low})")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _linux_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _linux_libc()  # loaded here, not in the forked child
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the test process dies.

    The process groups are the orderly way down (:meth:`ControlPlane.stop`);
    this catches a test run that is itself killed and never gets to stop().
    Linux ties the signal to the *thread* that started the child: start the
    control plane from a thread that outlives it (pytest's main thread does).
    """
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Component:
    """One control-plane process, in its own process group, logging to a file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._popen: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, env: Mapping[str, str], cwd: Path) -> None:
        self._log = self.log_path.open("ab")
        self._log.write(f"### {' '.join(self.argv)}\n".encode())
        self._log.flush()
        self._popen = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=dict(env),
            start_new_session=True,  # its own process group, signalled as one
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - sets only a prctl flag
        )

    def returncode(self) -> int | None:
        """None while running (or never started), else the exit status."""
        return None if self._popen is None else self._popen.poll()

    @property
    def pid(self) -> int:
        assert self._popen is not None, f"{self.name} was never started"
        return self._popen.pid

    def alive(self) -> bool:
        return self._popen is not None and self.returncode() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; reap; close the log."""
        popen = self._popen
        if popen is not None:
            pgid = popen.pid  # start_new_session: the leader's pid is the group id
            self._signal_group(pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=grace_s)
            # Also after a clean exit of the leader: nothing of the group may stay.
            self._signal_group(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5.0)
        if self._log is not None:
            self._log.close()
            self._log = None

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])


class _Pki:
    """Certificates and keys, made with the ``openssl`` command line tool."""

    _REQ_CONFIG = """\
[req]
distinguished_name = dn
[dn]
[ca_ext]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign, digitalSignature
subjectKeyIdentifier = hash
"""

    def __init__(self, directory: Path, openssl: str = "openssl") -> None:
        self.dir = directory
        self.openssl = openssl
        self.ca_cert = directory / "ca.crt"
        self.ca_key = directory / "ca.key"
        self._config = directory / "openssl.cnf"

    def _run(self, *args: str) -> None:
        try:
            subprocess.run(
                [self.openssl, *args], check=True, capture_output=True, text=True, timeout=60
            )
        except FileNotFoundError as exc:
            raise ControlPlaneError("the openssl command line tool is not installed") from exc
        except subprocess.CalledProcessError as exc:
            raise ControlPlaneError(
                f"openssl {' '.join(args[:2])} failed: {exc.stderr.strip()}"
            ) from exc

    def create_ca(self, common_name: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._config.write_text(self._REQ_CONFIG)
        self._run(
            "req", "-x509", "-config", str(self._config), "-extensions", "ca_ext",
            "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-noenc",
            "-keyout", str(self.ca_key), "-out", str(self.ca_cert),
            "-subj", f"/CN={common_name}", "-days", "3650", "-sha256",
        )  # fmt: skip

    def issue(
        self,
        name: str,
        *,
        common_name: str,
        organization: str | None = None,
        dns_names: Sequence[str] = (),
        ip_addresses: Sequence[str] = (),
        server: bool = False,
        client: bool = False,
    ) -> tuple[Path, Path]:
        """Issue ``<name>.crt``/``<name>.key`` signed by the CA; returns (cert, key)."""
        cert, key, csr, ext = (self.dir / f"{name}.{s}" for s in ("crt", "key", "csr", "ext"))
        subject = (f"/O={organization}" if organization else "") + f"/CN={common_name}"
        usages = [u for u, wanted in (("serverAuth", server), ("clientAuth", client)) if wanted]
        lines = [
            "basicConstraints = critical, CA:FALSE",
            "keyUsage = critical, digitalSignature, keyEncipherment",
            f"extendedKeyUsage = {', '.join(usages)}",
            "authorityKeyIdentifier = keyid",
        ]
        sans = [f"DNS:{d}" for d in dns_names] + [f"IP:{ip}" for ip in ip_addresses]
        if sans:
            lines.append(f"subjectAltName = {', '.join(sans)}")
        ext.write_text("\n".join(lines) + "\n")
        self._run(
            "req", "-new", "-config", str(self._config),
            "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-noenc",
            "-keyout", str(key), "-out", str(csr), "-subj", subject,
        )  # fmt: skip
        self._run(
            "x509", "-req", "-in", str(csr), "-CA", str(self.ca_cert), "-CAkey", str(self.ca_key),
            "-set_serial", f"0x{secrets.token_hex(16)}", "-days", "825", "-sha256",
            "-extfile", str(ext), "-out", str(cert),
        )  # fmt: skip
        csr.unlink()
        ext.unlink()
        return cert, key

    def rsa_key_pair(self, name: str) -> tuple[Path, Path]:
        """An RSA key pair (the service-account signing key); returns (private, public)."""
        private, public = self.dir / f"{name}.key", self.dir / f"{name}.pub"
        self._run(
            "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(private)
        )
        self._run("pkey", "-in", str(private), "-pubout", "-out", str(public))
        return private, public


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok on 127.0.0.1.

    ``bin_dir`` holds etcd, kube-apiserver, kube-controller-manager,
    kube-scheduler, kwok and kubectl (``e2e/build-tools.sh`` prints its path);
    ``work_dir`` receives certificates, data, kubeconfigs and logs. Usable as a
    context manager (``with ControlPlane(...) as cp:``).
    """

    COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")

    def __init__(
        self, bin_dir: Path | str, work_dir: Path | str, *, start_timeout: float = 180.0
    ) -> None:
        self.bin_dir = Path(bin_dir).resolve()
        self.work_dir = Path(work_dir).resolve()
        self.start_timeout = start_timeout
        self.pki_dir = self.work_dir / "pki"
        self.log_dir = self.work_dir / "logs"
        self.admin_kubeconfig = self.work_dir / "admin.kubeconfig"
        self.ca_cert = self.pki_dir / "ca.crt"
        self._ports: Ports | None = None
        self._components: list[Component] = []
        self._admin_tls: ssl.SSLContext | None = None
        self._env = self._child_env()

    # -- public API ---------------------------------------------------------------

    @property
    def ports(self) -> Ports:
        """The ports in use; known once :meth:`start` has begun."""
        if self._ports is None:
            raise ControlPlaneError("the control plane has not been started")
        return self._ports

    @property
    def server(self) -> str:
        """The apiserver's URL, ``https://127.0.0.1:<port>``."""
        return f"https://{HOST}:{self.ports.apiserver}"

    @property
    def running(self) -> bool:
        """Whether components have been started and not stopped since."""
        return bool(self._components)

    def log_path(self, component: str) -> Path:
        """The log file of ``component`` (one of :attr:`COMPONENTS`)."""
        return self.log_dir / f"{component}.log"

    def start(self) -> None:
        """Start every component and wait until the cluster works.

        Returns once ``/readyz`` answers ok, the controller manager, scheduler
        and kwok answer their health checks, and the ``default`` ServiceAccount
        exists in the ``default`` namespace (so controllers run). On any failure
        everything started so far is stopped and :class:`ControlPlaneError` is
        raised with the tail of the failing component's log. A work dir serves
        one start: start a new ControlPlane in a new work dir for a fresh cluster.
        """
        if self._components:
            raise ControlPlaneError("the control plane is already running")
        if (self.work_dir / "etcd-data").exists():
            raise ControlPlaneError(f"{self.work_dir} was used before; give a fresh work dir")
        deadline = time.monotonic() + self.start_timeout
        atexit.register(self.stop)
        try:
            self._prepare()
            self._start_etcd(deadline)
            self._start_apiserver(deadline)
            self._start_controllers(deadline)
            self._wait(
                "the default ServiceAccount in namespace default",
                self._component("kube-controller-manager"),
                lambda: (
                    self._api_get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200
                ),
                deadline,
            )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every component (newest first); safe to call at any time, repeatedly."""
        components, self._components = self._components, []
        for component in reversed(components):
            component.stop()
        atexit.unregister(self.stop)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | str | None = None,
        stdin: str | None = None,
        check: bool = True,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``kubectl <args>`` as cluster-admin (or with ``kubeconfig``).

        Raises :class:`KubectlError` on a non-zero exit unless ``check`` is false.
        """
        argv = [
            str(self.bin_dir / "kubectl"),
            f"--kubeconfig={kubeconfig or self.admin_kubeconfig}",
            *args,
        ]
        result = subprocess.run(
            argv,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self._env,
            check=False,
        )
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, argv, result.stdout, result.stderr)
        return result

    def add_fake_node(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        cpu: str = "32",
        memory: str = "256Gi",
        *,
        pods: int = 110,
        taints: Sequence[Mapping[str, str]] = (),
        wait: bool = True,
        timeout: float = 60.0,
    ) -> None:
        """Create a Node that kwok manages, with the given capacity.

        ``labels`` come on top of the usual ``kubernetes.io/hostname``,
        ``kubernetes.io/os`` and ``kubernetes.io/arch`` and ``type=kwok``;
        ``taints`` are ``{"key":..., "value":..., "effect":...}`` mappings. With
        ``wait`` (the default), returns once the node reports Ready.
        """
        resources = {"cpu": cpu, "memory": memory, "pods": str(pods)}
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {FAKE_NODE_ANNOTATION[0]: FAKE_NODE_ANNOTATION[1]},
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                    **(labels or {}),
                },
            },
            "spec": {"taints": [dict(t) for t in taints]},
            "status": {"capacity": resources, "allocatable": resources},
        }
        self.kubectl("create", "-f", "-", stdin=json.dumps(node))
        if wait:
            self._wait(
                f"node {name} to be Ready",
                self._component("kwok"),
                lambda: self._node_ready(name),
                time.monotonic() + timeout,
            )

    def service_account_kubeconfig(
        self, namespace: str, service_account: str, path: Path | str, *, duration: str = "1h"
    ) -> Path:
        """Write a kubeconfig that authenticates as ``system:serviceaccount:<ns>:<sa>``.

        The token is minted with the TokenRequest API (``kubectl create token``)
        and is valid for ``duration``; the context's namespace is ``namespace``.
        """
        token = self.kubectl(
            "create", "token", service_account, "-n", namespace, f"--duration={duration}"
        ).stdout.strip()
        user = f"system:serviceaccount:{namespace}:{service_account}"
        return self._write_kubeconfig(Path(path), user, {"token": token}, namespace=namespace)

    # -- setup --------------------------------------------------------------------

    def _child_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        env["HOME"] = str(self.work_dir / "home")
        return env

    def _component(self, name: str) -> Component:
        for component in self._components:
            if component.name == name:
                return component
        raise ControlPlaneError(f"{name} has not been started")

    def _binary(self, name: str) -> str:
        path = self.bin_dir / name
        if not os.access(path, os.X_OK):
            raise ControlPlaneError(f"{path} is missing or not executable (run e2e/build-tools.sh)")
        return str(path)

    def _prepare(self) -> None:
        for name in (*self.COMPONENTS, "kubectl"):
            self._binary(name)
        for directory in (self.work_dir, self.pki_dir, self.log_dir, self.work_dir / "home"):
            directory.mkdir(parents=True, exist_ok=True)
        ports = free_ports(6)
        self._ports = Ports(*ports)

        pki = _Pki(self.pki_dir)
        pki.create_ca(f"{CLUSTER_NAME}-ca")
        pki.issue(
            "kube-apiserver",
            common_name="kube-apiserver",
            dns_names=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            ip_addresses=(HOST, "10.96.0.1"),
            server=True,
        )
        pki.rsa_key_pair("service-account")
        # What the apiserver shows kubelets for logs, exec and port-forward.
        pki.issue(
            "apiserver-kubelet-client",
            common_name="kube-apiserver-kubelet-client",
            organization="system:masters",
            client=True,
        )
        clients = {
            "admin": ("tangram-e2e-admin", "system:masters"),
            "kube-controller-manager": ("system:kube-controller-manager", None),
            "kube-scheduler": ("system:kube-scheduler", None),
        }
        for name, (common_name, organization) in clients.items():
            cert, key = pki.issue(
                name, common_name=common_name, organization=organization, client=True
            )
            user_auth = {"client-certificate-data": _b64(cert), "client-key-data": _b64(key)}
            kubeconfig = (
                self.admin_kubeconfig if name == "admin" else self.work_dir / f"{name}.kubeconfig"
            )
            self._write_kubeconfig(kubeconfig, common_name, user_auth)

        self._admin_tls = ssl.create_default_context(cafile=str(self.ca_cert))
        self._admin_tls.load_cert_chain(self.pki_dir / "admin.crt", self.pki_dir / "admin.key")
        (self.work_dir / "kwok-stages.yaml").write_text(_KWOK_STAGES)

    def _write_kubeconfig(
        self, path: Path, user: str, auth: Mapping[str, str], *, namespace: str | None = None
    ) -> Path:
        context: dict[str, str] = {"cluster": CLUSTER_NAME, "user": user}
        if namespace:
            context["namespace"] = namespace
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": CLUSTER_NAME,
                    "cluster": {
                        "server": self.server,
                        "certificate-authority-data": _b64(self.ca_cert),
                    },
                }
            ],
            "users": [{"name": user, "user": dict(auth)}],
            "contexts": [{"name": CLUSTER_NAME, "context": context}],
            "current-context": CLUSTER_NAME,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
        path.chmod(0o600)
        return path

    # -- components -----------------------------------------------------------------

    def _launch(self, name: str, args: Sequence[str]) -> Component:
        component = Component(name, [self._binary(name), *args], self.log_path(name))
        self._components.append(component)
        component.start(self._env, self.work_dir)
        return component

    def _start_etcd(self, deadline: float) -> None:
        client = f"http://{HOST}:{self.ports.etcd_client}"
        peer = f"http://{HOST}:{self.ports.etcd_peer}"
        etcd = self._launch(
            "etcd",
            [
                "--name=e2e",
                f"--data-dir={self.work_dir / 'etcd-data'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=e2e={peer}",
                "--initial-cluster-state=new",
                "--logger=zap",
                "--log-outputs=stderr",
                "--unsafe-no-fsync",  # throwaway data: skip fsync, much faster on a busy disk
            ],
        )

        def healthy() -> bool:
            status, body = _http_get(f"{client}/health", None)
            return status == 200 and '"health":"true"' in body.replace(" ", "")

        self._wait("etcd to be healthy", etcd, healthy, deadline)

    def _start_apiserver(self, deadline: float) -> None:
        pki = self.pki_dir
        apiserver = self._launch(
            "kube-apiserver",
            [
                f"--etcd-servers=http://{HOST}:{self.ports.etcd_client}",
                f"--bind-address={HOST}",
                f"--advertise-address={HOST}",
                f"--secure-port={self.ports.apiserver}",
                f"--cert-dir={self.work_dir / 'serving' / 'kube-apiserver'}",
                f"--tls-cert-file={pki / 'kube-apiserver.crt'}",
                f"--tls-private-key-file={pki / 'kube-apiserver.key'}",
                f"--client-ca-file={self.ca_cert}",
                "--authorization-mode=Node,RBAC",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={pki / 'service-account.pub'}",
                f"--service-account-signing-key-file={pki / 'service-account.key'}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                # The apiserver would publish 127.0.0.1 as the endpoint of the
                # `kubernetes` Service, which validation rejects (loopback), every
                # 10 s; nothing here routes to that Service anyway.
                "--endpoint-reconciler-type=none",
                "--allow-privileged=true",
                "--profiling=false",
                # Real kubelets (harness.kubelet) serve certificates of this CA on 127.0.0.1.
                f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
                f"--kubelet-certificate-authority={self.ca_cert}",
                "--kubelet-preferred-address-types=InternalIP",
            ],
        )

        def ready() -> bool:
            status, body = self._api_get("/readyz")
            return status == 200 and body.strip() == "ok"

        self._wait("kube-apiserver /readyz", apiserver, ready, deadline)

    def _start_controllers(self, deadline: float) -> None:
        pki = self.pki_dir
        # Client certificates signed by our CA, and tokens through TokenReview, may
        # call their secure ports. No front proxy exists, so they must not look up
        # its (absent) request-header CA in kube-system; they'd log errors forever.
        delegated_authn = [f"--client-ca-file={self.ca_cert}", "--authentication-skip-lookup"]
        cm_kubeconfig = self.work_dir / "kube-controller-manager.kubeconfig"
        controller_manager = self._launch(
            "kube-controller-manager",
            [
                f"--kubeconfig={cm_kubeconfig}",
                f"--authentication-kubeconfig={cm_kubeconfig}",
                f"--authorization-kubeconfig={cm_kubeconfig}",
                *delegated_authn,
                f"--bind-address={HOST}",
                f"--secure-port={self.ports.controller_manager}",
                f"--cert-dir={self.work_dir / 'serving' / 'kube-controller-manager'}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki / 'service-account.key'}",
                f"--root-ca-file={self.ca_cert}",
                f"--cluster-signing-cert-file={self.ca_cert}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                # "*" = every controller on by default, among them garbage-collector,
                # deployment, replicaset, daemonset, job, serviceaccount(-token),
                # namespace, node-lifecycle, endpointslice and root-ca-cert-publisher.
                "--controllers=*",
            ],
        )
        sched_kubeconfig = self.work_dir / "kube-scheduler.kubeconfig"
        scheduler = self._launch(
            "kube-scheduler",
            [
                f"--kubeconfig={sched_kubeconfig}",
                f"--authentication-kubeconfig={sched_kubeconfig}",
                f"--authorization-kubeconfig={sched_kubeconfig}",
                *delegated_authn,
                f"--bind-address={HOST}",
                f"--secure-port={self.ports.scheduler}",
                f"--cert-dir={self.work_dir / 'serving' / 'kube-scheduler'}",
                "--leader-elect=false",
            ],
        )
        kwok = self._launch(
            "kwok",
            [
                f"--kubeconfig={self.admin_kubeconfig}",
                f"--config={self.work_dir / 'kwok-stages.yaml'}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector={}={}".format(*FAKE_NODE_ANNOTATION),
                f"--node-ip={HOST}",
                f"--server-address={HOST}:{self.ports.kwok}",
                "--node-lease-duration-seconds=40",
            ],
        )
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE  # self-signed serving certs on 127.0.0.1

        ports = self.ports
        for component, url, tls in (
            (controller_manager, f"https://{HOST}:{ports.controller_manager}/healthz", insecure),
            (scheduler, f"https://{HOST}:{ports.scheduler}/healthz", insecure),
            (kwok, f"http://{HOST}:{ports.kwok}/healthz", None),
        ):
            self._wait(
                f"{component.name} {url}",
                component,
                functools.partial(_answers_ok, url, tls),
                deadline,
            )

    # -- waiting and probing --------------------------------------------------------

    def _wait(
        self, what: str, component: Component, probe: Callable[[], bool], deadline: float
    ) -> None:
        """Poll ``probe`` until true; fail fast if any component exits meanwhile."""
        while True:
            for running in self._components:
                code = running.returncode()
                if code is not None:
                    raise ControlPlaneError(
                        f"{running.name} exited with status {code} while waiting for {what}; "
                        f"last lines of {running.log_path}:\n{running.log_tail()}"
                    )
            if probe():
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"timed out waiting for {what}; "
                    f"last lines of {component.log_path}:\n{component.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def _api_get(self, path: str) -> tuple[int, str]:
        """GET ``path`` from the apiserver as cluster-admin: (status, body); 0 if unreachable."""
        return _http_get(f"{self.server}{path}", self._admin_tls)

    def _node_ready(self, name: str) -> bool:
        status, body = self._api_get(f"/api/v1/nodes/{name}")
        if status != 200:
            return False
        conditions = json.loads(body).get("status", {}).get("conditions", [])
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _http_get(url: str, tls: ssl.SSLContext | None, timeout: float = 5.0) -> tuple[int, str]:
    """GET ``url`` bypassing any proxy settings: (status, body), or (0, "") if unreachable."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if tls is not None:
        handlers.append(urllib.request.HTTPSHandler(context=tls))
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(url, timeout=timeout) as response:
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return 0, ""


def _answers_ok(url: str, tls: ssl.SSLContext | None) -> bool:
    return _http_get(url, tls)[0] == 200

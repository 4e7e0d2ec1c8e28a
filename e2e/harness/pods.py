"""Run a pod's container as a local process, with exactly the configuration it would get.

Pods on kwok's fake nodes never run. The e2e tests read the pod template the operator
wrote (a scheduler Deployment, a node-agent DaemonSet), materialize its volumes the way
kubelet would (ConfigMap and Secret keys as files, ``items`` honoured, emptyDirs), and
start its command as a child process. Only what a local process must differ in is
rewritten, each explicitly:

- mount paths become directories under the test's work dir (``/etc/tangram`` → ``…/etc-
  tangram``); host paths the agent needs from this machine (the cgroup tree, the Docker
  socket) stay as they are, its state directory moves under the work dir;
- ``$(VAR)`` references resolve from the container's ``env`` (``fieldRef: spec.nodeName``
  gives the fake node's name);
- a listening address becomes 127.0.0.1 and a free port; a ``ws://<service>.svc`` URL
  becomes the local scheduler's; the ServiceAccount the pod would mount becomes a
  kubeconfig of the same account (``KUBECONFIG``).
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.controlplane import Component, free_ports

KubectlJson = Callable[..., Any]
"""``kubectl get …`` as parsed JSON: (kind, name, namespace) -> object."""

REAL_HOST_PATHS = ("/sys/fs/cgroup", "/var/run/docker.sock")


def free_port() -> int:
    """A free port below the ephemeral range, which an outgoing connection cannot take
    before its server binds it (:func:`harness.controlplane.free_ports`)."""
    return free_ports(1)[0]


@dataclass
class LocalPod:
    """A container of a pod template, ready to run here."""

    argv: list[str]
    env: dict[str, str]
    mounts: dict[str, Path] = field(default_factory=dict)  # mountPath -> local dir


def _write_items(
    data: Mapping[str, str], items: list[dict[str, Any]] | None, target: Path, decode: bool
) -> None:
    target.mkdir(parents=True, exist_ok=True)
    chosen = [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]
    for key, path in chosen:
        value = data[key]
        raw = base64.b64decode(value) if decode else value.encode()
        out = target / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(raw)
        out.chmod(0o600)


def _volume_source(volume: dict[str, Any], namespace: str, get: KubectlJson, target: Path) -> None:
    # A configMap or secret volume is a projected volume of one source.
    sources = volume["projected"]["sources"] if "projected" in volume else [volume]
    target.mkdir(parents=True, exist_ok=True)
    for source in sources:
        if "configMap" in source:
            cm = get("configmap", source["configMap"]["name"], namespace)
            _write_items(cm.get("data", {}), source["configMap"].get("items"), target, False)
        elif "secret" in source:
            ref = source["secret"]
            secret = get("secret", ref.get("secretName") or ref["name"], namespace)
            _write_items(secret.get("data", {}), ref.get("items"), target, True)
        # emptyDir, hostPath: the directory itself


def local_pod(
    template: dict[str, Any],
    namespace: str,
    get: KubectlJson,
    work: Path,
    *,
    node: str,
    container: str | None = None,
) -> LocalPod:
    """The container of ``template`` (a pod template spec's parent: has ``spec``) as argv
    and env, its volumes written under ``work``."""
    spec = template["spec"]
    c = next(x for x in spec["containers"] if container in (None, x["name"]))
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts: dict[str, Path] = {}
    for m in c.get("volumeMounts", []):
        volume = volumes[m["name"]]
        host = (volume.get("hostPath") or {}).get("path")
        if host in REAL_HOST_PATHS:
            mounts[m["mountPath"]] = Path(host)
            continue
        target = work / m["mountPath"].strip("/").replace("/", "-")
        _volume_source(volume, namespace, get, target)
        mounts[m["mountPath"]] = target
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
            env[e["name"]] = node
    argv = [_expand(arg, env) for arg in [*c.get("command", []), *c.get("args", [])]]
    return LocalPod(argv=[_remap(a, mounts) for a in argv], env=env, mounts=mounts)


def _expand(arg: str, env: Mapping[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)


def _remap(arg: str, mounts: Mapping[str, Path]) -> str:
    for mount, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if arg == mount or arg.startswith(mount + "/"):
            return str(local) + arg[len(mount) :]
    return arg


def replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with the value after ``flag`` replaced (the flag must be there)."""
    i = argv.index(flag)
    return [*argv[: i + 1], value, *argv[i + 2 :]]


class Process(Component):
    """A child in its own process group, logging to a file, killed with the test run;
    stopped with SIGTERM, then SIGKILL."""

    def __init__(
        self, name: str, argv: list[str], env: Mapping[str, str], log: Path, cwd: Path
    ) -> None:
        super().__init__(name, argv, log)
        self.start({**os.environ, **env}, cwd)

    def tail(self, lines: int = 40) -> str:
        return self.log_tail(lines)

    def stop(self, grace_s: float = 20.0) -> None:
        super().stop(grace_s)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0, every: float = 0.5) -> Any:
    """Poll ``check`` until it returns something truthy; its last exception or value in the
    error when the time is up."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = check()
            if value:
                return value
            last = value
        except Exception as e:  # the thing is not there yet
            last = e
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})"
            )
        time.sleep(every)


def kubectl_json(kubectl: Callable[..., subprocess.CompletedProcess[str]]) -> KubectlJson:
    def get(kind: str, name: str, namespace: str | None = None) -> Any:
        args = ["get", kind, name, "-o", "json"]
        if namespace:
            args += ["-n", namespace]
        return json.loads(kubectl(*args).stdout)

    return get


__all__ = [
    "LocalPod",
    "Process",
    "free_port",
    "kubectl_json",
    "local_pod",
    "replace_flag",
    "wait_for",
]

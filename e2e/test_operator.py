"""End to end: Helm install, the operator, pools from the examples, clients with
ServiceAccount tokens running commands in real containers, edits, deletion, uninstall.

One real control plane (``control_plane``), the chart installed with the admin's
kubeconfig, and the operator running as a local process authenticated as the chart's
ServiceAccount (missing RBAC fails here). Pods on kwok's fake nodes never run, so each
pool's scheduler and node agent run as local processes started from the pod templates
the operator wrote (:mod:`harness.pods`); environments are containers of the real Docker
Engine. The tests share state and run in file order, like one user's session.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from harness.controlplane import ControlPlane, KubectlError
from harness.pods import Process, free_port, kubectl_json, local_pod, replace_flag, wait_for
from tests.integration.http_stub import JsonHandler, http_serving

from tangram.client import Client, TangramError
from tangram.operator.reconciler import DRAIN_POLL_S

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "arl-tangram"
EXAMPLES = ROOT / "manifests" / "examples"
TANGRAM = str(Path(sys.executable).parent / "tangram")
RELEASE, SYSTEM = "arl-tangram", "tangram-system"
SANDBOX_NODE = "sandbox-0"
# The examples name images of a real registry; nothing is pulled here, so the test image
# is tagged under their names in the local Docker Engine.
EXAMPLE_IMAGES = ("ghcr.io/example/swe-env:latest", "ghcr.io/example/python-scratch:latest")


@dataclass
class Stack:
    cp: ControlPlane
    bin: Path
    work: Path
    endpoints: Path
    processes: dict[str, Process] = field(default_factory=dict)

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.cp.kubectl(*args, **kw)

    def get(self, kind: str, name: str, namespace: str | None = None) -> Any:
        return kubectl_json(self.cp.kubectl)(kind, name, namespace)

    def exists(self, kind: str, name: str, namespace: str | None = None) -> bool:
        args = ["get", kind, name, "--ignore-not-found", "-o", "name"]
        if namespace:
            args += ["-n", namespace]
        return bool(self.kubectl(*args).stdout.strip())

    def helm(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bin / "helm"), f"--kubeconfig={self.cp.admin_kubeconfig}", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, f"helm {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Process:
        if argv[0] == "tangram":
            argv = [TANGRAM, *argv[1:]]
        proc = Process(name, argv, env, self.work / f"{name}.log", self.work)
        self.processes[name] = proc
        return proc

    def set_endpoint(self, pool: str, url: str) -> None:
        table = yaml.safe_load(self.endpoints.read_text()) or {}
        table[pool] = url
        self.endpoints.write_text(yaml.safe_dump(table))

    def ready(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        """The Ready condition of an object, if it has one."""
        conditions = (self.get(kind, name, namespace).get("status") or {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == "Ready"), None)

    def wait_ready(
        self, kind: str, name: str, namespace: str, reason: str = "Ready", timeout: float = 90
    ) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            cond = self.ready(kind, name, namespace)
            return cond if cond is not None and cond["reason"] == reason else None

        try:
            found: dict[str, Any] = wait_for(f"{kind} {name} {reason}", check, timeout)
        except TimeoutError as e:
            logs = "\n".join(f"--- {p.name}\n{p.tail()}" for p in self.processes.values())
            raise AssertionError(f"{e}\n{logs}") from None
        return found

    def stop(self, name: str) -> None:
        proc = self.processes.pop(name, None)
        if proc is not None:
            proc.stop()


def _docker_images(client: Any) -> None:
    from tests.integration.docker_engine import coding_image

    if client is None:
        pytest.skip("no Docker Engine")
    image = coding_image(client)
    if image is None:
        pytest.skip("the coding test image cannot be built here (needs root and debootstrap)")
    for name in EXAMPLE_IMAGES:
        repository, tag = name.rsplit(":", 1)
        client.images.get(image).tag(repository, tag)


@pytest.fixture(scope="module")
def stack(
    control_plane: ControlPlane, e2e_bin_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    sys.path.insert(0, str(ROOT))
    from tests.integration.docker_engine import engine

    docker = contextlib.contextmanager(engine)()  # started here if none runs; stopped last
    _docker_images(docker.__enter__())
    work = tmp_path_factory.mktemp("stack")
    endpoints = work / "scheduler-endpoints.yaml"
    endpoints.write_text("{}\n")
    s = Stack(control_plane, e2e_bin_dir, work, endpoints)
    control_plane.add_fake_node("system-0")  # for the operator's and schedulers' pods
    control_plane.add_fake_node(SANDBOX_NODE, {"tangram.dev/role": "sandbox"})
    try:
        yield s
    finally:
        for name in list(s.processes):
            s.stop(name)
        docker.__exit__(None, None, None)


def _start_operator(s: Stack) -> int:
    """The operator as the chart's Deployment runs it, as the chart's ServiceAccount; the
    port of its liveness endpoint."""
    deployment = s.get("deployment", RELEASE, SYSTEM)
    template = deployment["spec"]["template"]
    account = template["spec"]["serviceAccountName"]
    kubeconfig = s.cp.service_account_kubeconfig(SYSTEM, account, s.work / "operator.kubeconfig")
    pod = local_pod(template, SYSTEM, kubectl_json(s.kubectl), s.work / "operator", node="system-0")
    port = free_port()
    argv = replace_flag(pod.argv, "--liveness-port", str(port))
    argv += ["--kubeconfig", str(kubeconfig), "--scheduler-endpoints", str(s.endpoints)]
    s.start("operator", argv, pod.env)
    return port


def _start_scheduler(s: Stack, pool: str, namespace: str, port: int | None = None) -> str:
    """The pool's scheduler from its Deployment (``port``: where it ran before); its URL."""
    name = f"tangram-{pool}-scheduler"
    deployment = wait_for(
        f"Deployment {name}", lambda: s.get("deployment", name, namespace), timeout=60
    )
    template = deployment["spec"]["template"]
    work = s.work / pool
    pod = local_pod(template, namespace, kubectl_json(s.kubectl), work, node="system-0")
    port = port or free_port()
    argv = replace_flag(replace_flag(pod.argv, "--host", "127.0.0.1"), "--port", str(port))
    kubeconfig = s.cp.service_account_kubeconfig(
        namespace, template["spec"]["serviceAccountName"], work / "scheduler.kubeconfig"
    )
    s.start(f"{pool}-scheduler", argv, {**pod.env, "KUBECONFIG": str(kubeconfig)})
    url = f"http://127.0.0.1:{port}"
    wait_for(f"{pool} scheduler", lambda: httpx.get(f"{url}/healthz").status_code == 200, 60)
    s.set_endpoint(f"{namespace}/{pool}", url)
    return url


def _start_agent(s: Stack, pool: str, namespace: str, url: str, role: str = "cpu") -> Process:
    """The pool's node agent on the sandbox node, from its DaemonSet."""
    ds = s.get("daemonset", f"tangram-{pool}-{role}-agent", namespace)
    work = s.work / f"{pool}-{role}-agent"
    pod = local_pod(ds["spec"]["template"], namespace, kubectl_json(s.kubectl), work,
                    node=SANDBOX_NODE)  # fmt: skip
    argv = replace_flag(pod.argv, "--scheduler", url.replace("http://", "ws://") + "/v1/agents")
    # kwok's fake node runs no pods, so this agent runs its sandboxes as containers of the
    # Docker Engine; the pod runtime the DaemonSet names runs on the real kubelet in
    # test_pod_runtime.py.
    argv = replace_flag(argv, "--runtime", "docker")
    state = pod.argv[pod.argv.index("--state-dir") + 1]
    argv = replace_flag(argv, "--state-dir", str(work / state.strip("/").replace("/", "-")))
    return s.start(f"{pool}-{role}-agent", argv, pod.env)


def _token(s: Stack, namespace: str, account: str) -> str:
    if not s.exists("serviceaccount", account, namespace):
        s.kubectl("create", "serviceaccount", account, "-n", namespace)
    return s.kubectl("create", "token", account, "-n", namespace).stdout.strip()


def _apply(s: Stack, text: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return s.kubectl("apply", "-f", "-", stdin=text, check=check)


# ---- the session ---------------------------------------------------------------------


def test_helm_install_brings_the_crds_and_the_operator(stack: Stack) -> None:
    stack.helm("install", RELEASE, str(CHART), "-n", SYSTEM, "--create-namespace", "--wait",
               "--timeout", "120s")  # fmt: skip
    resources = stack.kubectl("api-resources", "--api-group=tangram.dev", "-o", "name").stdout
    assert set(resources.split()) == {
        "actionpools.tangram.dev",
        "rewardservices.tangram.dev",
        "trajectoryenvs.tangram.dev",
    }
    short = stack.kubectl("api-resources", "--api-group=tangram.dev").stdout
    assert " ap " in short and " tenv " in short and " rsvc " in short
    port = _start_operator(stack)
    # kopf answers its liveness probe once it is logged in and watching.
    try:
        wait_for(
            "the operator's liveness endpoint",
            lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200,
            60,
        )
    except TimeoutError as e:
        raise AssertionError(f"{e}\n{stack.processes['operator'].tail()}") from None


INVALID = [
    (  # a pool with nothing to pool (CEL)
        "apiVersion: tangram.dev/v1alpha1\nkind: ActionPool\n"
        "metadata: {name: empty, namespace: default}\nspec: {}\n",
        "a pool needs cpu, gpu or apis",
    ),
    (  # DoP choices are powers of two up to 8 (enum)
        "apiVersion: tangram.dev/v1alpha1\nkind: RewardService\n"
        "metadata: {name: judge, namespace: default}\n"
        "spec: {poolRef: p, entrypoint: 'm:f', weights: /w, gpuMemoryGiB: 10, dopChoices: [3]}\n",
        'spec.dopChoices[0]: Unsupported value: 3: supported values: "1", "2", "4", "8"',
    ),
    (  # a pool's name goes into its Service's, a DNS label (CEL on metadata.name)
        "apiVersion: tangram.dev/v1alpha1\nkind: ActionPool\n"
        f"metadata: {{name: {'p' * 46}, namespace: default}}\n"
        "spec: {apis: [{name: search, concurrency: 1}]}\n",
        "metadata.name: at most 45 characters",
    ),
    (
        "apiVersion: tangram.dev/v1alpha1\nkind: TrajectoryEnv\n"
        "metadata: {name: dotted.name, namespace: default}\nspec: {poolRef: p, image: x}\n",
        "metadata.name: lower-case letters, digits and '-'",
    ),
    (  # a quota needs a limit (CEL)
        "apiVersion: tangram.dev/v1alpha1\nkind: ActionPool\n"
        "metadata: {name: q, namespace: default}\nspec: {apis: [{name: search}]}\n",
        "set concurrency, rate or both",
    ),
]


@pytest.mark.parametrize(("manifest", "message"), INVALID)
def test_invalid_resources_are_refused_by_the_api_server(
    stack: Stack, manifest: str, message: str
) -> None:
    done = _apply(stack, manifest, check=False)
    assert done.returncode != 0 and message in done.stderr, done.stderr


def test_examples_become_ready_with_their_figures(stack: Stack) -> None:
    for ns in ("rl", "rl-eval", "outsider"):
        stack.kubectl("create", "namespace", ns)
    for example in ("coding", "deepsearch", "mopd"):
        stack.kubectl("apply", "-f", str(EXAMPLES / example / "pool.yaml"))
    # The examples size nodes of 64 cores; this machine has 2: one for actions, one idle.
    stack.kubectl("patch", "ap", "coding", "-n", "rl", "--type=merge",
                  "-p", '{"spec": {"cpu": {"coresPerNode": 1, "idleCores": 1}}}')  # fmt: skip
    # The test image has python3 and pytest but no git, which the example's setup runs.
    env_patch = {"spec": {"warmPool": 1, "memoryGiB": 1,
                          "setup": [["python3", "-c", "import pytest"]]}}  # fmt: skip
    stack.kubectl("patch", "tenv", "swe", "-n", "rl", "--type=merge", "-p", json.dumps(env_patch))

    def patched() -> bool:
        config = stack.get("configmap", "tangram-coding-config", "rl")["data"]["pool.yaml"]
        agents = stack.get("daemonset", "tangram-coding-cpu-agent", "rl")
        command = agents["spec"]["template"]["spec"]["containers"][0]["command"]
        return "coresPerNode: 1" in config and "warmPool: 1" in config and "60" not in command

    wait_for("the operator to apply the patches", patched, 60)
    url = _start_scheduler(stack, "coding", "rl")
    _start_agent(stack, "coding", "rl", url)
    cond = stack.wait_ready("ap", "coding", "rl")
    assert cond["status"] == "True"
    status = stack.get("ap", "coding", "rl")["status"]
    assert (status["nodes"], status["cores"]) == (1, 1)
    assert status["endpoint"] == "http://tangram-coding-scheduler.rl.svc:8080"
    assert status["observedGeneration"] == stack.get("ap", "coding", "rl")["metadata"]["generation"]
    assert stack.wait_ready("tenv", "swe", "rl", "Accepted")["status"] == "True"

    # API quotas only: Ready without any node; its credentials come from the Secret
    # through the API server (the scheduler's Role names exactly that Secret).
    _start_scheduler(stack, "deepsearch", "rl")
    stack.wait_ready("ap", "deepsearch", "rl")
    assert sorted(stack.get("ap", "deepsearch", "rl")["status"]["apis"]) == ["browse", "search"]
    role = stack.get("role", "tangram-deepsearch-scheduler", "rl")
    secrets_rule = next(r for r in role["rules"] if r["resources"] == ["secrets"])
    assert secrets_rule["resourceNames"] == ["search-api-keys"]

    # The MOPD pool's members are accepted once its scheduler took them (not served
    # before: no scheduler runs it yet), and its GPU agents are declared; no node here has
    # a GPU, so no agent pod is scheduled and the pool says so.
    cond = stack.wait_ready("rsvc", "judge", "rl", "NotServed")
    assert cond["status"] == "False" and "ActionPool rl/mopd" in cond["message"]
    _start_scheduler(stack, "mopd", "rl")
    for service in ("judge", "math-teacher", "code-teacher"):
        stack.wait_ready("rsvc", service, "rl", "Accepted")
    assert stack.exists("daemonset", "tangram-mopd-gpu-agent", "rl")
    cond = stack.wait_ready("ap", "mopd", "rl", "NoNodes")
    assert "tangram-mopd-gpu-agent" in cond["message"]

    table = stack.kubectl("get", "ap", "-n", "rl").stdout
    header = table.splitlines()[0].split()
    assert header[:6] == ["NAME", "READY", "NODES", "CORES", "GPUS", "QUEUE"]


def test_an_invalid_member_gets_a_condition_and_an_event(stack: Stack) -> None:
    manifest = (
        "apiVersion: tangram.dev/v1alpha1\nkind: TrajectoryEnv\n"
        "metadata: {name: upside-down, namespace: rl}\n"
        "spec: {poolRef: coding, image: x, cpu: {min: 4, max: 2}}\n"
    )
    _apply(stack, manifest)  # the API server cannot check a union: the operator does
    cond = stack.wait_ready("tenv", "upside-down", "rl", "InvalidSpec")
    assert cond["status"] == "False" and "spec.cpu" in cond["message"]
    orphan = (
        "apiVersion: tangram.dev/v1alpha1\nkind: TrajectoryEnv\n"
        "metadata: {name: orphan, namespace: rl}\nspec: {poolRef: nowhere, image: x}\n"
    )
    _apply(stack, orphan)
    cond = stack.wait_ready("tenv", "orphan", "rl", "PoolNotFound")
    assert "no ActionPool rl/nowhere" in cond["message"]
    events = stack.kubectl(
        "get", "events", "-n", "rl", "--field-selector", "involvedObject.name=orphan", "-o", "json"
    ).stdout
    assert any(e["reason"] == "PoolNotFound" for e in json.loads(events)["items"])
    # A pool that does not admit the member's namespace.
    stranger = orphan.replace("orphan", "stranger").replace("namespace: rl", "namespace: outsider")
    _apply(stack, stranger.replace("poolRef: nowhere", "poolRef: rl/coding"))
    cond = stack.wait_ready("tenv", "stranger", "outsider", "NamespaceNotAdmitted")
    assert "spec.access.namespaces" in cond["message"]
    # A pool whose spec only the operator can refuse: it and its members say so.
    broken = (
        "apiVersion: tangram.dev/v1alpha1\nkind: ActionPool\n"
        "metadata: {name: broken, namespace: rl}\n"
        "spec: {cpu: {}, scheduler: {resources: {requests: {cpu: lots}}}}\n"
    )
    _apply(stack, broken)
    _apply(stack, orphan.replace("orphan", "stray").replace("nowhere", "broken"))
    cond = stack.wait_ready("ap", "broken", "rl", "InvalidSpec")
    assert "requests.cpu: 'lots' is not a quantity" in cond["message"]
    cond = stack.wait_ready("tenv", "stray", "rl", "PoolInvalid")
    assert cond["message"].startswith("ActionPool rl/broken is invalid: ")
    assert "'lots' is not a quantity" in cond["message"]
    # One only the API server refuses, in a child: an extended resource's request below
    # its limit (they cannot be overcommitted).
    fpga = {"requests": {"example.com/fpga": "1"}, "limits": {"example.com/fpga": "2"}}
    overcommitted = {"apiVersion": "tangram.dev/v1alpha1", "kind": "ActionPool",
                     "metadata": {"name": "overcommitted", "namespace": "rl"},
                     "spec": {"cpu": {}, "scheduler": {"resources": fpga}}}  # fmt: skip
    _apply(stack, yaml.safe_dump(overcommitted))
    cond = stack.wait_ready("ap", "overcommitted", "rl", "InvalidSpec")
    assert cond["message"].startswith(
        "the API server refused the spec's Deployment tangram-overcommitted-scheduler: "
    ), cond
    stack.kubectl("delete", "tenv", "stray", "-n", "rl")
    stack.kubectl("delete", "ap", "broken", "-n", "rl")
    stack.kubectl("delete", "ap", "overcommitted", "-n", "rl")
    for name, ns in (("upside-down", "rl"), ("orphan", "rl"), ("stranger", "outsider")):
        stack.kubectl("delete", "tenv", name, "-n", ns)


def _gone(stack: Stack, kind: str, name: str) -> bool:
    return not stack.exists(kind, name, "rl")


def _coding_url(stack: Stack) -> str:
    url: str = yaml.safe_load(stack.endpoints.read_text())["rl/coding"]
    return url


def test_service_account_clients_run_commands_in_real_containers(stack: Stack) -> None:
    url = _coding_url(stack)
    worker = _token(stack, "rl", "rollout-worker")
    with Client(url, worker) as client, client.trajectory("swe") as t:
        result = t.exec(["python3", "-c", "import os; print(6 * 7, os.getuid())"])
        assert result.status.value == "ok", result
        assert result.stdout == "42 1000\n"  # in the image's container, as its user
        assert result.allocation is not None and result.allocation.node == SANDBOX_NODE
        # Another account of the same namespace is admitted, but it is another tenant.
        with Client(url, _token(stack, "rl", "someone-else")) as other:
            with pytest.raises(TangramError) as e:
                other.get(t.id)
            assert e.value.status == 404
        # An account of a namespace the pool does not admit is refused outright.
        with Client(url, _token(stack, "outsider", "intruder")) as intruder:
            with pytest.raises(TangramError) as e:
                intruder.get(t.id)
            assert e.value.status == 403 and "spec.access" in str(e.value)
    bogus = httpx.get(f"{url}/v1/trajectories/x", headers={"Authorization": "Bearer nope" * 4})
    assert bogus.status_code == 401


def test_editing_an_env_takes_effect_without_a_restart(stack: Stack) -> None:
    url = _coding_url(stack)
    scheduler = stack.processes["coding-scheduler"]
    pid = scheduler.pid
    worker = _token(stack, "rl", "rollout-worker")
    with Client(url, worker) as client, client.trajectory("swe") as t:
        assert t.exec(["true"]).status.value == "ok"
        patch = {"spec": {"actions": [
            {"name": "shell", "cpu": 1, "timeoutSeconds": 300},
            {"name": "greet", "command": ["echo", "edited", "{dop}"], "cpu": 1},
        ]}}  # fmt: skip
        stack.kubectl("patch", "tenv", "swe", "-n", "rl", "--type=merge", "-p", json.dumps(patch))

        def greeted() -> bool:
            return t.exec(profile="greet").stdout == "edited 1\n"

        wait_for("the new profile to be served", greeted, timeout=60, every=1)
        assert t.exec(["echo", "same trajectory"]).status.value == "ok"
    assert scheduler.alive() and scheduler.pid == pid


def _secret(stack: Stack, name: str, value: str) -> None:
    literal = f"--from-literal=key={value}"
    manifest = stack.kubectl("create", "secret", "generic", name, "-n", "rl", literal,
                             "--dry-run=client", "-o", "yaml")  # fmt: skip
    _apply(stack, manifest.stdout)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class _EchoApi(JsonHandler):
    """A web API on 127.0.0.1 that answers with a digest of the credential it was sent
    (the service never returns a credential as it is)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server names it)
        self.answer(200, {"authorization": _digest(self.headers.get("Authorization") or "")})


def test_a_deleted_env_leaves_its_running_scheduler(stack: Stack) -> None:
    """A member has no finalizer: its deletion is seen as the watch's DELETED event, and
    the pool's scheduler stops serving it then, not at the next full pass (300 s)."""
    url = _coding_url(stack)
    worker = _token(stack, "rl", "rollout-worker")
    swe = stack.get("tenv", "swe", "rl")
    extra = {"apiVersion": swe["apiVersion"], "kind": "TrajectoryEnv",
             "metadata": {"name": "extra", "namespace": "rl"}, "spec": swe["spec"]}  # fmt: skip
    with Client(url, worker, retries=0) as client:

        def served() -> bool:
            try:
                with client.trajectory("extra"):
                    return True
            except TangramError as e:
                assert e.status == 404, e
                return False

        try:
            _apply(stack, yaml.safe_dump(extra))
            stack.wait_ready("tenv", "extra", "rl", "Accepted")
            wait_for("the new env to be served", served, timeout=60, every=1)
        finally:
            stack.kubectl("delete", "tenv", "extra", "-n", "rl", check=False)
        wait_for("the deleted env to go", lambda: not served(), timeout=60, every=1)
        with client.trajectory("swe") as t:  # the others are still served
            assert t.exec(["true"]).status.value == "ok"


def test_a_refused_spec_and_a_rotated_secret_show_on_the_pool_and_reach_its_scheduler(
    stack: Stack,
) -> None:
    with http_serving(_EchoApi) as echo:
        quota = {"name": "echo", "concurrency": 2, "endpoint": echo,
                 "secretRef": {"name": "echo-key", "key": "key"}}  # fmt: skip
        pool = {"apiVersion": "tangram.dev/v1alpha1", "kind": "ActionPool",
                "metadata": {"name": "echo", "namespace": "rl"},
                "spec": {"apis": [quota]}}  # fmt: skip
        try:
            _secret(stack, "echo-key", "first")
            _apply(stack, yaml.safe_dump(pool))
            url = _start_scheduler(stack, "echo", "rl")
            stack.wait_ready("ap", "echo", "rl")
            worker = _token(stack, "rl", "rollout-worker")
            with Client(url, worker) as client:

                def seen() -> str:
                    result = client.call("echo", "/")
                    assert result.status.value == "ok", result
                    return str(result.output["body"]["authorization"])

                assert seen() == _digest("Bearer first")
                # A rotated key reaches the running scheduler (the operator watches the Secret
                # through its resourceVersion and pushes the pool again).
                _secret(stack, "echo-key", "second")
                second = _digest("Bearer second")
                wait_for("the rotated key", lambda: seen() == second, timeout=60, every=1)

                # A quota naming a Secret that does not exist: the scheduler refuses the new
                # definitions and keeps serving the old ones; the pool says so.
                missing = {
                    **quota,
                    "name": "echo-two",
                    "secretRef": {"name": "absent", "key": "key"},
                }
                patch = {"spec": {"apis": [quota, missing]}}
                stack.kubectl(
                    "patch", "ap", "echo", "-n", "rl", "--type=merge", "-p", json.dumps(patch)
                )
                cond = stack.wait_ready("ap", "echo", "rl", "ConfigRefused", timeout=60)
                assert cond["status"] == "False"
                assert "apis[echo-two].secretRef" in cond["message"] and "absent" in cond["message"]
                assert seen() == _digest("Bearer second")
                events = stack.kubectl("get", "events", "-n", "rl", "--field-selector",
                                       "involvedObject.name=echo", "-o", "json").stdout  # fmt: skip
                assert any(e["reason"] == "ConfigRefused" for e in json.loads(events)["items"])
                # Its scheduler restarts (its pod rescheduled) and reads the refused
                # definitions from the ConfigMap: it starts, serves the quota it can, and
                # refuses the other's calls, saying why, until the Secret exists.
                stack.stop("echo-scheduler")
                _start_scheduler(stack, "echo", "rl", port=httpx.URL(url).port)
                assert seen() == _digest("Bearer second")
                with pytest.raises(TangramError) as e:
                    client.call("echo-two", "/")
                assert e.value.status == 502 and "apis[echo-two].secretRef" in str(e.value)
                stack.wait_ready("ap", "echo", "rl", "ConfigRefused", timeout=60)
                # Once the Secret exists the same definitions are taken.
                _secret(stack, "absent", "third")
                stack.wait_ready("ap", "echo", "rl", timeout=60)
                assert sorted(stack.get("ap", "echo", "rl")["status"]["apis"]) == [
                    "echo",
                    "echo-two",
                ]
        finally:
            stack.kubectl(
                "delete", "ap", "echo", "-n", "rl", "--wait=true", timeout=120, check=False
            )
            stack.stop("echo-scheduler")


def test_deleting_a_pool_drains_then_removes_everything(stack: Stack) -> None:
    url = _coding_url(stack)
    worker = _token(stack, "rl", "rollout-worker")
    with Client(url, worker, retries=0) as client:  # a 503 is the answer, not a retry
        t = client.trajectory("swe").__enter__()

        # An edit the operator refuses leaves the scheduler running the spec before, and
        # the status what it showed of it; nor does it skip the drain below.
        def shown() -> dict[str, Any]:
            status: dict[str, Any] = stack.get("ap", "coding", "rl")["status"]
            return status

        wait_for("the trajectory in the status", lambda: shown().get("trajectories") == 1, 60)
        endpoint = shown()["endpoint"]
        bad = {"spec": {"scheduler": {"resources": {"requests": {"cpu": "lots"}}}}}
        stack.kubectl("patch", "ap", "coding", "-n", "rl", "--type=merge", "-p", json.dumps(bad))
        stack.wait_ready("ap", "coding", "rl", "InvalidSpec")
        assert shown()["endpoint"] == endpoint and shown()["trajectories"] == 1
        assert t.exec(["true"]).status.value == "ok"
        stack.kubectl("delete", "ap", "coding", "-n", "rl", "--wait=false")
        cond = stack.wait_ready("ap", "coding", "rl", "Draining")
        assert "1 trajectories still open" in cond["message"]
        with pytest.raises(TangramError) as e:
            client.trajectory("swe").__enter__()
        assert e.value.status == 503
        # The scheduler restarts mid-drain (its pod rescheduled): the pool waits for it,
        # and the trajectory its agent holds goes on once it is back.
        stack.stop("coding-scheduler")

        def waiting() -> bool:
            cond = stack.ready("ap", "coding", "rl") or {}
            return "waiting for its scheduler" in cond.get("message", "")

        wait_for("the drain to wait for the scheduler", waiting, 60)
        time.sleep(3 * DRAIN_POLL_S)  # more passes of the finalizer: each one waits again
        assert stack.exists("ap", "coding", "rl") and waiting()
        _start_scheduler(stack, "coding", "rl", port=httpx.URL(url).port)
        finishing = partial(t.exec, ["echo", "finishing"])
        assert (
            wait_for("the trajectory back", lambda: finishing().stdout, 60, every=1)
            == "finishing\n"
        )
        t.__exit__(None, None, None)
    wait_for("the pool to go", lambda: not stack.exists("ap", "coding", "rl"), 60)
    # Its environment stays, and now says that it names no pool.
    stack.wait_ready("tenv", "swe", "rl", "PoolNotFound")
    for kind, name in (
        ("deployment", "tangram-coding-scheduler"),
        ("daemonset", "tangram-coding-cpu-agent"),
        ("configmap", "tangram-coding-config"),
        ("secret", "tangram-coding-tokens"),
        ("serviceaccount", "tangram-coding-scheduler"),
    ):
        wait_for(f"{kind} {name} to be collected", partial(_gone, stack, kind, name), 60)
    assert not stack.exists("clusterrole", "tangram-rl.coding-tokenreview")
    assert not stack.exists("clusterrolebinding", "tangram-rl.coding-tokenreview")
    stack.stop("coding-cpu-agent")
    stack.stop("coding-scheduler")


def test_helm_upgrade_and_uninstall_leave_nothing_behind(stack: Stack) -> None:
    stack.helm("upgrade", RELEASE, str(CHART), "-n", SYSTEM, "--reuse-values",
               "--set", "crds.keep=false", "--wait", "--timeout", "120s")  # fmt: skip
    crd = stack.get("crd", "actionpools.tangram.dev")
    assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})
    for pool in ("deepsearch", "deepsearch-cpu", "mopd"):
        stack.kubectl("delete", "ap", pool, "-n", "rl", "--wait=false")
    wait_for("every pool to go", lambda: not stack.kubectl("get", "ap", "-A", "-o", "name").stdout,
             120)  # fmt: skip
    stack.stop("operator")
    stack.stop("deepsearch-scheduler")
    stack.helm("uninstall", RELEASE, "-n", SYSTEM, "--wait")
    left = stack.kubectl(
        "get", "deployment,serviceaccount,clusterrole,clusterrolebinding,service,configmap",
        "-A", "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name",
    ).stdout  # fmt: skip
    assert left.strip() == ""
    crds = stack.kubectl("get", "crd", "-o", "name").stdout
    assert "tangram.dev" not in crds
    with pytest.raises(KubectlError):
        stack.kubectl("get", "clusterrole", "tangram-rl.deepsearch-tokenreview")

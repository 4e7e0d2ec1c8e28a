"""``tangram up -f FILE_OR_DIR…``: embedded mode — the scheduler and a local node agent.

Reads the same ActionPool / TrajectoryEnv / RewardService documents ``kubectl apply``
takes, serves the pool on 127.0.0.1, and runs one node agent for this machine: the Docker
runtime (without a Docker Engine, ``--runtime process`` runs commands on this host with no
isolation, only when asked for by name). Ctrl-C stops admitting, lets in-flight actions
finish (``--grace``), and removes every environment.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import shlex
import signal
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.text import Text

from tangram.api.demand import allowed_units
from tangram.api.documents import Resources
from tangram.api.resources import ActionPool
from tangram.cli.events import say, warn
from tangram.cli.files import (
    InputError,
    check_writable,
    documented_command,
    port,
    seconds,
    whole_number,
)
from tangram.cli.manifests import load_documents, load_text
from tangram.client.common import DEFAULT_TOKEN_FILE
from tangram.node_agent.cgroups import format_cpulist
from tangram.node_agent.link import SchedulerUrlError
from tangram.node_agent.runtimes import help_text as runtime_help
from tangram.node_agent.runtimes import names as runtime_names
from tangram.scheduler.core.gpu_pool import gb_per_gpu, holds
from tangram.service.auth import AGENT_TENANT, TokenError, TokenStore
from tangram.service.config import PoolConfig
from tangram.service.embedded import Running, Stopping, run
from tangram.service.from_resources import (
    PoolChoiceError,
    SecretLookup,
    choose_pool,
    pool_config,
)
from tangram.service.learned_file import LearnedFile, LearnedStore

LOCAL_BUSYBOX = "tangram-local/busybox:"  # images under this name are made, not pulled
SUMMARY = "run the scheduler and a local node agent (embedded mode)"


def register(sub: Any) -> None:
    p = documented_command(sub, "up", SUMMARY, __doc__)
    p.add_argument("-f", "--file", action="append", required=True, help="YAML file or directory")
    p.add_argument(
        "--pool",
        help="the ActionPool to serve when the files declare several: NAME, or NAMESPACE/NAME",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this host)"
    )
    p.add_argument("--port", type=port, default=8080, help="port to serve on (default 8080)")
    add_runtime_flag(p, leave_out=("pod",))  # the operator's: `tangram agent` takes it
    p.add_argument(
        "--cores",
        type=whole_number(1),
        help="cores for actions (default: the pool's spec.cpu.coresPerNode, else every core but "
        "the idle ones; noop: that many virtual cores, else 1024)",
    )
    add_gpu_flags(p)
    p.add_argument(
        "--state-dir",
        default=os.environ.get("TANGRAM_STATE_DIR", str(Path.home() / ".local/state/tangram")),
        help="the agent's state: socket directories, process-runtime workdirs (default: "
        "$TANGRAM_STATE_DIR, else ~/.local/state/tangram)",
    )
    p.add_argument(
        "--token-file",
        default=os.environ.get("TANGRAM_TOKEN_FILE", str(DEFAULT_TOKEN_FILE)),
        help="TOKEN TENANT lines; created with a client and an agent token if missing "
        "(default: $TANGRAM_TOKEN_FILE, else ~/.config/tangram/tokens)",
    )
    add_learned_flag(p, "STATE_DIR/learned/POOL.json")
    add_grace_flag(p)
    add_log_flags(p)
    p.set_defaults(run=run_up)


def add_grace_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--grace",
        type=seconds,
        default=10.0,
        help="seconds in-flight actions get to finish at Ctrl-C or SIGTERM; a second one "
        "cancels them at once (default: 10)",
    )


def setup_logging(args: argparse.Namespace) -> None:
    from tangram.service.logs import setup

    setup(args.verbose, args.log_json)


def add_runtime_flag(p: argparse.ArgumentParser, leave_out: Sequence[str] = ()) -> None:
    """``--runtime``: the registered runtimes but ``leave_out``, each explained, or auto."""
    p.add_argument(
        "--runtime",
        choices=("auto", *(n for n in runtime_names() if n not in leave_out)),
        default="auto",
        help=f"{runtime_help(leave_out)}; auto: docker (never process: name it to run unisolated)",
    )


def add_log_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", help="log every action (INFO)")
    p.add_argument("--log-json", action="store_true", help="one JSON object a log line")


def load_pool(
    files: list[str],
    name: str | None,
    secrets: SecretLookup | None = None,
    *,
    unresolved_ok: bool = False,
) -> tuple[ActionPool, PoolConfig]:
    """The pool to serve from CR documents; every problem named, or InputError.
    ``unresolved_ok``: see :func:`pool_config`."""
    try:
        resources = load_documents(files)
    except ValueError as e:
        raise InputError(str(e)) from None
    return _pool_of(resources, name, secrets, unresolved_ok)


def load_pool_text(
    text: str, name: str | None, secrets: SecretLookup | None = None
) -> tuple[ActionPool, PoolConfig]:
    """As :func:`load_pool`, from pushed documents (``POST /v1/admin/reload``)."""
    try:
        resources = load_text(text, "pushed pool.yaml")
    except ValueError as e:
        raise InputError(str(e)) from None
    return _pool_of(resources, name, secrets)


def _pool_of(
    resources: Resources,
    name: str | None,
    secrets: SecretLookup | None,
    unresolved_ok: bool = False,
    serving: str | None = None,
) -> tuple[ActionPool, PoolConfig]:
    problems = resources.check_references()
    if problems:
        raise InputError("; ".join(problems))
    try:
        pool = choose_pool(resources, name, serving)
        return pool, pool_config(resources, pool, secrets, unresolved_ok=unresolved_ok)
    except PoolChoiceError as e:
        raise InputError(str(e)) from None


def run_up(args: argparse.Namespace) -> int:
    setup_logging(args)
    early = EarlyHangup.install()  # the banner says SIGHUP reloads: never a kill, even now
    pool, config = load_pool(args.file, args.pool)
    check_listen(args.host, args.port)
    tokens = load_tokens(Path(args.token_file))
    if tokens.token_for(AGENT_TENANT) is None:  # found by the embedded run only once serving
        raise InputError(
            f"--token-file {args.token_file}: no {AGENT_TENANT} line (the local agent's token)"
        )
    agent = make_agent(args, config.idle_cores, args.cores or config.cores_per_node)
    try:  # (from here: a Ctrl-C as the warnings are reckoned left the agent running)
        warnings = fit_warnings(
            config,
            host_cores=None if virtual_cores(agent.kind) else len(os.sched_getaffinity(0)),
            memory_gb=agent.inventory.memory_gb,
            action_cores=agent.action_cores,
            idle_cores=agent.idle_cores,
            cores_flag=args.cores,
        ) + gpu_warnings(config, agent.gpu.info if agent.gpu is not None else None, args.gpus)
        warnings += cluster_only_warnings(pool, config, args.port)

        def ready(r: Running) -> None:
            reload_on_hangup(args.file, args.pool, r.engine, early=early)
            say(banner(args, pool, config, agent, r), pool=pool.metadata.name, url=r.url,
                node=agent.node, runtime=agent.kind, pid=os.getpid())  # fmt: skip
            for warning in warnings:  # after the banner, where they are read
                warn(warning)

        _local_images(agent, [e.spec.image for e in config.envs.values()])
        learned = learned_file(args, pool.metadata.name, args.state_dir)
        serve_until_signalled(
            args, config, tokens, agent, ready, close_on_exit=True, learned=learned
        )
    except BaseException:  # a failed start: the run stops the agent only once serving
        shut_down(agent)
        raise
    say("stopped; every environment was removed")
    return 0


def banner(args: argparse.Namespace, pool: ActionPool, config: PoolConfig, agent: Any,
           r: Running) -> Text:  # fmt: skip
    """What ``up`` says once ready: where, what runs, and how to stop and reload it. Styled
    as Text: the names and paths in it are printed as they are, whatever their brackets."""
    runtime: Text | str = agent.kind
    if agent.kind == "docker" and agent.fast_path:
        runtime = f"docker (portable path only: {agent.fast_path})"
    if agent.kind == "process":
        unisolated = " (no isolation: commands run on this host)"
        runtime = Text.assemble(("process", "bold red"), unisolated)
    cores = cores_note(agent.action_cores, agent.idle_cores, virtual_cores(agent.kind))
    flags = rollout_flags(config)
    hint = (
        ""
        if flags is None  # (it opens trajectories: a pool without a TrajectoryEnv has none)
        else f"  try: {_tokens_env(args.token_file)}.venv/bin/python examples/rollout.py "
        + " ".join([f"--url {r.url}", *flags])
        + "\n"
    )
    return Text.assemble(
        ("ARL-Tangram", "bold"), " pool ", (pool.metadata.name, "cyan"), f" ready at {r.url}\n",
        f"  node {agent.node}: {cores}; ", runtime, " runtime\n",
        f"  environments: {', '.join(sorted(config.envs)) or 'none'}; "
        f"RewardServices: {', '.join(sorted(config.services)) or 'none'}; "
        f"API quotas: {', '.join(a.name for a in config.apis) or 'none'}\n"
        f"  token file: {args.token_file}\n"
        f"  {r.engine.learned_note()}\n"
        f"{hint}"
        f"  Ctrl-C stops; kill -HUP {os.getpid()} reloads the files",
    )  # fmt: skip


def cores_note(actions: Sequence[int], idle: Sequence[int], virtual: bool = False) -> str:
    """How many cores go to actions and to idle sandboxes, each with its CPU list (the
    lists alone, ``1`` and ``0``, read as counts)."""

    def part(cores: Sequence[int], what: str) -> str:
        n = len(set(cores))
        if not n:
            return f"no core {what}"
        cpus = f"{'virtual ' if virtual else ''}CPU{'s' if n != 1 else ''}"
        return f"{n} core{'s' if n != 1 else ''} {what} ({cpus} {format_cpulist(cores)})"

    return f"{part(actions, 'for actions')}, {part(idle, 'for idle sandboxes')}"


# What examples/rollout.py opens, runs and leases unless told otherwise: the local example's.
ROLLOUT_DEFAULTS = {
    "--env": "sandbox",
    "--shell-profile": "shell",
    "--tests-profile": "tests",
    "--api": "search",
}


def rollout_flags(config: PoolConfig) -> list[str] | None:
    """The flags examples/rollout.py needs to run against this pool, beyond --url (none for
    manifests/examples/local, whose names are its defaults); None when it cannot: it opens
    trajectories, and the pool has no TrajectoryEnv."""
    if not config.envs:
        return None

    def pick(flag: str, names: Sequence[str]) -> str:  # its default, else the first; '': none
        return ROLLOUT_DEFAULTS[flag] if ROLLOUT_DEFAULTS[flag] in names else min(names, default="")

    env = pick("--env", list(config.envs))
    profiles = config.envs[env].profiles
    chosen = {
        "--env": env,
        # its shell steps bring their own command; its last step runs the profile's
        "--shell-profile": pick(
            "--shell-profile", [n for n, p in profiles.items() if not p.command]
        ),
        "--tests-profile": pick("--tests-profile", [n for n, p in profiles.items() if p.command]),
        "--api": pick("--api", [a.name for a in config.apis]),
    }
    return [
        f"{flag} {shlex.quote(value)}"
        for flag, value in chosen.items()
        if value != ROLLOUT_DEFAULTS[flag]
    ]


def virtual_cores(runtime: str) -> bool:
    """Whether ``runtime``'s cores are virtual (noop): none of this machine's are used."""
    from tangram.node_agent.runtimes import registration

    return registration(runtime).virtual_cores


def fit_warnings(
    config: PoolConfig,
    *,
    host_cores: int | None,
    memory_gb: float,
    action_cores: Sequence[int],
    idle_cores: Sequence[int],
    cores_flag: int | None = None,
) -> list[str]:
    """What the pool asks of a node that this machine cannot give, each naming the field
    and this machine's figure: the agent shrinks the pool to fit (cores) or the action
    fails only when it comes (a profile's cores, an environment's memory).
    ``host_cores``: the cores this process may use (None: virtual cores, not checked)."""
    out: list[str] = []
    actions, idle = sorted(action_cores), sorted(idle_cores)
    shared = sorted(set(actions) & set(idle))
    split = f"action cores {actions}, idle {idle}"
    if host_cores is not None:
        asked = cores_flag or config.cores_per_node
        if config.idle_cores >= host_cores:
            out.append(
                f"spec.cpu.idleCores {config.idle_cores}: this machine has {host_cores} "
                f"cores, so idle sandboxes share cores with actions ({split})"
            )
        elif asked is not None and asked + config.idle_cores > host_cores:
            name = f"--cores {cores_flag}" if cores_flag else f"spec.cpu.coresPerNode {asked}"
            out.append(
                f"{name} and spec.cpu.idleCores {config.idle_cores} need "
                f"{asked + config.idle_cores} cores; this machine has {host_cores}: "
                f"actions get {len(actions)} ({split}"
                + (f"; {shared} are both" if shared else "")
                + ")"
            )
    for name, env in sorted(config.envs.items()):
        demands = [("spec.cpu", env.cpu)] + [
            (f"spec.actions[{p}].cpu", profile.cpu) for p, profile in env.profiles.items()
        ]
        for field, demand in demands:
            least = min(allowed_units(demand))
            if host_cores is not None and least > len(actions):
                out.append(
                    f"TrajectoryEnv {name}: {field} needs at least {least} cores; actions "
                    f"here get {len(actions)} ({actions}): those actions cannot run"
                )
        if env.spec.memory_gb > memory_gb:
            out.append(
                f"TrajectoryEnv {name}: spec.memoryGiB {env.spec.memory_gb:g} is more than "
                f"this machine's {memory_gb:.1f} GiB: its trajectories cannot open"
            )
    return out


def cluster_only_warnings(pool: ActionPool, config: PoolConfig, port: int) -> list[str]:
    """The fields the files set that only a cluster uses (the operator's: which nodes,
    the scheduler pod, the sandbox pods), each named: set and silently unused, they read
    as if they had taken effect here."""
    spec = pool.spec
    out = [
        f"spec.{part}.nodeSelector: chooses a cluster's nodes; here this machine is the "
        "pool's one node"
        for part, section in (("cpu", spec.cpu), ("gpu", spec.gpu))
        if section is not None and section.node_selector
    ]
    pod = spec.scheduler
    for field in sorted(pod.model_fields_set & {"port", "resources", "drain_seconds"}):
        name = type(pod).model_fields[field].alias or field
        why = f"this process serves on --port {port}" if field == "port" else "not used here"
        out.append(f"spec.scheduler.{name}: the operator's scheduler pod's setting; {why}")
    out += [
        f"TrajectoryEnv {name}: spec.runtimeClassName {env.spec.runtime_class_name}: the "
        "sandbox pods' RuntimeClass on a cluster; not used here"
        for name, env in sorted(config.envs.items())
        if env.spec.runtime_class_name is not None
    ]
    return out


def gpu_warnings(config: PoolConfig, gpu: Any, flag: str) -> list[str]:
    """The pool's RewardServices that no GPU here can run (``gpu``: the agent's GPU
    worker, None without one), saying what to pass."""
    if not config.services:
        return []
    names = sorted(config.services)
    if gpu is None:
        found = "found no CUDA device" if flag == "auto" else "serves none"
        return [
            f"the pool's RewardServices ({', '.join(names)}) have no GPU here: --gpus {flag} "
            f"{found}, so their calls wait, then fail (503). Pass --gpus cpu:N (N of 1, 2, 4, "
            "8 CPU-backed devices, with PyTorch: the gpu extra) to run them without a GPU"
        ]
    devices, gib = len(gpu.devices), min(gpu.memory_bytes) / 2**30
    out = []
    for name in names:
        svc = config.services[name]
        if not any(
            holds(devices, gib, k, gb_per_gpu(svc.spec.gpu_memory_gb, svc.spec.replicated, k))
            for k in svc.dop_choices
        ):
            out.append(
                f"RewardService {name}: spec.dopChoices {list(svc.dop_choices)} and "
                f"spec.gpuMemoryGiB {svc.spec.gpu_memory_gb:g} fit none of this machine's "
                f"{devices} {gpu.backend} devices of {gib:.1f} GiB (--gpus {flag}"
                "; --gpu-memory-mib sets what each offers): its calls cannot run"
            )
    return out


def shut_down(agent: Any) -> None:
    """After a failed start: the embedded run stops the agent only once its server has
    started, so its cgroups, containers and state lock would outlive the process. (Twice is
    harmless: a failure after the server started has the run stop it too.)"""
    try:
        run_loop(agent.shutdown())
    except Exception as e:  # the failure that brought us here is the one to report
        say(f"tangram: warning: stopping the local agent: {e}", level=logging.WARNING,
            msg=f"stopping the local agent: {e}")  # fmt: skip


def check_listen(host: str, port: int) -> None:
    """Bind where the server will listen, before anything is built: found by uvicorn, a
    taken port is a SystemExit and a traceback, after the agent took its cores. Released
    again (the embedded run binds its own), so a port taken in between still fails late:
    :func:`serve_until_signalled` names it then."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise InputError(f"--host {host}: {e.strerror}") from None
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's server
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                why = (e.strerror or str(e)).lower()
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    raise InputError(f"--port {port}: {why}") from None
                raise InputError(f"--host {host}: {why}") from None


def load_tokens(path: Path, *, create: bool = True) -> TokenStore:
    """The token file; made (a client and an agent token) when missing and ``create``."""
    try:
        if path.exists():
            store = TokenStore.load(path)
            _warn_if_readable(path)
            return store
        if not create:
            raise InputError(f"--token-file {path}: no such file")
        store = TokenStore.create(path)
        say(f"created {path} (a client and an agent token)", token_file=str(path))
        return store
    except (TokenError, OSError) as e:
        raise InputError(f"--token-file: {e}") from None


def _warn_if_readable(path: Path) -> None:
    """A token file every user can read hands them its tokens (the agent's, the
    operator's): said, naming its mode; not refused (a mounted file may not be ours to
    change). Its group may read it: the operator mounts the scheduler's 0440, for the
    pod's fsGroup."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o004:
        chmod = f"chmod 600 {shlex.quote(str(path))}"
        warn(f"--token-file {path}: mode {mode:04o}: every user of this host can read its "
             f"tokens ({chmod})", token_file=str(path), mode=f"{mode:04o}")  # fmt: skip


def add_gpu_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gpus",
        default="auto",
        help="serve RewardService calls: auto (every CUDA device, if any), cuda:0,1 (those "
        "CUDA devices only), none, or cpu:N (N of 1, 2, 4, 8 CPU-backed devices standing in "
        "for GPUs: try it without a GPU)",
    )
    p.add_argument(
        "--gpu-memory-mib",
        type=whole_number(1),
        help="memory per device for service instances (default: the GPU's total less a "
        "reserve; cpu:N: 1024)",
    )


def make_agent(args: argparse.Namespace, idle: int, cores: int | None) -> Any:
    from tangram.node_agent.agent import NodeAgent
    from tangram.node_agent.execution import ExecError
    from tangram.node_agent.gpu_service import GpuOptions
    from tangram.node_agent.state_lock import InUseError

    try:
        gpus = GpuOptions.parse(args.gpus, args.gpu_memory_mib)
    except ExecError as e:
        raise InputError(str(e)) from None
    pods = None
    if args.runtime == "pod":
        from tangram.node_agent.agent import PodOptions

        for flag in ("namespace", "execd_image"):
            if not getattr(args, flag, None):
                raise InputError(f"--runtime pod needs --{flag.replace('_', '-')}")
        pods = PodOptions(
            namespace=args.namespace,
            execd_image=args.execd_image,
            execd_path=args.execd_path,
            pool=args.pool_name,
            pool_uid=args.pool_uid,
            kubeconfig=args.kubeconfig,
        )
    try:
        return NodeAgent.create(
            Path(args.state_dir),
            node=getattr(args, "node", None),
            runtime=args.runtime,
            idle_cores=idle,
            cores_for_actions=cores,
            gpus=gpus,
            pods=pods,
            exclusive=True,  # a second agent there would remove this one's environments
        )
    except InUseError as e:
        raise InputError(str(e)) from None
    except (ExecError, OSError) as e:
        why = str(e)  # (one that names its flag, --gpus ..., is said as it is)
        if isinstance(e, OSError) and _under(e.filename, args.state_dir):
            raise InputError(f"--state-dir {args.state_dir}: {why}") from None
        raise InputError(
            why if why.startswith("--") else f"--runtime {args.runtime}: {why}"
        ) from None


def _under(filename: object, folder: str) -> bool:
    """Whether an OSError's ``filename`` is ``folder`` or in it: the flag to name is the
    one that gave the path, not the runtime that failed to make it."""
    if not isinstance(filename, str | bytes | os.PathLike):
        return False
    path, top = Path(os.fsdecode(filename)).absolute(), Path(folder).absolute()
    return path == top or top in path.parents


def _local_images(agent: Any, images: list[str]) -> None:
    """Make the busybox images the local examples name (nothing can be pulled here)."""
    if agent.kind != "docker":
        return
    from tangram.node_agent.docker_runtime import import_busybox

    client = agent.runtime.inner.client  # runtimes.Sandboxes around the DockerRuntime
    for image in images:
        if image.startswith(LOCAL_BUSYBOX) and import_busybox(client, image) is None:
            why = f"{image}: busybox-static is not installed"
            say(f"tangram: warning: {why}", level=logging.WARNING, msg=why)


def pool_reloader(
    files: list[str],
    pool: str | None,
    secrets: SecretLookup | None = None,
    serving: str | None = None,
) -> Callable[[str | None], PoolConfig]:
    """The engine's reloader: pushed documents (text), or with None the files anew;
    ValueError naming every problem. ``serving``: the pool served (NAMESPACE/NAME), which
    the files' documents are read for when they declare another too and --pool was not
    given."""

    def read(text: str | None) -> PoolConfig:
        try:
            if text is None:
                try:
                    resources = load_documents(files)
                except ValueError as e:
                    raise InputError(str(e)) from None
                return _pool_of(resources, pool, secrets, serving=serving)[1]
            return load_pool_text(text, pool, secrets)[1]
        except InputError as e:
            raise ValueError(str(e)) from None

    return read


class EarlyHangup:
    """SIGHUP from the start of a run until the reload's own handler is in place (once
    serving): its default action would end the process (rc 129) that the banner tells to
    reload with it. It is kept, and the reload runs once ready (the files read at the start
    may be older than the signal)."""

    def __init__(self) -> None:
        self.came = False

    @classmethod
    def install(cls) -> EarlyHangup:
        early = cls()
        signal.signal(signal.SIGHUP, early._got)
        return early

    def _got(self, signum: int, frame: object) -> None:
        self.came = True  # (only a flag: a Python handler runs between any two bytecodes)


class EarlyInterrupt:
    """SIGINT while the event loop starts, until :func:`stop_on_signals` takes it: noted.
    asyncio's own handler for it there cancelled the start where it then was, uvicorn's
    lifespan starting (which logged the CancelledError's traceback as an error); the
    start ends instead as at a Ctrl-C just before (``tangram: interrupted``, 130)."""

    def __init__(self) -> None:
        self.came = False
        self.previous: Any = None

    @classmethod
    def install(cls) -> EarlyInterrupt:
        early = cls()
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (not ignored)
            early.previous = signal.signal(signal.SIGINT, early._got)
        return early

    def _got(self, signum: int, frame: object) -> None:
        self.came = True

    def restore(self) -> None:
        """Ctrl-C as before, unless the loop's handlers took it (and put back Python's)."""
        if self.previous is not None and signal.getsignal(signal.SIGINT) == self._got:
            signal.signal(signal.SIGINT, self.previous)


def reload_on_hangup(
    files: list[str],
    pool: str | None,
    engine: Any,
    secrets: SecretLookup | None = None,
    early: EarlyHangup | None = None,
) -> None:
    """SIGHUP (or ``POST /v1/admin/reload`` with an operator token) re-reads the files, or
    takes the documents pushed in the request, and applies them while running (nothing
    queued is lost); definitions with errors are reported and the running ones kept.
    ``early``: a SIGHUP that came during the start, reloaded now."""
    served = engine.state.config
    engine.reloader = pool_reloader(files, pool, secrets, f"{served.namespace}/{served.name}")
    pending: set[asyncio.Task[None]] = set()

    async def reload() -> None:
        try:
            changes = await engine.reload(None)
        except ValueError as e:
            reasons = [p for p in str(e).splitlines() if p]
            say(Text.assemble(("reload refused", "red"), f": {e}"), level=logging.WARNING,
                via="SIGHUP", reasons=reasons)  # fmt: skip
            return
        said = "; ".join(changes) if changes else "no changes"
        say(f"reloaded: {said}", via="SIGHUP", changes=changes)

    def hangup() -> None:  # off the handler: reading files and secrets must not block
        task = asyncio.ensure_future(reload())
        pending.add(task)
        task.add_done_callback(pending.discard)

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, hangup)
    if early is not None and early.came:
        say("SIGHUP during the start: reloading the files now", via="SIGHUP")
        hangup()


def stop_on_signals(stop: asyncio.Event, hurry: asyncio.Event | None = None) -> None:
    """SIGINT or SIGTERM sets ``stop``; a second one sets ``hurry``: stop now."""
    loop = asyncio.get_running_loop()

    def signalled() -> None:
        if not stop.is_set():
            stop.set()
        elif hurry is not None and not hurry.is_set():
            hurry.set()
            say("stopping now: cancelling what still runs")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signalled)


def stopping_note(s: Stopping) -> None:
    """What a stop waits for, said as it begins: a silent grace reads as a hang."""
    actions = f"{s.running} action{'s' if s.running != 1 else ''}"
    envs = f"; then {s.environments} environment(s) are removed" if s.environments else ""
    fields: dict[str, Any] = {"running": s.running, "environments": s.environments,
                              "grace_s": s.grace_s}  # fmt: skip
    if s.running:
        say(f"stopping: waiting up to {s.grace_s:g} s for {actions}{envs} "
            "(Ctrl-C again to stop now)", **fields)  # fmt: skip
    else:
        say(f"stopping: no action in flight{envs}", **fields)


def add_learned_flag(p: Any, default: str) -> None:
    p.add_argument(
        "--learned-file",
        help="where the scheduler keeps what it learned (action profiles, think and queueing "
        f"times, trajectory lengths) across restarts (default: {default}); '' keeps nothing",
    )


def learned_file(args: argparse.Namespace, pool: str, state_dir: str) -> LearnedFile | None:
    """``--learned-file``, or its default under ``state_dir``; None for ''. One that could
    not be saved (a directory, under a file) is refused now, not at the first save."""
    if args.learned_file is None:
        return LearnedFile(Path(state_dir) / "learned" / f"{pool}.json")
    if not args.learned_file:
        return None
    check_writable(args.learned_file, "--learned-file")
    return LearnedFile(Path(args.learned_file))


def _tokens_env(token_file: str) -> str:
    """What a client run from this shell needs to find ``token_file`` ('' for the one
    it reads unasked)."""
    if Path(token_file) == Path(os.environ.get("TANGRAM_TOKEN_FILE", DEFAULT_TOKEN_FILE)):
        return ""
    return f"TANGRAM_TOKEN_FILE={shlex.quote(token_file)} "


def serve_until_signalled(
    args: argparse.Namespace,
    config: PoolConfig,
    tokens: TokenStore,
    agent: Any,
    ready: Callable[[Running], None],
    *,
    close_on_exit: bool,
    reviewer: Any = None,
    learned: LearnedStore | None = None,
) -> None:
    """Serve the pool on ``--host``/``--port`` until SIGINT or SIGTERM. A SIGINT before
    the loop's handlers are in place ends the start (KeyboardInterrupt, as one before)."""
    stop, hurry = asyncio.Event(), asyncio.Event()
    early = EarlyInterrupt.install()

    async def main() -> bool:
        stop_on_signals(stop, hurry)
        if early.came:
            return False
        await run(
            config,
            tokens,
            agent,
            stop,
            host=args.host,
            port=args.port,
            on_ready=ready,
            grace_s=args.grace,
            close_on_exit=close_on_exit,
            reviewer=reviewer,
            learned=learned,
            hurry=hurry,
            on_stopping=stopping_note,
        )
        return True

    try:
        started = run_loop(main())
    except SchedulerUrlError as e:  # the local agent's URL: a --host it cannot reach
        raise InputError(f"--host {args.host}: the local agent cannot connect: {e}") from None
    except OSError as e:
        raise InputError(f"--port {args.port}: {e.strerror}") from None
    except SystemExit:  # uvicorn's "could not start" (its reason logged): a port taken late
        raise InputError(f"--port {args.port}: the server could not listen there") from None
    finally:
        early.restore()
    if not started:
        raise KeyboardInterrupt


def run_loop(coro: Any) -> Any:
    """uvloop when it is installed (uvicorn[standard] brings it): a faster event loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)

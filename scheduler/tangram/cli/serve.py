"""``tangram serve`` (the scheduler alone) and ``tangram agent`` (a node agent alone).

What the scheduler Deployment and the node-agent DaemonSet run; ``tangram up`` is both in
one process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tangram.api.spec_base import DNS_LABEL_RE, DNS_SUBDOMAIN
from tangram.api.wire import AGENTS_PATH
from tangram.cli.events import say
from tangram.cli.files import InputError, port, seconds, whole_number
from tangram.cli.up import (
    EarlyHangup,
    add_gpu_flags,
    add_grace_flag,
    add_learned_flag,
    add_log_flags,
    add_runtime_flag,
    check_listen,
    cores_note,
    learned_file,
    load_pool,
    load_tokens,
    make_agent,
    reload_on_hangup,
    run_loop,
    serve_until_signalled,
    setup_logging,
    shut_down,
    virtual_cores,
)
from tangram.client.common import DEFAULT_TOKEN_FILE
from tangram.service.auth import AGENT_TENANT
from tangram.service.embedded import Running
from tangram.service.learned_file import LearnedStore

log = logging.getLogger("tangram.service")
_agent_log = logging.getLogger("tangram.agent")
AGENT_GRACE_S = 20.0  # the agent's --grace: within Kubernetes' default 30 s for its pod

_STATE = os.environ.get("TANGRAM_STATE_DIR", str(Path.home() / ".local/state/tangram"))
_TOKENS = os.environ.get("TANGRAM_TOKEN_FILE", str(DEFAULT_TOKEN_FILE))


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the scheduler service of one pool (no local agent)",
        description="Serve one pool declared in the CR files (ActionPool, TrajectoryEnv and "
        "RewardService documents) on --host/--port, without a node agent: what a cluster's "
        "scheduler Deployment runs. Node agents join it with `tangram agent --scheduler URL`, "
        "the agents' URL it prints. Ctrl-C or SIGTERM stops admitting and gives in-flight "
        "actions --grace seconds; environments stay on their nodes for the next scheduler to "
        "take back. SIGHUP reloads the files. docs/service.md tells the rest.",
    )
    p.add_argument("-f", "--file", action="append", required=True, help="YAML file or directory")
    p.add_argument(
        "--pool",
        help="the ActionPool to serve when the files declare several: NAME, or NAMESPACE/NAME",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8080, help="port to serve on (default 8080)")
    p.add_argument(
        "--token-file",
        default=_TOKENS,
        # "(default" as the formatter looks for it: "; default:" had it said twice
        help="TOKEN TENANT lines, created if missing (default: $TANGRAM_TOKEN_FILE, else "
        "~/.config/tangram/tokens)",
    )
    add_grace_flag(p)
    p.add_argument(
        "--kubernetes",
        action="store_true",
        help="in a cluster: authenticate clients by their ServiceAccount tokens (TokenReview, "
        "admitted by spec.access) and read secretRef Secrets from the API server",
    )
    p.add_argument(
        "--kubeconfig",
        help="with --kubernetes outside a pod: the kubeconfig to act with (default: "
        "in-cluster ServiceAccount, else $KUBECONFIG)",
    )
    add_learned_flag(p, "$TANGRAM_STATE_DIR or ~/.local/state/tangram, learned/POOL.json")
    p.add_argument(
        "--learned-configmap",
        metavar="NAMESPACE/NAME",
        help="with --kubernetes: keep it in this ConfigMap instead (the operator makes one "
        "for each pool, which outlives the scheduler's pod)",
    )
    add_log_flags(p)
    p.set_defaults(run=run_serve)

    a = sub.add_parser(
        "agent",
        help="run a node agent that serves a scheduler",
        description="Run a node agent for this machine that connects to a scheduler (`tangram "
        "serve`) and runs its actions on this machine's cores: what a cluster's node-agent "
        "DaemonSet runs. It reads its token from --token-file and never makes one. "
        "docs/node-agent.md tells the rest.",
    )
    a.add_argument(
        "--scheduler",
        required=True,
        type=scheduler_url,
        help="ws://HOST:PORT/v1/agents, as `tangram serve` prints it (wss:// with TLS; "
        "http(s):// is taken as ws(s)://, and a URL without a path gets /v1/agents)",
    )
    a.add_argument(
        "--token-file",
        default=_TOKENS,
        help="holds a system:agent token, read, never made (default: $TANGRAM_TOKEN_FILE, "
        "else ~/.config/tangram/tokens)",
    )
    a.add_argument("--node", help="node name (default: the hostname)")
    add_runtime_flag(a)
    k = a.add_argument_group("the pod runtime (--runtime pod)")
    k.add_argument("--namespace", help="namespace of the sandbox pods (the pool's)")
    k.add_argument("--execd-image", help="an image holding the exec server (the agent's own)")
    k.add_argument(
        "--execd-path",
        default="/usr/local/libexec/tangram/tangram-execd",
        help="the exec server's path in --execd-image",
    )
    k.add_argument("--pool-name", default="", help="the ActionPool owning the sandboxes")
    k.add_argument("--pool-uid", default="", help="its metadata.uid (for ownerReferences)")
    k.add_argument(
        "--kubeconfig", help="outside a pod: the kubeconfig to act with (default: in-cluster)"
    )
    a.add_argument(
        "--state-dir",
        default=_STATE,
        help="the agent's state: socket directories, process-runtime workdirs (default: "
        "$TANGRAM_STATE_DIR, else ~/.local/state/tangram)",
    )
    a.add_argument(
        "--idle-cores", type=whole_number(1), default=1, help="size of the idle core set"
    )
    a.add_argument(
        "--cores",
        type=whole_number(1),
        help="cores for actions (default: all but the idle set; noop: virtual)",
    )
    a.add_argument(
        "--grace",
        type=seconds,
        default=AGENT_GRACE_S,
        help="at SIGTERM (or SIGINT, SIGHUP): seconds running commands get to finish, new "
        "ones refused, before they are killed; a second signal kills them at once (default: "
        f"{AGENT_GRACE_S:g}, within a pod's 30 s terminationGracePeriodSeconds)",
    )
    add_gpu_flags(a)
    add_log_flags(a)
    a.set_defaults(run=run_agent)


def scheduler_url(text: str) -> str:
    """An argparse type: the scheduler's agent endpoint as a WebSocket URL. http(s) is
    the same server's ws(s) (the scheme `tangram serve` printed before); a URL without a
    path means the agent endpoint. Anything else is a usage error at once, not a link
    retried for ever."""
    from urllib.parse import urlsplit, urlunsplit

    from tangram.node_agent.link import SchedulerUrlError, check_url, not_a_url

    parts = urlsplit(text.strip())
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme.lower(), parts.scheme)
    if scheme in ("ws", "wss") and not parts.netloc:  # (``http://``: not its scheme's fault)
        raise argparse.ArgumentTypeError(not_a_url(text, "no host"))
    path = parts.path if parts.path not in ("", "/") else AGENTS_PATH
    url = urlunsplit(parts._replace(scheme=scheme, path=path)) if parts.netloc else text
    try:
        check_url(url, given=text)
    except SchedulerUrlError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return url


def run_serve(args: argparse.Namespace) -> int:
    setup_logging(args)
    early = EarlyHangup.install()  # (SIGHUP reloads: never a kill during the start)
    secrets, reviewer = None, None
    learned_map = _learned_configmap(args)
    if args.kubernetes:
        from tangram.service.kube import KubeApi, KubeError, LearnedConfigMap, api_client
        from tangram.service.reviews import TokenReviewer

        try:
            api = api_client(args.kubeconfig)
        except KubeError as e:
            raise InputError(f"--kubernetes: {e}") from None
        kube = KubeApi(api)
        secrets, reviewer = kube.secret, TokenReviewer(kube.review)
    # In a cluster the documents come from the operator's ConfigMap, which may name a
    # Secret not made yet: this scheduler starts, refusing only that quota's calls (the
    # operator's pushes are refused, and the pool says why, until the Secret exists).
    pool, config = load_pool(args.file, args.pool, secrets, unresolved_ok=args.kubernetes)
    for endpoint in config.endpoints.values():
        if endpoint.unresolved is not None:
            log.warning("%s: its calls are refused until it can be read", endpoint.unresolved)
    check_listen(args.host, args.port)
    tokens = load_tokens(Path(args.token_file))
    learned: LearnedStore | None
    if learned_map is not None:
        learned = LearnedConfigMap(api, *learned_map)
    else:
        learned = learned_file(args, pool.metadata.name, _STATE)

    def ready(r: Running) -> None:
        reload_on_hangup(args.file, args.pool, r.engine, secrets, early)
        agents = scheduler_url(r.url)
        say(f"pool {pool.metadata.name}: scheduler at {r.url}, agents at {agents}",
            pool=pool.metadata.name, url=r.url, agents_url=agents, pid=os.getpid())  # fmt: skip
        say(r.engine.learned_note())

    # Environments outlive a scheduler restart: the next scheduler takes them back.
    serve_until_signalled(args, config, tokens, None, ready, close_on_exit=False,
                          reviewer=reviewer, learned=learned)  # fmt: skip
    say("stopped; environments stay on their nodes for the next scheduler")
    return 0


def _learned_configmap(args: argparse.Namespace) -> tuple[str, str] | None:
    """``--learned-configmap NAMESPACE/NAME`` as (namespace, name), checked."""
    given = args.learned_configmap
    if given is None:
        return None
    namespace, _, name = given.partition("/")
    if not (DNS_LABEL_RE.match(namespace) and re.match(DNS_SUBDOMAIN, name)):
        raise InputError(f"--learned-configmap: {given!r} is not NAMESPACE/NAME")
    if not args.kubernetes:
        raise InputError("--learned-configmap needs --kubernetes")
    if args.learned_file is not None:
        raise InputError("give --learned-file or --learned-configmap, not both")
    return namespace, name


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class AgentSignals:
    """SIGTERM, SIGINT and SIGHUP stop ``tangram agent``, from the top of its run: one
    during its start (reading its state, adopting pods: seconds) is kept, with its time,
    and stops it once it runs; its default action would end it silently (SIGHUP: rc
    129) or with a traceback, which its scheduler reads as a crash. A second one hurries
    the stop: what still runs is killed at once."""

    def __init__(self) -> None:
        self.came: list[signal.Signals] = []  # before the loop took over
        self.first_at: float | None = None  # (monotonic) the stop's start: its grace's
        self._stop: asyncio.Event | None = None
        self._hurry: asyncio.Event | None = None
        self._began: Callable[[float], None] = lambda at: None

    @classmethod
    def install(cls) -> AgentSignals:
        signals = cls()
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signals._early)
        return signals

    def _early(self, signum: int, frame: object) -> None:
        # (only flags: a Python handler runs between any two bytecodes)
        self.first_at = self.first_at or time.monotonic()
        self.came.append(signal.Signals(signum))

    def take_over(
        self, stop: asyncio.Event, hurry: asyncio.Event, began: Callable[[float], None]
    ) -> None:
        """On the loop: the signals set ``stop``, then ``hurry``, and ``began`` is told
        when the stop began (the first signal's time: the agent's grace counts from it);
        those that came during the start do so now."""
        self._stop, self._hurry, self._began = stop, hurry, began
        loop = asyncio.get_running_loop()
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, self.got, sig)
        for sig in self.came:
            self.got(sig)

    def got(self, sig: signal.Signals) -> None:
        assert self._stop is not None and self._hurry is not None
        self.first_at = self.first_at or time.monotonic()
        self._began(self.first_at)
        if sig == signal.SIGHUP:
            _agent_log.warning("SIGHUP: stopping as for SIGTERM")
        if not self._stop.is_set():
            self._stop.set()
        elif not self._hurry.is_set():
            self._hurry.set()
            say("stopping now: cancelling what still runs")


def run_agent(args: argparse.Namespace) -> int:
    from tangram.node_agent.link import SchedulerUrlError
    from tangram.node_agent.link import run as run_link

    signals = AgentSignals.install()  # (before anything slow: a signal now stops it too)
    setup_logging(args)
    # Only read: a token made here is one no scheduler knows (403, retried for ever).
    token = load_tokens(Path(args.token_file), create=False).token_for(AGENT_TENANT)
    if token is None:
        raise InputError(f"--token-file {args.token_file}: no {AGENT_TENANT} token")
    agent = make_agent(args, args.idle_cores, args.cores)
    stop = asyncio.Event()
    cores = cores_note(agent.action_cores, agent.idle_cores, virtual_cores(agent.kind))
    say(f"agent {agent.node}: {agent.kind} runtime, {cores}", node=agent.node,
        runtime=agent.kind, scheduler=args.scheduler)  # fmt: skip

    hurry = asyncio.Event()

    async def main() -> None:
        # SIGHUP (its terminal gone) stops it as SIGTERM does: it has nothing to reload,
        # and its default, a silent death, read as a crash to its scheduler.
        signals.take_over(stop, hurry, agent.note_stop)
        await run_link(agent, args.scheduler, token, stop, grace_s=args.grace, hurry=hurry)

    try:
        run_loop(main())
    except BaseException as e:  # a failed link: main's own shutdown did not run
        shut_down(agent)
        if isinstance(e, SchedulerUrlError):  # (a redirect to a URL no retry reaches)
            raise InputError(f"--scheduler: {e}") from None
        raise
    say(f"agent {agent.node} stopped", node=agent.node)
    return 0

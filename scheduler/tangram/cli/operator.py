"""``tangram operator``: the kopf operator that turns ActionPools into running pools.

In the chart's Deployment it uses its ServiceAccount; outside a cluster ``$KUBECONFIG``
(or ``--kubeconfig``), with ``--scheduler-endpoints`` mapping ``namespace/pool`` to the
URL of a scheduler it cannot reach by its Service name (e2e tests, development).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from tangram.cli.files import InputError, documented_command, port
from tangram.cli.up import add_log_flags, setup_logging
from tangram.service.embedded import url_host

SUMMARY = "run the Kubernetes operator (ActionPool, TrajectoryEnv, RewardService)"


def register(sub: Any) -> None:
    p = documented_command(sub, "operator", SUMMARY, __doc__)
    p.add_argument(
        "--image", required=True, help="image of the schedulers and node agents it creates"
    )
    p.add_argument(
        "--gpu-agent-image",
        help="image of the GPU node agents: one built with the gpu extra (PyTorch); "
        "default --image",
    )
    p.add_argument(
        "--namespace",
        action="append",
        help="watch this namespace (repeatable; default: every namespace)",
    )
    p.add_argument("--kubeconfig", help="outside a cluster: the kubeconfig to act with")
    p.add_argument(
        "--scheduler-endpoints",
        type=Path,
        help="YAML file of 'namespace/pool: http://host:port' for schedulers outside the "
        "cluster network (re-read on every use)",
    )
    p.add_argument("--liveness-port", type=port, help="serve GET /healthz on this port")
    p.add_argument(
        "--liveness-host", default="0.0.0.0", help="the address of the liveness endpoint"
    )
    p.add_argument(
        "--loopback-api-server",
        metavar="HOST:PORT",
        help="single-node test clusters whose pod network reaches nothing: run the pools' "
        "schedulers and node agents on the node's network, bound to 127.0.0.1, reaching the "
        "API server at this loopback address (never on a shared cluster)",
    )
    add_log_flags(p)
    p.set_defaults(run=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    import kopf

    from tangram.operator import handlers
    from tangram.operator.builders import Loopback
    from tangram.operator.kube import Cluster, api_client
    from tangram.operator.reconciler import Reconciler
    from tangram.operator.scheduler_link import Endpoints

    setup_logging(args)
    try:
        loopback = Loopback.parse(args.loopback_api_server) if args.loopback_api_server else None
    except ValueError as e:
        raise InputError(f"--loopback-api-server {e}") from None
    try:
        api = api_client(args.kubeconfig)
    except Exception as e:  # the client raises several kinds for a missing or bad config
        raise InputError(f"no Kubernetes credentials: {e}") from None
    cluster = Cluster(api, args.namespace)
    handlers.install(
        Reconciler(
            cluster,
            image=args.image,
            gpu_image=args.gpu_agent_image,
            loopback=loopback,
            endpoints=Endpoints(args.scheduler_endpoints, loopback=loopback is not None),
        )
    )
    host = url_host(args.liveness_host)
    liveness = f"http://{host}:{args.liveness_port}/healthz" if args.liveness_port else None
    asyncio.run(
        kopf.operator(
            clusterwide=args.namespace is None,
            namespaces=args.namespace or (),
            standalone=True,
            liveness_endpoint=liveness,
        )
    )
    return 0

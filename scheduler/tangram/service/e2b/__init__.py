"""An E2B-compatible endpoint: the parts of E2B's control-plane API and of its in-sandbox
daemon (envd) that E2B's SDKs use to create a sandbox, run commands and move files, served
by the scheduler over its own trajectories. A sandbox is a trajectory opened from the
TrajectoryEnv named as the template; its commands are exec actions, scheduled as any other.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.routing import BaseRoute

from tangram.service.e2b.control import Admit, control_routes
from tangram.service.e2b.envd import envd_routes
from tangram.service.e2b.sandboxes import Sandboxes
from tangram.service.engine import Engine


def add_e2b_routes(app: FastAPI, engine: Engine, admit: Admit) -> tuple[Sandboxes, list[BaseRoute]]:
    """Serve E2B's API and envd at the service's root, out of the service's own OpenAPI
    document: the routes are returned for a document of their own. The caller stops the
    returned sandboxes' reaper when the service stops."""
    sandboxes = Sandboxes(engine)
    routers = [control_routes(sandboxes, admit), envd_routes(engine, sandboxes, admit)]
    for router in routers:
        app.include_router(router, include_in_schema=False)
    return sandboxes, [route for router in routers for route in router.routes]

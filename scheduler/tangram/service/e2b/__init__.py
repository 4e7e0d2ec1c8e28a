"""An E2B-compatible endpoint: the parts of E2B's control-plane API and of its in-sandbox
daemon (envd) that E2B's SDKs use to create a sandbox, run commands and move files, served
by the scheduler over its own trajectories. A sandbox is a trajectory opened from the
TrajectoryEnv named as the template; its commands are exec actions, scheduled as any other.
"""

from __future__ import annotations

from fastapi import FastAPI

from tangram.service.e2b.control import Admit, control_routes
from tangram.service.e2b.envd import envd_routes
from tangram.service.e2b.sandboxes import Sandboxes
from tangram.service.engine import Engine


def add_e2b_routes(app: FastAPI, engine: Engine, admit: Admit) -> Sandboxes:
    """Serve E2B's API and envd at the service's root; the caller stops the returned
    sandboxes' reaper when the service stops."""
    sandboxes = Sandboxes(engine)
    app.include_router(control_routes(sandboxes, admit))
    app.include_router(envd_routes(engine, sandboxes, admit))
    return sandboxes

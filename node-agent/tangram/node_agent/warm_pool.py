"""What the sandbox runtimes (Docker containers, pods) share about holding environments:
the open trajectories' and the warm pool's, claiming a warm one or making one, topping
the pool up, retiring older versions, and noticing the ones that ended by themselves.

Each runtime keeps only what is its own, as hooks: how a sandbox is made, claimed for a
trajectory (a rename, a relabel), discarded, named, and how it tells which ended and why.

Opens, closes, top-ups and the ``gone`` watch run in different threads (the adapter in
``runtimes`` moves them off the event loop): every loop here works on a snapshot, and an
environment is taken out only if it is still the one looked at.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Generic, TypeVar

from tangram.api.wire import EnvSpec
from tangram.node_agent.cgroups import Cgroups, detect
from tangram.node_agent.env_template import User, Workdir, check_trajectory_id, digest
from tangram.node_agent.execution import SETUP_TIMEOUT_S, ExecError, Gone, Opened
from tangram.node_agent.fast_path import ExecServerRuntime, FastPath

__all__ = ["SandboxRuntime"]

E = TypeVar("E")  # a runtime's record of one sandbox


class SandboxRuntime(ExecServerRuntime, Generic[E]):
    """Open and warm sandboxes of one agent, reached through their exec servers."""

    envs: dict[str, E]  # by trajectory

    def __init__(self, idle_cores: Sequence[int], cgroup_root: Path, proc_root: Path) -> None:
        if not idle_cores:
            raise ExecError("idle_cores: at least one core must hold idle trajectories")
        self.idle_cores = tuple(idle_cores)
        self.cgroups: Cgroups = detect(cgroup_root)
        self.cgroup_root = cgroup_root
        self.proc_root = proc_root
        self.envs = {}
        self.warm_pool: dict[str, list[E]] = {}  # by template digest
        self.fast = FastPath(self.cgroups, self.idle_cores)
        self.setup_timeout_s = SETUP_TIMEOUT_S  # each setup command's
        # What an image taught: the sandboxes' user, and the image's own workdir (None:
        # it has none).
        self._facts: dict[str, tuple[User | None, Workdir | None]] = {}

    # ---- the hooks ---------------------------------------------------------------
    def _make(self, template: EnvSpec, trajectory: str | None) -> E:
        """A new sandbox, started and set up: the trajectory's, or a warm one (None)."""
        raise NotImplementedError

    def _claim(self, env: E, trajectory: str) -> bool:
        """Make a warm sandbox the trajectory's; False when it broke while it waited (it
        is discarded and the next one tried). Raising keeps it for the next open."""
        raise NotImplementedError

    def _discard(self, env: E) -> None:
        """Remove a sandbox and everything it wrote."""
        raise NotImplementedError

    def _key(self, env: E) -> str:
        """Names the sandbox in the open's answer."""
        raise NotImplementedError

    def _env_name(self, env: E) -> str:
        """The environment (TrajectoryEnv) the sandbox was made for."""
        raise NotImplementedError

    def _survey(self) -> Callable[[E], str | None] | None:
        """One look at all the sandboxes: for each, what the look saw of its end (handed
        to ``_ending``), or None while it lives (None for the whole look: nothing can be
        told now, e.g. the engine does not answer)."""
        raise NotImplementedError

    def _ending(self, env: E, seen: str) -> tuple[str, str] | None:
        """(reason, message) of an ended sandbox, from what the look saw (``seen``) and
        more where it needs; None while that is not known yet."""
        raise NotImplementedError

    # ---- lifecycle ---------------------------------------------------------------
    def open(self, trajectory: str, template: EnvSpec) -> Opened:
        """Give the trajectory a sandbox: a warm one if one is ready."""
        check_trajectory_id(trajectory)
        if trajectory in self.envs:
            raise ExecError(f"trajectory: {trajectory} is already open")
        t0 = time.perf_counter()
        ready = self.warm_pool.get(digest(template), [])
        while ready:
            env = ready.pop()
            try:
                claimed = self._claim(env, trajectory)
            except BaseException:
                ready.append(env)
                raise
            if not claimed:
                self._discard(env)  # gone or broken while it waited: try the next one
                continue
            self.envs[trajectory] = env
            return Opened(self._key(env), True, time.perf_counter() - t0)
        env = self._make(template, trajectory)
        self.envs[trajectory] = env
        return Opened(self._key(env), False, time.perf_counter() - t0)

    def warm(self, template: EnvSpec) -> int:
        """Top the template's warm pool up to ``template.warm``; returns how many were
        made. Warm sandboxes of other versions of the same environment are discarded."""
        current = digest(template)
        for other, envs in list(self.warm_pool.items()):
            if other != current and envs and self._env_name(envs[0]) == template.name:
                for env in self.warm_pool.pop(other):
                    self._discard(env)
        ready = self.warm_pool.setdefault(current, [])
        made = 0
        while len(ready) < template.warm:
            ready.append(self._make(template, None))
            made += 1
        while len(ready) > template.warm:
            self._discard(ready.pop())
        return made

    def retire_warm(self, keep: Collection[str]) -> int:
        """Discard the warm sandboxes of every environment not named in ``keep`` (removed,
        or no longer kept warm: each holds its memory on the node); how many."""
        retired = 0
        for key, ready in list(self.warm_pool.items()):
            if ready and self._env_name(ready[0]) not in keep:
                self.warm_pool.pop(key, None)
                while ready:  # one at a time: an open may be claiming from the same list
                    self._discard(ready.pop())
                    retired += 1
        return retired

    def close(self, trajectory: str) -> None:
        """Discard the trajectory's sandbox and everything it wrote."""
        self.fast.end_sessions(trajectory)  # discarding the sandbox ends their processes
        env = self.envs.pop(trajectory, None)
        if env is not None:
            self._discard(env)

    def shutdown_warm(self) -> None:
        for envs in self.warm_pool.values():
            for env in envs:
                self._discard(env)
        self.warm_pool.clear()

    def gone(self) -> list[Gone]:
        """Open sandboxes that ended by themselves (killed, evicted, removed), each with
        why, dropped and discarded; ended warm ones are just discarded."""
        if not self.envs and not any(self.warm_pool.values()):
            return []  # nothing to look for: no listing, no /proc read
        ended_now = self._survey()
        if ended_now is None:
            return []
        ended: list[Gone] = []
        for trajectory, env in list(self.envs.items()):
            seen = ended_now(env)
            if seen is None:
                continue
            why = self._ending(env, seen)
            if why is None or self.envs.get(trajectory) is not env:
                continue
            self.envs.pop(trajectory, None)
            self.fast.end_sessions(trajectory)
            self._discard(env)
            ended.append(Gone(trajectory, *why))
        for envs in list(self.warm_pool.values()):
            for env in [e for e in list(envs) if ended_now(e) is not None]:
                with contextlib.suppress(ValueError):  # claimed meanwhile: its open fails
                    envs.remove(env)
                    self._discard(env)
        return ended

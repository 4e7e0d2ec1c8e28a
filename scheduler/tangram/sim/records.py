"""What a replay measures, and the summary figures of the bench contract (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class ActionRecord:
    trajectory: str
    step: int
    kind: str
    type: str
    submitted: float
    started: float = float("nan")
    ended: float = float("nan")
    units: float = 0.0  # key units held while running (cores, GPUs, quota slots)
    overhead_s: float = 0.0  # system overhead inside [started, ended] (exec setup, restore)
    ok: bool = True
    attempts: int = 1

    @property
    def act_s(self) -> float:
        return self.ended - self.submitted

    @property
    def queued_s(self) -> float:
        return self.started - self.submitted


@dataclass(slots=True)
class SimResult:
    policy: str
    records: list[ActionRecord] = field(default_factory=list)
    makespan_s: float = 0.0
    unit_seconds_by: dict[str, float] = field(default_factory=dict)  # per action kind
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        acts = np.array([r.act_s for r in self.records]) if self.records else np.zeros(1)
        per_traj: dict[str, float] = {}
        for r in self.records:
            per_traj[r.trajectory] = per_traj.get(r.trajectory, 0.0) + r.act_s
        by_kind: dict[str, list[float]] = {}
        for r in self.records:
            by_kind.setdefault(r.kind, []).append(r.act_s)
        out = {
            "avg_act_s": float(acts.mean()),
            "p99_act_s": float(np.percentile(acts, 99)),
            "avg_traj_act_s": float(np.mean(list(per_traj.values()))) if per_traj else 0.0,
            "makespan_s": self.makespan_s,
            # Sum over resource classes (contract); the per-kind figures are comparable.
            "unit_seconds": sum(self.unit_seconds_by.values()),
            "actions": float(len(self.records)),
            "failed": float(sum(not r.ok for r in self.records)),
            "avg_queue_s": float(np.mean([r.queued_s for r in self.records]))
            if self.records
            else 0.0,
            "avg_overhead_s": float(np.mean([r.overhead_s for r in self.records]))
            if self.records
            else 0.0,
        }
        for kind, values in sorted(by_kind.items()):
            out[f"avg_act_{kind}_s"] = float(np.mean(values))
        for kind, held in sorted(self.unit_seconds_by.items()):
            out[f"unit_seconds_{kind}"] = held
        return out

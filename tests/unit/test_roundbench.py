"""The round-latency benchmark's GPU and quota cases (``tangram bench scheduler``)."""

from __future__ import annotations

import pytest

from tangram.api.orderings import QuotaWaiting
from tangram.scheduler.core.decisions import Round
from tangram.scheduler.core.scheduler import Scheduler
from tangram.sim.roundbench import QUOTA_BURST, GpuCase, QuotaCase, measure_gpu, measure_quota


def test_gpu_case_times_every_round_on_a_pool_that_calls_join(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rounds: list[tuple[int, int]] = []  # (calls started, of which joined a running instance)
    schedule = Scheduler.schedule

    def counted(self: Scheduler, now: float) -> Round:
        result = schedule(self, now)
        rounds.append((len(result.assignments), sum(a.sharing for a in result.assignments)))
        return result

    monkeypatch.setattr(Scheduler, "schedule", counted)
    times = measure_gpu(GpuCase(gpus=16, queued=128), rounds=10)
    assert len(times) == 10 and all(t > 0 for t in times)
    timed = rounds[-10:]  # after the untimed warm-up
    assert sum(started for started, _ in timed) > 0  # calls end and new ones start
    assert sum(joined for _, joined in timed) > 0  # on resident instances, as under load


def test_gpu_case_wants_whole_nodes() -> None:
    with pytest.raises(ValueError, match="gpus"):
        measure_gpu(GpuCase(gpus=12, queued=16), rounds=1)


@pytest.mark.parametrize(("rule", "starts"), [("pass", QUOTA_BURST), ("hold", 0)])
def test_quota_case_times_rounds_with_waiters_on_a_full_quota(
    monkeypatch: pytest.MonkeyPatch, rule: QuotaWaiting, starts: int
) -> None:
    """Under "pass" each round's search calls start past the waiters (the walk the case
    times); under "hold" the first waiter holds them back."""
    rounds: list[tuple[int, int]] = []  # (calls started, calls still queued)
    schedule = Scheduler.schedule

    def counted(self: Scheduler, now: float) -> Round:
        result = schedule(self, now)
        rounds.append((len(result.assignments), self.queued))
        return result

    monkeypatch.setattr(Scheduler, "schedule", counted)
    times = measure_quota(QuotaCase(queued=64, rule=rule), rounds=5)
    assert len(times) == 5 and all(t > 0 for t in times)
    assert [n for n, _ in rounds] == [starts] * 5
    assert rounds[-1][1] == 64 + (QUOTA_BURST - starts) * 5  # every waiter still waits

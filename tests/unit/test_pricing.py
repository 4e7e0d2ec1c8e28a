"""The core price (scheduler.core.pricing) and what it does to a round on a busy node."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tangram.api.resources import Scheduling
from tangram.scheduler import SchedulerConfig, SchedulingError
from tangram.scheduler.core.pricing import core_price, priced_sizes

from .helpers import busy_node, suite_state


def amdahl(t1: float, p: float, sizes: range) -> dict[int, float]:
    return {k: t1 * ((1 - p) + p / k) for k in sizes}


def test_an_idle_node_prices_cores_at_nothing_and_a_full_one_at_its_load() -> None:
    assert core_price(queued=5, running=0, held=0, cores=64) == 0.0  # nothing held: ρ = 0
    assert core_price(queued=0, running=0, held=64, cores=64) == 0.0  # nobody else there
    # ρ = 32/64, L = 10 + 6 actions on 64 cores: (1/2)(16/64)
    assert core_price(queued=10, running=6, held=32, cores=64) == pytest.approx(0.125)
    assert core_price(queued=3, running=3, held=0, cores=0) == 0.0


def test_no_price_keeps_every_size() -> None:
    sizes = range(1, 33)
    assert priced_sizes(tuple(sizes), amdahl(100.0, 0.9, sizes), 0.0) == 32


@pytest.mark.parametrize(("p", "price"), [(0.9, 0.1), (0.95, 0.05), (0.98, 0.2), (0.85, 0.01)])
def test_an_amdahl_action_keeps_the_sizes_whose_step_pays_k_k1_below_the_bound(
    p: float, price: float
) -> None:
    """Step k -> k+1 gains d1·p/(k(k+1)) and costs d1(1-p) core-seconds: it pays while
    k(k+1) <= p / ((1-p)·price)."""
    sizes = range(1, 33)
    kept = priced_sizes(tuple(sizes), amdahl(300.0, p, sizes), price)
    bound = p / ((1 - p) * price)
    expected = 1 + next((k - 1 for k in range(1, 32) if k * (k + 1) > bound), 31)
    assert kept == expected
    assert (kept - 1) * kept <= bound  # the last step it kept paid
    if kept < 32:
        assert kept * (kept + 1) > bound  # the next would not


@given(
    p=st.floats(0.0, 0.999),
    prices=st.lists(st.floats(0.0, 10.0), min_size=2, max_size=2).map(sorted),
    t1=st.floats(0.01, 10_000.0),
)
def test_a_higher_price_never_keeps_more_sizes_and_always_keeps_one(
    p: float, prices: list[float], t1: float
) -> None:
    sizes = (1, 2, 4, 8, 16, 32)
    durations = amdahl(t1, p, range(1, 33))
    cheap, dear = (priced_sizes(sizes, durations, x) for x in prices)
    assert 1 <= dear <= cheap <= len(sizes)


def test_a_step_that_adds_no_core_seconds_is_always_kept() -> None:
    # Super-linear (caches): 2 cores more than halve the time, so the step costs nothing.
    assert priced_sizes((1, 2, 4), {1: 10.0, 2: 4.0, 4: 3.9}, 100.0) == 2


def test_a_busy_node_caps_a_long_elastic_action_near_its_knee() -> None:
    s = busy_node(SchedulerConfig())
    (group,) = s.plan(0.0).groups  # what tangram explain shows
    assert group.core_price == pytest.approx((48 / 64) * 49 / 64)
    assert group.capped == (("suite", 4, 16),)
    (asg,) = s.schedule(0.0).assignments
    # μ = (48/64)·(1 + 48)/64 ≈ 0.574 and p/((1-p)μ) ≈ 15.7: the step k -> k+1 pays
    # while k(k+1) <= 15.7, so up to 3 -> 4 (12) and not 4 -> 5 (20).
    assert asg.units == 4
    paper = busy_node(SchedulerConfig(core_price="none"))
    (group,) = paper.plan(0.0).groups
    assert (group.core_price, group.capped) == (None, ())
    (asg,) = paper.schedule(0.0).assignments
    assert asg.units == 16  # the paper's rule: all 16 free cores, nothing else is queued


def test_the_node_counts_the_actions_holding_its_cores() -> None:
    s = busy_node(SchedulerConfig())
    node = s.cpu.nodes["n1"]
    assert node.holders == 48
    s.schedule(0.0)
    assert node.holders == 49
    s.complete("run0", 30.0)
    s.complete("suite", 31.0)
    assert node.holders == 47


def test_an_unknown_core_price_is_refused_naming_the_field() -> None:
    with pytest.raises(SchedulingError) as e:
        SchedulerConfig(core_price="cheap")  # type: ignore[arg-type]
    assert e.value.field == "core_price"
    with pytest.raises(ValueError, match="corePrice"):
        Scheduling.model_validate({"corePrice": "cheap"})
    assert Scheduling.model_validate({"corePrice": "none"}).core_price == "none"
    assert Scheduling().core_price == SchedulerConfig().core_price == "arrivals"


def test_explain_shows_the_price_and_what_it_capped(capsys: pytest.CaptureFixture[str]) -> None:
    from tangram.cli.explain import State, _print, as_dict, decide

    state = State.model_validate(suite_state())
    report = as_dict(decide(state)[1])
    (group,) = report["groups"]
    # ρ = 6/8, L = 1 queued + 6 running: μ = 0.75·7/8 and 0.8/(0.2μ) ≈ 6.1; the steps
    # 1 -> 2 (k(k+1) = 2) and 2 -> 3 (6) pay, 3 -> 4 (12) does not.
    assert group["core_price"] == pytest.approx(0.75 * 7 / 8)
    assert group["capped"] == [{"action": "suite", "up_to": 3, "of": 8}]
    # Its terms: all load. t6 is thinking, but no think time is learned, so nobody is
    # counted back before the suite's 300 core-seconds drain from 8 cores.
    assert group["core_price_terms"] == {
        "load": pytest.approx(0.75 * 7 / 8),
        "utilisation": 0.75,
        "actions": 7,
        "returns": 0.0,
        "thinking": 1,
        "backlog_s": 37.5,
        "think_s": 0.0,
        "back": 0.0,
        "offered": 0.0,
    }
    _print(report)
    out = capsys.readouterr().out
    assert "core price 0.656" in out and "suite: up to 3 of 8 cores" in out
    assert "load 0.656: utilisation 0.75 x 7 actions queued or running" in out
    assert "return 0: 1 thinking there, but no think time learned yet" in out


def test_the_scheduler_reports_each_nodes_price_for_the_metrics() -> None:
    s = busy_node(SchedulerConfig())
    (price,) = s.core_prices().values()
    assert list(s.core_prices()) == ["n1"]
    assert price.total == price.load == pytest.approx((48 / 64) * (48 + 1) / 64)
    assert (price.utilisation, price.actions, price.returns) == (0.75, 49, 0.0)
    assert busy_node(SchedulerConfig(core_price="none")).core_prices() == {}

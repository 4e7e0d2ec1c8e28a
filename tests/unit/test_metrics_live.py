"""The gauges a scrape reads from the engine's snapshot (``service.metrics``)."""

from __future__ import annotations

from prometheus_client import generate_latest

from tangram.scheduler.core.pricing import NodePrice
from tangram.service.metrics import LiveFigures, Metrics


def _figures(core_prices: dict[str, NodePrice]) -> LiveFigures:
    return LiveFigures(
        queue_depth=0,
        units=[],
        agents_seen_s={},
        trajectories={"thinking": 3},
        resident={},
        gpu_memory_gb={},
        core_prices=core_prices,
        think_s=12.0,
        thinking={"n0": 3, "n1": 0},
    )


def _scrape(figures: LiveFigures) -> str:
    return generate_latest(Metrics("default", lambda: figures).registry).decode()


def test_thinking_trajectories_are_counted_whatever_the_price_rule() -> None:
    # corePrice load: the price's terms leave thinking out (0), the gauge still counts them.
    load = NodePrice(utilisation=0.5, actions=4, load=0.03, thinking=0)
    for prices in ({"n0": load, "n1": load}, {}):  # load, none
        text = _scrape(_figures(prices))
        assert 'tangram_thinking_trajectories{node="n0",pool="default"} 3.0' in text
        assert 'tangram_thinking_trajectories{node="n1",pool="default"} 0.0' in text
    text = _scrape(_figures({"n0": load}))
    assert 'tangram_core_price{node="n0",pool="default"} 0.03' in text


def test_help_texts_say_what_is_counted_and_in_which_unit() -> None:
    """units_in_use said "held by running actions" while memory counted idle open
    trajectories, and no help said a unit."""
    text = _scrape(_figures({}))
    helps = {ln.split()[2]: ln for ln in text.splitlines() if ln.startswith("# HELP")}
    for name in ("tangram_units_capacity", "tangram_units_in_use"):
        assert "cpu: cores" in helps[name] and "memory_gb: GiB" in helps[name], helps[name]
    assert "running actions" in helps["tangram_units_in_use"]
    assert "trajectories placed" in helps["tangram_units_in_use"]


def test_trajectories_opened_and_closed_are_counted_and_rejections_by_reason() -> None:
    text = _scrape(_figures({}))
    assert 'tangram_trajectories_opened_total{pool="default"} 0.0' in text
    assert 'tangram_trajectories_closed_total{pool="default"} 0.0' in text
    for reason in ("queue", "trajectory", "env", "stream"):
        assert f'tangram_admission_rejected_total{{pool="default",reason="{reason}"}} 0.0' in text


def test_the_histograms_cover_the_longest_command_a_pool_allows() -> None:
    """The largest bucket was 1200 s; the example pool's maxCommandSeconds is 3600."""
    metrics = Metrics("default", lambda: _figures({}))
    metrics.phases["act"].labels("default", "exec").observe(3600.0)
    text = generate_latest(metrics.registry).decode()
    line = 'tangram_action_act_seconds_bucket{kind="exec",le="3600.0",pool="default"} 1.0'
    assert line in text

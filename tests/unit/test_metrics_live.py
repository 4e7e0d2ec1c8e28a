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

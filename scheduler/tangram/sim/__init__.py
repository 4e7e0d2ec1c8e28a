"""Discrete-event replay of traces through the real scheduler core, plus the paper's baselines."""

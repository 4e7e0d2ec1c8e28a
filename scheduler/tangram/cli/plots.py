"""PNG plots of the figures people compare (docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg

from tangram.sim.records import SimResult


def check_plot(path: str | Path) -> None:
    """Raise ``ValueError`` unless ``path`` ends in an image format matplotlib writes."""
    formats = FigureCanvasAgg.get_supported_filetypes()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in formats:
        raise ValueError(
            f"{path}: the file name must end in an image format matplotlib writes: "
            + ", ".join(f".{f}" for f in sorted(formats))
        )


def act_cdf(results: Mapping[str, SimResult], path: str | Path, title: str = "") -> None:
    """Empirical CDF of action completion time, one line per policy, log-scaled time."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, result in results.items():
        acts = np.sort(np.array([max(r.act_s, 1e-4) for r in result.records]))
        if acts.size == 0:
            continue
        y = np.arange(1, acts.size + 1) / acts.size
        ax.plot(acts, y, label=f"{policy} (avg {acts.mean():.2f} s)")
    ax.set_xscale("log")
    ax.set_xlabel("action completion time (s)")
    ax.set_ylabel("fraction of actions")
    ax.set_title(title or "ACT distribution")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def lines(
    xs: Sequence[float],
    series: Mapping[str, list[float]],
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logy: bool = False,
) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ys in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

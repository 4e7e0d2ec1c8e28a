"""DPArrange (seed 000 Appendix B, Algorithm 3) with two DP operators.

Given candidates in queue order, each with a map *allowed units -> duration*,
find the allocation that minimises the sum of durations. The table is built
once over all candidates: row ``p`` holds the optimum for the first ``p``
candidates, so the greedy eviction of Algorithm 1 (which only ever drops the
last candidate) reads every prefix from the same table instead of re-solving.

* ``BasicTable`` — the basic operator: units are interchangeable (CPU cores of
  one node). State = units used; numpy-vectorised over states.
* ``ChunkTable`` — the GPU operator (Algorithm 4): state = free buddy chunks of
  sizes 1/2/4/8. A task of k GPUs takes one aligned chunk of size 2^ceil(log2 k),
  the smallest free one that fits, splitting a larger chunk into buddies — the
  allocator of seed 000 §5.3. (Algorithm 4 as printed decomposes k over several
  chunks, which could spread one tensor-parallel instance over nodes; we keep the
  physical one-chunk rule so that the DP's states are exactly what the allocator
  will produce.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Durations = Mapping[int, float]
CHUNK_SIZES = (1, 2, 4, 8)
ChunkState = tuple[int, int, int, int]  # free chunks of size 1, 2, 4, 8


def _check(durations: Sequence[Durations]) -> None:
    """Every candidate allows some count >= 1, each with a finite duration >= 0.

    Infinite durations are rejected too: the basic operator uses ``inf`` for "no
    allocation", so it would report such a candidate as infeasible while the chunk
    operator returned an infinite total; both now refuse it up front.
    """
    for i, d in enumerate(durations):
        if not d:
            raise ValueError(f"candidate {i} allows no unit count")
        for k, t in d.items():
            if k < 1:
                raise ValueError(f"candidate {i}: unit count {k} must be >= 1")
            if not 0 <= t < math.inf:  # also rejects NaN
                raise ValueError(
                    f"candidate {i}: duration {t} at {k} units must be finite and >= 0"
                )


class BasicTable:
    """DP over interchangeable units: ``best(p)`` is the optimum for the first ``p`` candidates.

    Each row is stored with ``pad`` infinities in front, so that "the previous row at state
    j - k" is one gather at a fixed index matrix per set of allowed counts (shared by the
    candidates that allow the same counts): a row costs four numpy calls, which at these
    sizes is what a row costs at all.
    """

    def __init__(self, durations: Sequence[Durations], capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        _check(durations)
        self.capacity = capacity
        self.n = len(durations)
        inf = np.inf
        width = capacity + 1
        cols = np.arange(width)
        fitting_of = [tuple(k for k in sorted(d) if k <= capacity) for d in durations]
        self._pad = pad = max((f[-1] for f in fitting_of if f), default=0)
        row: npt.NDArray[np.float64] = np.full(pad + width, inf)
        row[pad] = 0.0
        self._rows: list[npt.NDArray[np.float64]] = [row]
        # Per candidate: its allowed counts (as an array) and the argmin per state, or None
        # when no count fits (the row is all infinite).
        self._picks: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.intp]] | None] = []
        gathers: dict[tuple[int, ...], tuple[npt.NDArray[np.int64], npt.NDArray[np.intp]]] = {}
        for d, fitting in zip(durations, fitting_of, strict=True):
            nxt = np.full(pad + width, inf)
            picked = None
            if fitting:
                shared = gathers.get(fitting)
                if shared is None:
                    ks = np.array(fitting, dtype=np.int64)
                    shared = gathers[fitting] = (ks, (cols + pad)[:, None] - ks)  # (width, K)
                ks, index = shared
                vals = row[index] + np.array([d[k] for k in fitting])
                pick = np.argmin(vals, axis=1)  # ties -> fewest units (choices are ascending)
                nxt[pad:] = vals[cols, pick]
                picked = (ks, pick)
            row = nxt
            self._rows.append(row)
            self._picks.append(picked)

    def best(self, p: int) -> tuple[float, list[int]]:
        """Optimal (total duration, units per candidate) for the first ``p`` candidates."""
        row = self._rows[p][self._pad :]
        j = int(np.argmin(row))
        total = float(row[j])
        if not np.isfinite(total):
            raise ValueError(
                f"infeasible: the first {p} candidates cannot all get an allowed unit count "
                f"within {self.capacity} units"
            )
        units = [0] * p
        for i in range(p, 0, -1):
            picked = self._picks[i - 1]
            assert picked is not None  # a finite total passes only through feasible rows
            ks, pick = picked
            k = int(ks[pick[j]])
            units[i - 1] = k
            j -= k
        return total, units


def dp_arrange(durations: Sequence[Durations], capacity: int) -> tuple[float, list[int]]:
    """Optimal allocation of at most ``capacity`` interchangeable units (docs/architecture.md).

    ``durations[i]`` maps each allowed unit count of candidate ``i`` to its duration.
    Returns ``(total_duration, [units_i, ...])``; raises ``ValueError`` when the
    candidates cannot all get one of their allowed counts, or when a duration is
    negative, NaN or infinite.
    """
    return BasicTable(durations, capacity).best(len(durations))


def chunk_level(k: int) -> int:
    """Size of the buddy chunk a k-GPU task occupies: the next power of two."""
    if not 1 <= k <= 8:
        raise ValueError(f"GPU count {k} must be between 1 and 8")
    size = 1
    while size < k:
        size *= 2
    return size


def take_chunk(state: ChunkState, k: int) -> ChunkState | None:
    """Free-chunk counts after a k-GPU task takes the smallest fitting chunk (None: no fit)."""
    need = chunk_level(k)
    counts = list(state)
    for idx, size in enumerate(CHUNK_SIZES):
        if size < need or counts[idx] == 0:
            continue
        counts[idx] -= 1
        # Splitting a chunk of `size` down to `need` leaves one free buddy per level in between.
        half = size // 2
        while half >= need:
            counts[CHUNK_SIZES.index(half)] += 1
            half //= 2
        return (counts[0], counts[1], counts[2], counts[3])
    return None


@dataclass(frozen=True, slots=True)
class _Cell:
    total: float
    prev: ChunkState
    k: int


class ChunkTable:
    """DP over buddy-chunk states (GPU operator); same prefix semantics as ``BasicTable``."""

    def __init__(self, durations: Sequence[Durations], chunks: ChunkState) -> None:
        if any(c < 0 for c in chunks) or len(chunks) != 4:
            raise ValueError(f"chunks must be four non-negative counts, got {chunks}")
        _check(durations)
        self.chunks = chunks
        self.n = len(durations)
        self._layers: list[dict[ChunkState, _Cell]] = [{chunks: _Cell(0.0, chunks, 0)}]
        for d in durations:
            layer: dict[ChunkState, _Cell] = {}
            for state, cell in self._layers[-1].items():
                for k in sorted(d):
                    if k > 8:
                        continue
                    nxt = take_chunk(state, k)
                    if nxt is None:
                        continue
                    total = cell.total + d[k]
                    old = layer.get(nxt)
                    if old is None or total < old.total:
                        layer[nxt] = _Cell(total, state, k)
            self._layers.append(layer)

    def best(self, p: int) -> tuple[float, list[int]]:
        layer = self._layers[p]
        if not layer:
            raise ValueError(
                f"infeasible: the first {p} candidates cannot all get a GPU chunk "
                f"from {self.chunks}"
            )
        # Deterministic tie-break: lowest total, then the state with the most free capacity left.
        state = min(layer, key=lambda s: (layer[s].total, -_gpus(s), s))
        total = layer[state].total
        units = [0] * p
        for i in range(p, 0, -1):
            cell = self._layers[i][state]
            units[i - 1] = cell.k
            state = cell.prev
        return total, units


def _gpus(state: ChunkState) -> int:
    return sum(c * s for c, s in zip(state, CHUNK_SIZES, strict=True))


def dp_arrange_chunks(
    durations: Sequence[Durations], chunks: ChunkState
) -> tuple[float, list[int]]:
    """The GPU variant of ``dp_arrange``: capacity is free chunk counts (N1, N2, N4, N8)."""
    return ChunkTable(durations, chunks).best(len(durations))

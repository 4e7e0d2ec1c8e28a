"""Duration profiles: given ones (Eq. 1 of seed 000) and ones learned online.

Learned profile, per action type. Under Amdahl's law with parallel fraction p,
duration(m) = t1·((1-p) + p/m) = a + b/m with a = t1·(1-p) and b = t1·p, which
is linear in x = 1/m. We keep the running sums of an ordinary least-squares
fit of observed durations against 1/m (O(1) memory and update), clamp a, b >= 0,
and read t1 = a + b and p = b / (a + b).

The fit is *trusted* only when it has at least ``min_samples`` observations over
at least two distinct unit counts and the standard error of p is at most
``max_p_stderr``. Actions of one type differ in size (one test suite is not
another), so the noise is large; the standard-error rule lets the estimate
become usable as evidence accumulates instead of demanding a tight fit. Until
then the type is scheduled as non-elastic at its minimum units, except that
every ``probe_every``-th action of an untrusted type is offered twice its
minimum, so that the fit sees a second unit count at all.

Non-elastic durations (used only to estimate when units free up) are the mean
observed duration of the type, falling back to ``default_s``.

Types are strings the clients choose, so the book keeps at most ``max_types`` of them:
past twice that, it forgets all but the ``max_types`` with the most runs (then the most
submissions), amortized O(log n) per new type, so a client inventing a type per action
cannot grow the scheduler without bound. A forgotten type starts over as an unseen one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from tangram.api.demand import AmdahlEfficiency, Efficiency, duration
from tangram.api.learned import LearnedFit


@dataclass(frozen=True, slots=True)
class Profile:
    """Single-unit duration and efficiency curve; duration(m) = t1 / (E(m)·m)."""

    t1_s: float
    efficiency: Efficiency | None

    def duration(self, m: int) -> float:
        return duration(self.t1_s, self.efficiency, m)

    def durations(self, units: tuple[int, ...]) -> dict[int, float]:
        """``duration`` of each count, Amdahl's inlined with the same arithmetic (so the
        same floats): a new elastic action's sizes are computed inside a round."""
        eff, t1 = self.efficiency, self.t1_s
        if isinstance(eff, AmdahlEfficiency) and units[0] > 0:
            p = eff.amdahl
            q = 1.0 - p
            return {m: t1 / ((1.0 / (m * (q + p / m))) * m) for m in units}
        return {m: duration(t1, eff, m) for m in units}


@dataclass(slots=True)
class _Fit:
    n: int = 0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0
    counts: set[int] = field(default_factory=set)
    submitted: int = 0

    def add(self, m: int, d: float) -> None:
        x = 1.0 / m
        self.n += 1
        self.sx += x
        self.sy += d
        self.sxx += x * x
        self.sxy += x * d
        self.syy += d * d
        self.counts.add(m)

    def mean(self) -> float:
        return self.sy / self.n

    def solve(self) -> tuple[float, float, float] | None:
        """(t1, p, stderr of p) or None when the design is degenerate."""
        n = self.n
        vx = self.sxx - self.sx * self.sx / n
        if n < 3 or vx <= 1e-12:
            return None
        b = (self.sxy - self.sx * self.sy / n) / vx
        a = (self.sy - b * self.sx) / n
        if b < 0:  # slower with more units: not elastic at all
            a, b = self.sy / n, 0.0
        elif a < 0:  # perfectly parallel; refit through the origin
            a, b = 0.0, self.sxy / self.sxx
        t1 = a + b
        if t1 <= 0:
            return None
        rss = max(
            0.0,
            self.syy
            - 2 * a * self.sy
            - 2 * b * self.sxy
            + n * a * a
            + 2 * a * b * self.sx
            + b * b * self.sxx,
        )
        se_b = math.sqrt(rss / (n - 2) / vx)
        return t1, b / t1, se_b / t1


@dataclass(slots=True)
class ProfileBook:
    """Learns profiles of action types from completed runs; pure bookkeeping."""

    min_samples: int = 8
    max_p_stderr: float = 0.1
    probe_every: int = 4
    default_s: float = 1.0
    max_types: int = 4096
    _fits: dict[str, _Fit] = field(default_factory=dict)
    # Each change of a type takes the next tick of one clock: a type forgotten and seen
    # again never gets a version it had, which a cached size might still carry.
    _versions: dict[str, int] = field(default_factory=dict)
    _clock: int = 0

    def __len__(self) -> int:
        return len(self._fits)

    def observe(self, action_type: str, units: int, duration_s: float) -> None:
        if units >= 1 and duration_s >= 0 and math.isfinite(duration_s):
            self._fit(action_type).add(units, duration_s)
            self._changed(action_type)

    def version(self, action_type: str) -> int:
        """Changes whenever what the book says about ``action_type`` may have changed
        (0: it knows nothing of it)."""
        return self._versions.get(action_type, 0)

    def _fit(self, action_type: str) -> _Fit:
        fit = self._fits.get(action_type)
        if fit is None:
            if len(self._fits) >= 2 * self.max_types:
                self._forget()
            fit = self._fits[action_type] = _Fit()
        return fit

    def _changed(self, action_type: str) -> None:
        self._clock += 1
        self._versions[action_type] = self._clock

    def _forget(self) -> None:
        """Keep the ``max_types`` types with the most runs, then the most submissions."""
        ranked = sorted(self._fits.items(), key=lambda tf: (-tf[1].n, -tf[1].submitted))
        self._fits = dict(ranked[: self.max_types])
        self._versions = {t: v for t, v in self._versions.items() if t in self._fits}

    def knows(self, action_type: str) -> bool:
        """Whether the book has seen a run of ``action_type`` (else its durations are the
        default's)."""
        fit = self._fits.get(action_type)
        return fit is not None and fit.n > 0

    def mean_duration(self, action_type: str) -> float:
        fit = self._fits.get(action_type)
        return fit.mean() if fit and fit.n else self.default_s

    def learned(self, action_type: str) -> Profile | None:
        """The learned elastic profile, once trustworthy."""
        fit = self._fits.get(action_type)
        if fit is None or fit.n < self.min_samples or len(fit.counts) < 2:
            return None
        solved = fit.solve()
        if solved is None:
            return None
        t1, p, se = solved
        if se > self.max_p_stderr:
            return None
        return Profile(t1, AmdahlEfficiency(amdahl=min(1.0, max(0.0, p))))

    def export(self, most: int, longest_name: int) -> dict[str, LearnedFit]:
        """What the book learned, by type, as a restarted scheduler takes it back: the
        ``most`` types with the most runs seen, of names up to ``longest_name``."""
        fits = [(t, f) for t, f in self._fits.items() if f.n and len(t) <= longest_name]
        fits.sort(key=lambda tf: -tf[1].n)  # stable: ties keep the order first seen
        return {
            t: LearnedFit.model_validate({**asdict(f), "counts": sorted(f.counts)})
            for t, f in fits[:most]
        }

    def restore(self, fits: Mapping[str, LearnedFit]) -> None:
        """Take back what ``export`` gave, as if those runs had been seen here."""
        for t, f in fits.items():
            self._fit(t)  # room for it, as for any new type
            self._fits[t] = _Fit(**{**f.model_dump(), "counts": set(f.counts)})
            self._changed(t)

    def should_probe(self, action_type: str) -> bool:
        """Count a submission of an untrusted elastic type; True on every ``probe_every``-th."""
        fit = self._fit(action_type)
        fit.submitted += 1
        return fit.submitted % self.probe_every == 0

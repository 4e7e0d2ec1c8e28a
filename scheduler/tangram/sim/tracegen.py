"""Synthetic traces for the paper's four scenarios (docs/architecture.md; docs/trace-generator.md).

Every parameter below is a named default with a one-line source: [T] ARL-Tangram, [H] Heddle,
[P] ProRL Agent, [E] EARL (section or table), DERIVED (arithmetic on cited numbers) or
ASSUMPTION (no number in any paper). docs/trace-generator.md has the full table with quotes.
Nothing here was chosen to reach a speed-up ratio; the only calibration target is a workload
statistic (coding busy fraction 0.47, [T] §2.3).

The module is pure: randomness comes only from ``numpy.random.default_rng(seed)``, so a
(scenario, trajectories, seed, overrides) tuple always yields the same traces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from tangram.api.action import ActionKind, ActionSpec
from tangram.api.cluster import ApiSpec, ClusterSpec, NodeSpec, ServiceSpec
from tangram.api.demand import AmdahlEfficiency, RangeDemand, TableEfficiency, duration
from tangram.api.trace import Step, TrajectoryTrace

Rng = np.random.Generator

SCENARIOS = ("coding", "deepsearch", "mopd", "mixed")


@dataclass(frozen=True)
class LogNormal:
    """Lognormal with median ``median`` and shape ``sigma``, clipped to ``[lo, hi]``."""

    median: float
    sigma: float
    lo: float = 0.0
    hi: float = math.inf

    @classmethod
    def with_mean(
        cls, mean: float, sigma: float, lo: float = 0.0, hi: float = math.inf
    ) -> LogNormal:
        """The papers often give a mean; the median of that lognormal is mean * exp(-sigma²/2)."""
        return cls(mean * math.exp(-(sigma**2) / 2), sigma, lo, hi)

    def draw(self, rng: Rng) -> float:
        return float(np.clip(rng.lognormal(math.log(self.median), self.sigma), self.lo, self.hi))

    def draws(self, rng: Rng, n: int) -> list[float]:
        values = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return [float(v) for v in np.clip(values, self.lo, self.hi)]

    def draw_count(self, rng: Rng) -> int:
        """A whole count (turns per trajectory): rounded, then clipped."""
        raw = rng.lognormal(math.log(self.median), self.sigma)
        return int(np.clip(round(float(raw)), self.lo, self.hi))


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def _check_distributions(params: object) -> None:
    """Each LogNormal field of ``params`` can be drawn from, or a ValueError names it
    (numpy's own error, "math domain error" or a NaN trace, would not)."""
    for f in fields(params):  # type: ignore[arg-type]
        d = getattr(params, f.name)
        if isinstance(d, LogNormal):
            _require(d.median > 0, f.name, f"median must be > 0, not {d.median:g}")
            _require(d.sigma >= 0, f.name, f"sigma must be >= 0, not {d.sigma:g}")
            _require(d.lo <= d.hi, f.name, f"lo ({d.lo:g}) must not exceed hi ({d.hi:g})")


# --- Clusters ([T] §6.1, §6.3) --------------------------------------------------------------

CPU_NODES = 5  # [T] §6.3 "1280 CPU cores across five nodes"
CPU_CORES_PER_NODE = 256  # [T] §6.1 "each with 256 AMD CPU cores"
CPU_NUMA_NODES = 2  # ASSUMPTION: dual-socket AMD server; not stated in [T]
CPU_NODE_MEMORY_GB = 2400.0  # [T] §6.1 "2.4 TB of memory"
GPU_NODES = 5  # [T] §6.1 "five nodes, each equipped with eight high-end NVIDIA GPUs"
GPUS_PER_NODE = 8  # [T] §6.1 (as above)
GPU_MEMORY_GB = 80.0  # ASSUMPTION: Hopper-class 80 GB HBM; GPU model not stated
GPU_NODE_MEMORY_GB = 3000.0  # [T] §6.1 "3 TB of CPU memory"

TEACHERS = 9  # [T] §6.1 "we deploy nine teacher models"
TEACHER_GPU_MEMORY_GB = 64.0  # ASSUMPTION: 32B model in bf16; size not stated
TEACHER_DOP = (2, 4, 8)  # ASSUMPTION: baseline gives each teacher 4 GPUs ([T] §6.1), so 4 fits
TEACHER_REF_DOP = 4  # [T] §6.1 "allocating four GPUs per model"; Table 1 exec assumed at DoP 4
JUDGE = "judge"
JUDGE_GPU_MEMORY_GB = 64.0  # ASSUMPTION: size not stated; must fit one 80 GB GPU for DoP 1
JUDGE_DOP = (1, 2, 4, 8)  # [T] §4.1 "(e.g. 1, 2, 4, 8)"; min 1 GPU is an ASSUMPTION
JUDGE_REF_DOP = 8  # [T] §6.1 baseline judge "degree of TP as 8"

RESTORE_FIXED_S = 1.0  # ASSUMPTION: per-restore set-up cost; [T] §5.3 gives no number
RESTORE_GBPS = 25.0  # ASSUMPTION: pinned host-to-device PCIe Gen5, per GPU, all restoring
# (one H200 alone measured 44.4 GB/s and a few ms of set-up: docs/benchmarks.md)
# An instance serves up to 8 calls at once, each slowed 10 % per call already in flight:
# the inference server's batching (SGLang in [T] §6.1), the same for the static baseline
# and the pooled instances. ASSUMPTION: [T] gives neither figure.
SERVER_BATCH = 8
SERVER_BATCH_SLOWDOWN = 0.1

SEARCH_API = "search"
PDF_API = "pdf_parse"
SEARCH_CONCURRENCY = 128  # ASSUMPTION: under the ~400 offered in flight; [T] §6.2 rate limits
SEARCH_RATE_PER_S = 100.0  # ASSUMPTION (as above; ~270 calls/s offered in the first minute)
PDF_CONCURRENCY = 16  # ASSUMPTION: PDF parsing named in [T] §6.1 without numbers
PDF_RATE_PER_S = 10.0  # ASSUMPTION (as above)

# --- GPU service elasticity ([E] §3.2, note §1.6) -------------------------------------------

SERVICE_EFFICIENCY = {1: 1.0, 2: 0.95, 4: 0.85}  # ASSUMPTION: E(m) of TP inference up to 4
E8_OVER_E4_SHORT = 1 / 1.31  # DERIVED [E] §3.2 "TP=4 (31% higher throughput)" at short context
E8_OVER_E4_LONG = 1.05  # DERIVED [E] §3.2 "switches to TP = 8, which yields 5% improvement"
LONG_CONTEXT_TOKENS = 16_000  # [E] §3.2 "When the context length reaches 16K and 32K"
TOKENS_PER_TURN = 1_000  # ASSUMPTION: [P] §1 "dozens of turns and tens of thousands of tokens"


# --- Distributions given by their mean (dataclass defaults must not call functions) -----------

# Mean [P] Table 3 "Action Time" 0.42 s (cf. [H] Table 1 coding 0.41-0.46 s); floor [T] §2.4
# "down to 1ms"; sigma 1.5 ASSUMPTION for [H] §1 "highly skewed" tool latency.
SHELL_S = LogNormal.with_mean(0.42, 1.5, 0.001, 600.0)
SEARCH_S = LogNormal.with_mean(1.42, 0.8)  # mean [H] Table 1 search "Tool Exec."; sigma ASSUMPTION
PDF_S = LogNormal.with_mean(3.0, 0.8)  # ASSUMPTION: [T] §6.1 names "PDF parsing", no numbers


# --- Scenario parameters ----------------------------------------------------------------------


@dataclass(frozen=True)
class CodingParams:
    """AI coding on CPUs: short shell actions, then one elastic test-suite reward ([T] §2.1)."""

    turns: LogNormal = LogNormal(20, 0.6, 2, 100)  # ASSUMPTION: [P] §1 "dozens of turns"
    think_s: LogNormal = LogNormal(10.0, 0.7)  # ASSUMPTION: [H] §7.5 "tens of seconds" (low end)
    shell_s: LogNormal = SHELL_S  # mean [P] Table 3 0.42 s; see SHELL_S
    reward_t1_s: LogNormal = LogNormal(200.0, 1.0, 1.0, 3600.0)  # ASSUMPTION: [P] §3.3 "minutes"
    amdahl_p: tuple[float, float] = (0.85, 0.98)  # ASSUMPTION: uniform; no number in any paper
    reward_max_cpu: int = 32  # [T] §6.4 "DoP dynamically ranges from 1 to 32"
    memory_gb: LogNormal = LogNormal(4.0, 0.5, 1.0, 16.0)  # ASSUMPTION: [T] §5.2 gives no size
    group_size: int = 16  # ASSUMPTION: GRPO G, [H] §7 "16 samples per prompt"

    def __post_init__(self) -> None:
        _check_distributions(self)
        _require(self.group_size >= 1, "group_size", "must be at least 1")
        lo, hi = self.amdahl_p
        _require(0.0 <= lo <= hi <= 1.0, "amdahl_p", "must be (lo, hi) with 0 <= lo <= hi <= 1")
        _require(self.reward_max_cpu >= 1, "reward_max_cpu", "must be at least 1")
        _require(self.turns.lo >= 2, "turns", "coding needs at least 2 turns (shell + reward)")


@dataclass(frozen=True)
class DeepSearchParams:
    """BrowseComp-style search: quota'd API calls, then one GPU judge call ([T] §6.1)."""

    api_steps: LogNormal = LogNormal(15, 0.6, 1, 100)  # ASSUMPTION: [H] §7.1 "frequent" steps
    think_s: LogNormal = LogNormal(5.0, 0.7)  # ASSUMPTION: [H] §7.1 "shorter sequences"
    search_s: LogNormal = SEARCH_S  # mean [H] Table 1 1.42 s; see SEARCH_S
    pdf_fraction: float = 0.2  # ASSUMPTION: [T] §6.1 names "PDF parsing" without numbers
    pdf_s: LogNormal = PDF_S  # ASSUMPTION; see PDF_S
    judge_s: LogNormal = LogNormal(3.0, 0.6)  # ASSUMPTION: judge latency at JUDGE_REF_DOP

    def __post_init__(self) -> None:
        _check_distributions(self)
        _require(0.0 <= self.pdf_fraction <= 1.0, "pdf_fraction", "must be in [0, 1]")


MOPD_KINDS = ("single", "coding", "search")


@dataclass(frozen=True)
class MopdParams:
    """Multi-teacher on-policy distillation: a task mix ending in a teacher log-prob call."""

    # Shares of the MOPD_KINDS (single-turn, coding-like, search-like). ASSUMPTION: [T] §6.1
    # says only "multiple RL tasks, including agentic tasks".
    type_weights: tuple[float, float, float] = (0.4, 0.3, 0.3)
    teachers: int = TEACHERS  # [T] §6.1 "nine teacher models"
    zipf_s: float = 1.0  # ASSUMPTION: uneven load, [T] §2.2 activity "vibrates ... model dimension"
    teacher_s: LogNormal = LogNormal(0.6, 0.3)  # anchor [T] Table 1 MOPD Exec 0.621 at DoP 4
    median_steps: float = 10.0  # DERIVED: median steps of the type mix (docs), scales teacher_s
    group_size: int = 16  # ASSUMPTION: GRPO G; type and teacher are fixed per prompt
    coding: CodingParams = field(default_factory=CodingParams)  # coding-like: shell params
    search: DeepSearchParams = field(default_factory=DeepSearchParams)  # search-like: API params

    def __post_init__(self) -> None:
        _check_distributions(self)
        weights = self.type_weights
        _require(min(weights) >= 0 and sum(weights) > 0, "type_weights", "must be >= 0, not all 0")
        _require(1 <= self.teachers <= TEACHERS, "teachers", f"must be 1..{TEACHERS}")
        _require(self.median_steps > 0, "median_steps", "must be > 0")
        _require(self.group_size >= 1, "group_size", "must be at least 1")


@dataclass(frozen=True)
class MixedParams:
    """MOPD and DeepSearch concurrently on one GPU cluster ([T] §6.1, Fig 8(b) right)."""

    mopd_fraction: float = 0.5  # ASSUMPTION: [T] §6.3 "batch size of 1024" read as per task
    mopd: MopdParams = field(default_factory=MopdParams)
    deepsearch: DeepSearchParams = field(default_factory=DeepSearchParams)

    def __post_init__(self) -> None:
        _require(0.0 <= self.mopd_fraction <= 1.0, "mopd_fraction", "must be in [0, 1]")


Params = CodingParams | DeepSearchParams | MopdParams | MixedParams

DEFAULTS: dict[str, Params] = {
    "coding": CodingParams(),
    "deepsearch": DeepSearchParams(),
    "mopd": MopdParams(),
    "mixed": MixedParams(),
}


# --- Public API -------------------------------------------------------------------------------


def generate(
    scenario: str, trajectories: int, seed: int, **overrides: Any
) -> list[TrajectoryTrace]:
    """``trajectories`` traces of one RL step of ``scenario``, deterministic for ``seed``.

    ``overrides`` replace fields of the scenario's parameter dataclass (e.g. ``group_size=1``
    for ``coding``); an unknown field or a value of the wrong type raises ``ValueError``.
    """
    _check_scenario(scenario)
    if isinstance(trajectories, bool) or not isinstance(trajectories, int) or trajectories < 1:
        raise ValueError(f"trajectories: must be an integer >= 1, got {trajectories!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed: must be an integer >= 0, got {seed!r}")
    params = _with_overrides(DEFAULTS[scenario], overrides)
    rng = np.random.default_rng(seed)
    if isinstance(params, CodingParams):
        return _coding_batch(rng, params, trajectories)
    if isinstance(params, DeepSearchParams):
        return _deepsearch_batch(rng, params, trajectories)
    if isinstance(params, MopdParams):
        return _mopd_batch(rng, params, trajectories)
    return _mixed_batch(rng, params, trajectories)


def scenario_cluster(
    scenario: str,
    *,
    cpu_nodes: int = CPU_NODES,
    gpu_nodes: int = GPU_NODES,
    quota_scale: float = 1.0,
    restore_gbps: float = RESTORE_GBPS,
    restore_fixed_s: float = RESTORE_FIXED_S,
) -> ClusterSpec:
    """The paper's cluster for ``scenario``.

    coding: CPU nodes only. deepsearch: GPU nodes with the judge, plus the API quotas.
    mopd: CPU nodes (coding-like trajectories), GPU nodes with the teachers, API quotas
    (search-like trajectories). mixed: all of it, teachers and judge (10 services).
    ``cpu_nodes``/``gpu_nodes`` shrink or grow the capacity; ``quota_scale`` multiplies every
    API limit (the note asks for a sweep over 0.25-2x). ``restore_gbps`` and
    ``restore_fixed_s`` set the services' restore cost (``restore_seconds``), for a
    machine whose restores were measured (``tangram bench gpu``).
    """
    _check_scenario(scenario)
    if cpu_nodes < 0 or gpu_nodes < 0:
        raise ValueError("cpu_nodes/gpu_nodes: must be >= 0")
    if quota_scale <= 0:
        raise ValueError(f"quota_scale: must be > 0, got {quota_scale}")
    if not (restore_gbps > 0 and math.isfinite(restore_gbps)):
        raise ValueError(f"restore_gbps: must be a number > 0, got {restore_gbps}")
    if not (restore_fixed_s >= 0 and math.isfinite(restore_fixed_s)):
        raise ValueError(f"restore_fixed_s: must be a number >= 0, got {restore_fixed_s}")
    cpu = [_cpu_node(i) for i in range(cpu_nodes)]
    gpu = [_gpu_node(i) for i in range(gpu_nodes)]
    restore = (restore_gbps, restore_fixed_s)
    teachers = [_teacher_service(i, *restore) for i in range(1, TEACHERS + 1)]
    judge = _judge_service(*restore)
    if scenario == "coding":
        return ClusterSpec(nodes=cpu)
    if scenario == "deepsearch":
        return ClusterSpec(nodes=gpu, services=[judge], apis=_apis(quota_scale))
    if scenario == "mopd":
        return ClusterSpec(nodes=cpu + gpu, services=teachers, apis=_apis(quota_scale))
    return ClusterSpec(nodes=cpu + gpu, services=[*teachers, judge], apis=_apis(quota_scale))


def service_efficiency(steps: int) -> TableEfficiency:
    """E(m) of a GPU service call over a trajectory of ``steps`` turns ([E] §3.2).

    Long contexts favour TP 8 (E(8)/E(4) = 1.05), short ones TP 4 (E(8)/E(4) = 1/1.31).
    """
    long_context = steps * TOKENS_PER_TURN >= LONG_CONTEXT_TOKENS
    ratio = E8_OVER_E4_LONG if long_context else E8_OVER_E4_SHORT
    e8 = round(SERVICE_EFFICIENCY[4] * ratio, 4)
    return TableEfficiency(table={**SERVICE_EFFICIENCY, 8: e8})


def restore_seconds(gpu_memory_gb: float, gbps: float = RESTORE_GBPS) -> float:
    """``restore_s``: copying the whole model over one GPU's host link (the note's model).

    The cost at DoP m is ``restore_fixed_s + restore_s / m`` (``ServiceSpec.restore_cost``),
    with ``restore_fixed_s = RESTORE_FIXED_S`` unless a cluster is given another.
    """
    return round(gpu_memory_gb / gbps, 3)


def zipf_weights(n: int, s: float = 1.0) -> np.ndarray:
    """The chance of each of ``n`` ranks under Zipf's law of exponent ``s`` (rank 1 first)."""
    zipf = 1.0 / np.arange(1, n + 1) ** s
    weights: np.ndarray = zipf / zipf.sum()
    return weights


def teacher_name(rank: int) -> str:
    """Teachers are ranked by popularity: ``teacher-1`` gets the most calls (Zipf)."""
    return f"teacher-{rank}"


# --- Cluster pieces ---------------------------------------------------------------------------


def _cpu_node(i: int) -> NodeSpec:
    return NodeSpec(
        name=f"cpu-{i}",
        cpus=CPU_CORES_PER_NODE,
        numa_nodes=CPU_NUMA_NODES,
        memory_gb=CPU_NODE_MEMORY_GB,
    )


def _gpu_node(i: int) -> NodeSpec:
    # No cores for exec actions: [T] runs sandboxes on the separate CPU cluster.
    return NodeSpec(
        name=f"gpu-{i}",
        memory_gb=GPU_NODE_MEMORY_GB,
        gpus=GPUS_PER_NODE,
        gpu_memory_gb=GPU_MEMORY_GB,
    )


def _teacher_service(rank: int, restore_gbps: float, restore_fixed_s: float) -> ServiceSpec:
    return ServiceSpec(
        name=teacher_name(rank),
        gpu_memory_gb=TEACHER_GPU_MEMORY_GB,
        dop_choices=list(TEACHER_DOP),
        restore_s=restore_seconds(TEACHER_GPU_MEMORY_GB, restore_gbps),
        restore_fixed_s=restore_fixed_s,
        efficiency=service_efficiency(1),  # default for calls that carry no profile
        max_calls=SERVER_BATCH,
        batch_slowdown=SERVER_BATCH_SLOWDOWN,
    )


def _judge_service(restore_gbps: float, restore_fixed_s: float) -> ServiceSpec:
    return ServiceSpec(
        name=JUDGE,
        gpu_memory_gb=JUDGE_GPU_MEMORY_GB,
        dop_choices=list(JUDGE_DOP),
        restore_s=restore_seconds(JUDGE_GPU_MEMORY_GB, restore_gbps),
        restore_fixed_s=restore_fixed_s,
        efficiency=service_efficiency(1),
        max_calls=SERVER_BATCH,
        batch_slowdown=SERVER_BATCH_SLOWDOWN,
    )


def _apis(scale: float) -> list[ApiSpec]:
    return [
        ApiSpec(
            name=SEARCH_API,
            concurrency=max(1, round(SEARCH_CONCURRENCY * scale)),
            rate_per_s=SEARCH_RATE_PER_S * scale,
        ),
        ApiSpec(
            name=PDF_API,
            concurrency=max(1, round(PDF_CONCURRENCY * scale)),
            rate_per_s=PDF_RATE_PER_S * scale,
        ),
    ]


# --- Validation -------------------------------------------------------------------------------


def _check_scenario(scenario: str) -> None:
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario: unknown {scenario!r}; expected one of {', '.join(SCENARIOS)}")


def _with_overrides(params: Params, overrides: dict[str, Any]) -> Params:
    known = {f.name: getattr(params, f.name) for f in fields(params)}
    for name, value in overrides.items():
        if name not in known:
            raise ValueError(f"{name}: not a parameter of {type(params).__name__}")
        default = known[name]
        # A float parameter takes an int; an int parameter (a count) takes only an int.
        wanted: tuple[type, ...] = (int, float) if isinstance(default, float) else (type(default),)
        if isinstance(value, bool) or not isinstance(value, wanted):
            raise ValueError(f"{name}: expected {type(default).__name__}, got {value!r}")
    return replace(params, **overrides)


# --- Actions ----------------------------------------------------------------------------------

# Traces are for people too: durations to the millisecond, t1 never rounded down to zero.


def _secs(x: float) -> float:
    return max(round(x, 3), 0.001)


def _think(x: float) -> float:
    return round(x, 3)


def _shell(t_s: float) -> ActionSpec:
    return ActionSpec(kind=ActionKind.EXEC, type="coding.shell", cpu=1, t1_s=_secs(t_s))


def _reward(t1_s: float, amdahl: float, max_cpu: int) -> ActionSpec:
    return ActionSpec(
        kind=ActionKind.EXEC,
        type="coding.reward",
        cpu=RangeDemand(min=1, max=max_cpu),
        t1_s=_secs(t1_s),
        efficiency=AmdahlEfficiency(amdahl=round(amdahl, 4)),
    )


def _search(search_s: float, pdf_s: float | None) -> ActionSpec:
    if pdf_s is None:
        return ActionSpec(
            kind=ActionKind.API, type="search.api", api=SEARCH_API, t1_s=_secs(search_s)
        )
    # A fetch-and-parse step holds both quotas for its whole (atomic) duration.
    return ActionSpec(
        kind=ActionKind.API,
        type="search.pdf",
        api=SEARCH_API,
        quotas={PDF_API: 1},
        t1_s=_secs(search_s + pdf_s),
    )


def service_call(name: str, type_: str, t_ref_s: float, ref_dop: int, steps: int) -> ActionSpec:
    """A call of service ``name`` measured as ``t_ref_s`` at DoP ``ref_dop``, over a
    trajectory of ``steps`` turns (``service_efficiency``); t1 = t(m)·m·E(m) ([T] Eq. 1)."""
    eff = service_efficiency(steps)
    t1 = t_ref_s * ref_dop * eff.efficiency(ref_dop)
    return ActionSpec(
        kind=ActionKind.SERVICE, type=type_, service=name, t1_s=_secs(t1), efficiency=eff
    )


# --- Step sequences ---------------------------------------------------------------------------


def _shell_steps(rng: Rng, p: CodingParams, n: int) -> list[Step]:
    thinks, runs = p.think_s.draws(rng, n), p.shell_s.draws(rng, n)
    return [Step(think_s=_think(k), action=_shell(r)) for k, r in zip(thinks, runs, strict=True)]


def _search_steps(rng: Rng, p: DeepSearchParams, n: int) -> list[Step]:
    thinks, searches = p.think_s.draws(rng, n), p.search_s.draws(rng, n)
    with_pdf = rng.random(n) < p.pdf_fraction
    # Drawn for every step (used only where with_pdf) so one step's coin never shifts the rest.
    pdfs = p.pdf_s.draws(rng, n)
    return [
        Step(
            think_s=_think(thinks[i]), action=_search(searches[i], pdfs[i] if with_pdf[i] else None)
        )
        for i in range(n)
    ]


# --- Scenarios --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CodingPrompt:
    """What the samples of one prompt share: the repository's test suite and image."""

    reward_t1_s: float
    amdahl: float
    memory_gb: float


def _coding_prompt(rng: Rng, p: CodingParams) -> _CodingPrompt:
    lo, hi = p.amdahl_p
    return _CodingPrompt(
        p.reward_t1_s.draw(rng), float(rng.uniform(lo, hi)), round(p.memory_gb.draw(rng), 2)
    )


def _coding_batch(rng: Rng, p: CodingParams, n: int) -> list[TrajectoryTrace]:
    out: list[TrajectoryTrace] = []
    prompt = _coding_prompt(rng, p)
    for i in range(n):
        if i and i % p.group_size == 0:
            prompt = _coding_prompt(rng, p)
        turns = p.turns.draw_count(rng)
        steps = _shell_steps(rng, p, turns - 1)
        reward = _reward(prompt.reward_t1_s, prompt.amdahl, p.reward_max_cpu)
        steps.append(Step(think_s=_think(p.think_s.draw(rng)), action=reward))
        out.append(_trajectory(f"coding-{i}", "coding", steps, memory_gb=prompt.memory_gb))
    return out


def _deepsearch_batch(
    rng: Rng, p: DeepSearchParams, n: int, arrival_s: float = 0.0
) -> list[TrajectoryTrace]:
    out: list[TrajectoryTrace] = []
    for i in range(n):
        steps = _search_steps(rng, p, p.api_steps.draw_count(rng))
        judge = service_call(
            JUDGE, "search.judge", p.judge_s.draw(rng), JUDGE_REF_DOP, len(steps) + 1
        )
        steps.append(Step(think_s=_think(p.think_s.draw(rng)), action=judge))
        out.append(_trajectory(f"deepsearch-{i}", "deepsearch", steps, arrival_s=arrival_s))
    return out


@dataclass(frozen=True)
class _MopdPrompt:
    """What the samples of one prompt share: its task kind, its teacher and (coding) image."""

    kind: str  # one of MOPD_KINDS
    teacher: str
    memory_gb: float


def _mopd_prompt(rng: Rng, p: MopdParams) -> _MopdPrompt:
    weights = np.asarray(p.type_weights, dtype=float)
    kind = MOPD_KINDS[int(rng.choice(len(MOPD_KINDS), p=weights / weights.sum()))]
    teacher = teacher_name(int(rng.choice(p.teachers, p=zipf_weights(p.teachers, p.zipf_s))) + 1)
    memory = round(p.coding.memory_gb.draw(rng), 2) if kind == "coding" else 0.0
    return _MopdPrompt(kind, teacher, memory)


def _mopd_agent_steps(rng: Rng, p: MopdParams, kind: str) -> list[Step]:
    """The tool-using part of a MOPD trajectory; the teacher call comes after it."""
    if kind == "coding":  # as many steps as a coding trajectory, the teacher call last
        return _shell_steps(rng, p.coding, p.coding.turns.draw_count(rng) - 1)
    if kind == "search":
        return _search_steps(rng, p.search, p.search.api_steps.draw_count(rng))
    return []


def _mopd_batch(rng: Rng, p: MopdParams, n: int) -> list[TrajectoryTrace]:
    out: list[TrajectoryTrace] = []
    prompt = _mopd_prompt(rng, p)
    for i in range(n):
        if i and i % p.group_size == 0:
            prompt = _mopd_prompt(rng, p)
        steps = _mopd_agent_steps(rng, p, prompt.kind)
        total = len(steps) + 1
        # Log-probs are one forward pass over the trajectory, so cost grows with its length.
        t_ref = p.teacher_s.draw(rng) * total / p.median_steps
        teacher = service_call(prompt.teacher, "mopd.teacher", t_ref, TEACHER_REF_DOP, total)
        think = p.search.think_s if prompt.kind == "search" else p.coding.think_s
        steps.append(Step(think_s=_think(think.draw(rng)), action=teacher))
        out.append(_trajectory(f"mopd-{i}", "mopd", steps, memory_gb=prompt.memory_gb))
    return out


def _mixed_batch(rng: Rng, p: MixedParams, n: int) -> list[TrajectoryTrace]:
    n_mopd = math.ceil(n * p.mopd_fraction - 1e-9)  # MOPD gets the odd one; no float creep
    mopd = _mopd_batch(rng, p.mopd, n_mopd) if n_mopd else []
    # The two tasks step independently ([T] §6.2 "partially interleaved"): the DeepSearch step
    # starts at a random point of the MOPD step, whose unqueued makespan bounds the offset.
    makespan = max((_unqueued_s(t) for t in mopd), default=0.0)
    offset = round(float(rng.uniform(0.0, makespan)), 3)
    return mopd + _deepsearch_batch(rng, p.deepsearch, n - n_mopd, arrival_s=offset)


def _unqueued_s(traj: TrajectoryTrace) -> float:
    """Lifetime without queueing: exec/api at one unit, teacher calls at the baseline's DoP 4."""
    total = 0.0
    for step in traj.steps:
        a = step.action
        units = TEACHER_REF_DOP if a.kind is ActionKind.SERVICE else 1
        total += step.think_s + duration(a.t1_s or 0.0, a.efficiency, units)
    return total


def _trajectory(
    tid: str, task: str, steps: list[Step], memory_gb: float = 0.0, arrival_s: float = 0.0
) -> TrajectoryTrace:
    return TrajectoryTrace(
        version=1, id=tid, task=task, arrival_s=arrival_s, memory_gb=memory_gb, steps=steps
    )

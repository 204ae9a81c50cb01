"""Issue 14's goals (``GOALS``) and issue 29's long-run goals (``LONG_RUN_GOALS``, for
``--long``) for shmtier against vLLM's own tiering (0.33 or 0.34) on the same trace: each
figure, its bound and whether a set of runs meets it; and issue 29's per-step fixed costs
(``FIXED_COSTS``), judged the same way.

Who calls: ``bench/tiering_steps.py`` after a set that ran vLLM (printed, and stored in its
JSON as ``goals``) and ``bench/goals.py`` over saved JSON files (the runs of several sets
pooled into one verdict). Pure functions of tiering_steps' per-run summaries
(``shmtier/bench/report.py``'s ``summarise``); the tests feed them fixed inputs.

How a figure is judged: the ratio shmtier ÷ vLLM of the two managers' medians over runs,
against the goal's bound ("at most" or "at least"); the ratio per run pair (run i of each
manager, which ran back to back) is shown as the spread, with how many pairs were within
the bound. Bytes on disk is shmtier's own figure (bytes on disk per logical byte; vLLM
writes 1.00), judged by its median. A figure a run lacks (an older JSON, no promotion in
the run) is "n/a" and neither met nor missed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shmtier.bench.common import fmt_mr, med_range

__all__ = ["Goal", "GOALS", "LONG_RUN_GOALS", "FIXED_COSTS", "whole_run_cpu_s", "evaluate",
           "format_goals"]


def whole_run_cpu_s(s: dict) -> float | None:
    """CPU of the scheduler process over the run, the driver's own work included (the same
    for both managers), plus shmtier's tier worker processes (vLLM has none: its I/O
    threads are in the scheduler process)."""
    if s.get("cpu_s") is None:
        return None
    return s["cpu_s"] + (s.get("workers_cpu_s") or 0.0)


@dataclass(frozen=True)
class Goal:
    figure: str
    value: Callable[[dict], float | None]  # of one run's summary
    bound: float
    at_most: bool = True  # False: the figure must be at least ``bound``
    absolute: bool = False  # judged on shmtier's own value, not the ratio to vLLM's

    def within(self, x: float) -> bool:
        return x <= self.bound if self.at_most else x >= self.bound


def _key(name: str) -> Callable[[dict], float | None]:
    return lambda s: s.get(name)


def _per_step(field: str, kind: str) -> Callable[[dict], float | None]:
    """A call kind's µs per step: ``field`` ``per_kind_us_per_step`` (wall) or
    ``per_kind_cpu_us_per_step`` (on-CPU) of the summary."""
    return lambda s: (s.get(field) or {}).get(kind)


#: the table of issue 14, in its order
GOALS = (
    Goal("step time p99", _key("step_us_p99"), 0.5),
    Goal("step time p99.9", _key("step_us_p999"), 0.3),
    Goal("step time max", _key("step_us_max"), 0.5),
    Goal("step time p50", _key("step_us_p50"), 1.0),
    Goal("scheduler-process CPU in the spec", _key("spec_cpu_s"), 0.25),
    Goal("scheduler process + tier workers, whole run", whole_run_cpu_s, 1.5),
    Goal("promotion p50", _key("promo_ms_p50"), 0.4),
    Goal("hit rate (secondary tier)", _key("hit_fs"), 1.0, at_most=False),
    Goal("bytes on disk ÷ logical", _key("disk_per_logical"), 0.70, absolute=True),
)

#: issue 29's goals for its long run on a quiet host (bench/README.md, "Cost per byte over
#: a long run")
LONG_RUN_GOALS = (
    Goal("scheduler process + tier workers CPU", whole_run_cpu_s, 1.0),
    Goal("step time p50", _key("step_us_p50"), 1.0),
    Goal("promotion p50", _key("promo_ms_p50"), 0.5),
    Goal("wrong KV served", _key("wrong_kv"), 0, absolute=True),
)


#: issue 29's deliverable 4: the scheduler thread's per-step fixed costs, each call's µs
#: per step (its time over the run / steps) at or below vLLM's
FIXED_COSTS = (
    Goal("get_stats µs per step, wall", _per_step("per_kind_us_per_step", "get_stats"), 1.0),
    Goal("get_stats µs per step, on-CPU", _per_step("per_kind_cpu_us_per_step", "get_stats"), 1.0),
    Goal("on_schedule_end µs per step, wall",
         _per_step("per_kind_us_per_step", "on_schedule_end"), 1.0),
    Goal("on_schedule_end µs per step, on-CPU",
         _per_step("per_kind_cpu_us_per_step", "on_schedule_end"), 1.0),
)


def evaluate(shm: list[dict], vllm: list[dict], goals=GOALS) -> list[dict]:
    """One row per goal for shmtier's runs ``shm`` against vLLM's runs ``vllm`` (summaries,
    run i of each a pair): ``figure``, ``bound``, ``at_most``, ``absolute``, ``shm`` and
    ``vllm`` (median, min, max or None), ``ratio`` (of the medians; shmtier's median for an
    absolute goal; None when a side lacks the figure), ``pairs`` (the per-pair ratios, or
    shmtier's values for an absolute goal), ``pairs_within`` and ``met`` (None: n/a)."""
    if not shm or not vllm:
        raise ValueError("evaluate: need runs of both managers")
    rows = []
    for goal in goals:
        a = [goal.value(s) for s in shm]
        b = [goal.value(s) for s in vllm]
        mr_a, mr_b = med_range(a), med_range(b)
        if goal.absolute:
            ratio = mr_a[0] if mr_a else None
            pairs = [x for x in a if x is not None]
        else:
            ratio = mr_a[0] / mr_b[0] if mr_a and mr_b and mr_b[0] else None
            pairs = [x / y for x, y in zip(a, b) if x is not None and y]
        rows.append({
            "figure": goal.figure, "bound": goal.bound, "at_most": goal.at_most,
            "absolute": goal.absolute, "shm": mr_a, "vllm": mr_b, "ratio": ratio,
            "pairs": pairs, "pairs_within": sum(1 for x in pairs if goal.within(x)),
            "met": None if ratio is None else goal.within(ratio),
        })
    return rows


def format_goals(rows: list[dict], name: str = "shmtier", baseline: str = "vLLM") -> list[str]:
    """``evaluate``'s rows as a table (one line per goal) and a last line counting the
    goals met; ``name`` and ``baseline`` (e.g. "vLLM 0.34.0") head the two columns."""
    lines = [f"{'figure':<46}{'goal':>8}{name:>26}{baseline:>26}{'ratio':>8}"
             f"{'per pair':>14}{'pairs in':>10}  verdict"]
    for r in rows:
        big = r["shm"] is not None and r["shm"][0] >= 100
        digits = 0 if big else 3
        bound = ("<= " if r["at_most"] else ">= ") + f"{r['bound']:g}"
        pairs = f"{min(r['pairs']):.2f}-{max(r['pairs']):.2f}" if r["pairs"] else "-"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"  # 0.999 is not 1.00
        verdict = "n/a" if r["met"] is None else ("met" if r["met"] else "NOT MET")
        what = r["figure"] + (" (shmtier's own)" if r["absolute"] else "")
        lines.append(f"{what:<46}{bound:>8}{fmt_mr(r['shm'], digits):>26}"
                     f"{fmt_mr(r['vllm'], digits):>26}{ratio:>8}{pairs:>14}"
                     f"{r['pairs_within']:>5} of {len(r['pairs']):<2}  {verdict}")
    judged = [r for r in rows if r["met"] is not None]
    lines.append(f"{sum(r['met'] for r in judged)} of {len(judged)} goals met "
                 f"({len(rows) - len(judged)} n/a)")
    return lines

"""What the slowest engine steps are made of: per step, what can explain a slow one.

Who calls: ``shmtier/bench/driver.py`` (the tiering_steps.py driver), on its one thread, in
the bench process. A ``StepProbe`` brackets every timed manager region (``begin`` before
the region's clocks are read, ``end`` after), is told when a step ends (``step_end``) and
gets the interpreter's GC callbacks (``on_gc``). Per step it records, over the timed
regions only (the driver's own bookkeeping and the row fill are not counted):

* GC: collections that ran inside a region, their time, the oldest generation;
* page faults of the scheduler thread: minor and major (``getrusage(RUSAGE_THREAD)``);
* context switches of the thread: involuntary (descheduled by the kernel) and voluntary
  (it blocked: a lock, a syscall);
* keys handled per call kind (the length of the call's key list; lookups: calls), and
  the involuntary switches per call kind (in which call the thread lost the CPU).

``attribute`` then reads what the slowest steps (wall >= p99.9, and the max step) of one
or more runs spent their time on, next to the median step: share of wall in GC, descheduled (wall - thread
CPU), lock wait, per call kind; faults and switches as counts. ``format_table`` prints it.
Both are pure functions of the recorded lists (tests feed them fixed inputs).

Cost: two ``getrusage`` calls per region (about 1.2 µs each, outside the timed clocks)
and no GC-tracked allocation per region. Never blocks.
"""

from __future__ import annotations

import resource
import time

__all__ = ["StepProbe", "attribute", "format_table", "FIELDS"]

#: per-step counters a probe records, in this order
FIELDS = ("gc_ns", "gc_collections", "gc_gen_max", "minflt", "majflt", "nivcsw", "nvcsw")

_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


class StepProbe:
    """Per-step attribution counters over the driver's timed regions (see the module doc).

    ``kinds``: the driver's call kinds (its ``KINDS``), in order; ``keys[step][i]`` counts
    the keys handled by kind ``kinds[i]``, ``nivcsw_kinds[step][i]`` its involuntary
    context switches."""

    def __init__(self, kinds: tuple[str, ...]):
        self.kinds = kinds
        self._kind_idx = {k: i for i, k in enumerate(kinds)}
        self.steps: dict[str, list[int]] = {f: [] for f in FIELDS}
        self.keys: list[list[int]] = []
        self.nivcsw_kinds: list[list[int]] = []
        self._cur = [0] * len(FIELDS)
        self._cur_keys = [0] * len(kinds)
        self._cur_sw = [0] * len(kinds)
        self._depth = 0  # > 0 inside a timed region
        self._gc_t0 = 0
        self._gc_ns = 0  # GC time inside regions, this step
        self._gc_n = 0
        self._gc_gen = -1

    # --- the driver's hooks ---

    def on_gc(self, phase: str, info: dict) -> None:
        """``gc.callbacks`` entry: a collection inside a timed region counts to the step."""
        if not self._depth:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter_ns()
        else:
            self._gc_ns += time.perf_counter_ns() - self._gc_t0
            self._gc_n += 1
            if info["generation"] > self._gc_gen:
                self._gc_gen = info["generation"]

    def begin(self):
        """Before a timed region's clocks are read; returns the token for ``end``."""
        self._depth += 1
        return resource.getrusage(_RUSAGE_THREAD)

    def end(self, token, kind: str, keys: int = 1) -> None:
        """After the region's clocks are read: book its faults and switches to this step,
        and ``keys`` keys handled to ``kind``."""
        ru = resource.getrusage(_RUSAGE_THREAD)
        self._depth -= 1
        cur = self._cur
        cur[3] += ru.ru_minflt - token.ru_minflt
        cur[4] += ru.ru_majflt - token.ru_majflt
        sw = ru.ru_nivcsw - token.ru_nivcsw
        cur[5] += sw
        cur[6] += ru.ru_nvcsw - token.ru_nvcsw
        i = self._kind_idx[kind]
        self._cur_keys[i] += keys
        self._cur_sw[i] += sw

    def step_end(self) -> None:
        """The step's figures are complete: store them and start the next step."""
        cur = self._cur
        cur[0], cur[1], cur[2] = self._gc_ns, self._gc_n, self._gc_gen
        for f, v in zip(FIELDS, cur):
            self.steps[f].append(v)
        self.keys.append(self._cur_keys)
        self.nivcsw_kinds.append(self._cur_sw)
        self._cur = [0] * len(FIELDS)
        self._cur_keys = [0] * len(self.kinds)
        self._cur_sw = [0] * len(self.kinds)
        self._gc_ns = self._gc_n = 0
        self._gc_gen = -1

    def result(self) -> dict:
        """The recorded lists, for the run's raw figures (JSON-able)."""
        return {"kinds": list(self.kinds), "keys": self.keys, "nivcsw_kinds": self.nivcsw_kinds,
                **self.steps}


def _slow_set(step_ns: list[int], q: float) -> list[int]:
    """Indices of the steps at or above the nearest-rank ``q`` percentile of wall time."""
    s = sorted(step_ns)
    cut = s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]
    return [i for i, v in enumerate(step_ns) if v >= cut]


def attribute(runs: list[dict], q: float = 99.9) -> dict:
    """What the steps at or above the ``q`` percentile (``"p99.9"``), the slowest step
    (``"max"``) and the median step (``"p50"``: the one step at the median) are made of,
    each group pooled over ``runs`` (the groups are chosen per run).

    A run is a dict of the driver's per-step lists ``step_ns`` (wall), ``step_cpu_ns``
    (thread CPU), ``step_kinds`` (wall ns per kind) and ``slow`` (a probe's ``result()``).
    Per group: ``steps`` (count), ``wall_us`` and ``cpu_us`` (means), shares of wall (0..1)
    for ``gc``, ``descheduled`` (wall - CPU) and each kind (``kinds``: kind -> (share of
    wall, keys per step, involuntary switches per step); ``lock wait`` is a kind), means per step of ``gc_collections``,
    ``minflt``, ``majflt``, ``nivcsw``, ``nvcsw``, ``gc_gen_max`` (the oldest generation
    collected, -1: none), and ``with_gc``/``with_faults``/``with_nivcsw``: the share of the
    group's steps with at least one."""
    if not runs:
        raise ValueError("attribute: no runs")
    kinds = runs[0]["slow"]["kinds"]
    pooled: dict[str, list] = {}
    for r_no, run in enumerate(runs):
        step_ns, probe = run["step_ns"], run["slow"]
        n = len(step_ns)
        if not n:
            raise ValueError(f"attribute: run {r_no} recorded no steps")
        if probe["kinds"] != kinds:
            raise ValueError(f"attribute: run {r_no} has kinds {probe['kinds']}, run 0 {kinds}")
        for name, seq in (("step_cpu_ns", run["step_cpu_ns"]), ("step_kinds", run["step_kinds"]),
                          ("slow keys", probe["keys"]), ("slow nivcsw_kinds", probe["nivcsw_kinds"]),
                          *((f, probe[f]) for f in FIELDS)):
            if len(seq) != n:
                raise ValueError(f"attribute: run {r_no}: {name} has {len(seq)} steps, "
                                 f"step_ns has {n}")
        order = sorted(range(n), key=step_ns.__getitem__)
        for name, idx in ((f"p{q:g}", _slow_set(step_ns, q)), ("max", [order[-1]]),
                          ("p50", [order[(n - 1) // 2]])):
            pooled.setdefault(name, []).extend((run, i) for i in idx)
    out = {}
    for name, members in pooled.items():
        k = len(members)
        wall = sum(run["step_ns"][i] for run, i in members)
        cpu = sum(run["step_cpu_ns"][i] for run, i in members)

        def total(f):
            return sum(run["slow"][f][i] for run, i in members)

        def share(x):
            return x / wall if wall else 0.0

        g = {"steps": k, "wall_us": wall / k / 1e3, "cpu_us": cpu / k / 1e3,
             "gc": share(total("gc_ns")), "descheduled": share(max(0, wall - cpu))}
        for f in ("gc_collections", "minflt", "majflt", "nivcsw", "nvcsw"):
            g[f] = total(f) / k
        g["gc_gen_max"] = max(run["slow"]["gc_gen_max"][i] for run, i in members)
        g["with_gc"] = sum(1 for run, i in members if run["slow"]["gc_collections"][i]) / k
        g["with_faults"] = sum(1 for run, i in members
                               if run["slow"]["minflt"][i] or run["slow"]["majflt"][i]) / k
        g["with_nivcsw"] = sum(1 for run, i in members if run["slow"]["nivcsw"][i]) / k
        g["kinds"] = {kind: (share(sum(run["step_kinds"][i][j] for run, i in members)),
                             sum(run["slow"]["keys"][i][j] for run, i in members) / k,
                             sum(run["slow"]["nivcsw_kinds"][i][j] for run, i in members) / k)
                      for j, kind in enumerate(kinds)}
        out[name] = g
    return out


def format_table(att: dict, top: int = 4) -> list[str]:
    """Lines of the "slowest steps are made of" table for one run's ``attribute``: a column
    per group (the p99.9 steps, the max step, the median step for comparison); the ``top``
    call kinds by share of the slow groups' wall (``lock wait`` is always shown)."""
    groups = [g for g in att if g != "p50"] + ["p50"]
    slow = [g for g in groups if g != "p50"]
    kinds = list(next(iter(att.values()))["kinds"])
    ranked = sorted((k for k in kinds if k != "lock wait"),
                    key=lambda k: -max(att[g]["kinds"][k][0] for g in slow))[:top]
    w = 22
    heads = {g: (f"{g} steps (n={att[g]['steps']})" if g.startswith("p") and g != "p50"
                 else f"{g} step") for g in groups}
    lines = [f"{'':<34}" + "".join(f"{heads[g]:>{w}}" for g in groups)]

    def row(label, cell):
        lines.append(f"{label:<34}" + "".join(f"{cell(att[g]):>{w}}" for g in groups))

    row("wall µs (mean)", lambda a: f"{a['wall_us']:.0f}")
    row("  on-CPU µs", lambda a: f"{a['cpu_us']:.0f}")
    row("  descheduled/waiting (wall-CPU)", lambda a: f"{a['descheduled']:.0%}")
    row("  GC inside the calls", lambda a: f"{a['gc']:.0%}")
    row("    collections; oldest gen", lambda a: f"{a['gc_collections']:.1f}; "
        + (f"{a['gc_gen_max']}" if a["gc_gen_max"] >= 0 else "-"))
    row("  lock wait", lambda a: f"{a['kinds']['lock wait'][0]:.0%}")
    lines.append("  by call kind: share (keys; invol. switches)")
    for k in ranked:
        row(f"    {k}", lambda a, k=k: "{:.0%} ({:.0f}; {:.1f})".format(*a["kinds"][k]))
    row("page faults minor / major", lambda a: f"{a['minflt']:.1f} / {a['majflt']:.1f}")
    row("ctx switches invol. / vol.", lambda a: f"{a['nivcsw']:.1f} / {a['nvcsw']:.1f}")
    row("steps with GC / faults / invol.", lambda a: f"{a['with_gc']:.0%} / {a['with_faults']:.0%} / "
        f"{a['with_nivcsw']:.0%}")
    return lines

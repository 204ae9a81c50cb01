"""The stress run's verdict: named checks with counts, the invariant violations seen while
the load ran (each with its step), and the faults injected, as one object.

Who calls: ``run_stress`` (``shmtier run``) fills it on its scheduler thread and prints each
check as it is decided (``[ok]``/``[FAIL]`` lines, for people); ``shmtier bench --stress``
writes ``as_dict()`` to ``stress.json``. Nothing here blocks or does I/O but ``print``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

#: Violations kept per check (all are counted).
KEEP_VIOLATIONS = 20


@dataclass
class Check:
    """One decided check: ``ok`` is its verdict, ``detail`` the line printed, ``counts``
    the figures it was decided on."""

    name: str
    ok: bool
    detail: str
    counts: dict = field(default_factory=dict)


@dataclass
class Violation:
    """An invariant broken while the load ran: at engine ``step`` (the run's step count),
    during ``request`` (its index in the trace), ``check`` names the invariant."""

    step: int
    request: int
    check: str
    what: str


@dataclass
class StressResult:
    """Everything ``run_stress`` decided. ``passed``: every check ok and no violation.
    ``faults``: per fault kind its counts, or ``{"skipped": why}`` when it could not be
    injected here (a skipped fault is listed, never silently dropped, and fails nothing)."""

    checks: list[Check] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    violation_counts: dict = field(default_factory=dict)
    faults: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str, **counts) -> bool:
        """Record and print one check; returns ``ok``."""
        self.checks.append(Check(name, bool(ok), detail, counts))
        print(f"  [{'ok' if ok else 'FAIL'}] {detail}")
        return bool(ok)

    def violate(self, step: int, request: int, check: str, what: str) -> None:
        """Record a violation of invariant ``check`` (the first KEEP_VIOLATIONS kept)."""
        n = self.violation_counts.get(check, 0)
        self.violation_counts[check] = n + 1
        if n < KEEP_VIOLATIONS:
            self.violations.append(Violation(step, request, check, what))

    def merge_violations(self, other: dict) -> None:
        """Add the violations of another process's result (``as_dict()`` form)."""
        for name, n in other.get("violation_counts", {}).items():
            self.violation_counts[name] = self.violation_counts.get(name, 0) + n
        self.violations += [Violation(**v) for v in other.get("violations", [])]

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.ok]

    @property
    def passed(self) -> bool:
        return bool(self.checks) and not self.failed and not self.violation_counts

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def as_dict(self) -> dict:
        return {"verdict": "PASS" if self.passed else "FAIL",
                "passed": sum(c.ok for c in self.checks), "failed": len(self.failed),
                "checks": [asdict(c) for c in self.checks],
                "violation_counts": dict(self.violation_counts),
                "violations": [asdict(v) for v in self.violations],
                "faults": self.faults, "figures": self.figures}

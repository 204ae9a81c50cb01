"""The node tier's part of the ``shmtier`` command: ``shmtier fsck --node-pool NAME`` and
``shmtier clean`` (:class:`NodeFsck`), and its part of ``shmtier top`` and ``shmtier ls``
(:class:`NodeStatus`), both named in the tier registry; and what an engine's segment
guardian does for the pools of an engine that died (``NodeFsck.engine_died``).

Runs in: the ``shmtier`` CLI's process (and the guardian's, for ``engine_died``). Importing it is cheap; the pool's modules are
imported inside the methods. ``fsck`` and ``clean`` take the pool's lock (``NodePool.check``,
``sweep``, ``tools.clean_pools``: bounded waits); the status reads the pool without its lock
(``tools.list_pools``: ``pread`` of the header and engine table; ``NodePool.stats``: a
read-only look at a mapping), so ``top`` never slows an engine.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field

from shmtier.tiers.commands import TierFsck, TierStatus

#: How long ``top`` waits for a pool another process is still creating.
_OPEN_TIMEOUT_S = 0.5


@dataclass
class NodeFsckReport:
    """One ``shmtier fsck --node-pool`` run: the invariants that did not hold
    (``problems``, ``NodePool.check``'s lines), what dead processes had left (``dead``:
    their engine entries by id, read before any sweep) and, with ``--repair``, what the
    sweep dropped (``swept``)."""

    pool: str
    target: str
    repair: bool
    rows: int = 0
    used: int = 0
    engines: list = field(default_factory=list)
    dead: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    swept: dict | None = None

    @property
    def exit_code(self) -> int:
        """0 when nothing is wrong now (leftovers of dead processes swept), else 1."""
        from shmtier.storage.fsck import EXIT_CLEAN, EXIT_PROBLEMS

        left = self.problems or (self.dead and self.swept is None)
        return EXIT_PROBLEMS if left else EXIT_CLEAN

    def as_dict(self) -> dict:
        return {"tier": "node", **asdict(self), "exit_code": self.exit_code}

    def text(self) -> str:
        lines = [f"node pool {self.pool} ({self.target}): {self.used}/{self.rows} rows used, "
                 f"engines {', '.join(self.engines) or 'none'}"]
        lines += [f"  dead engine {engine}" for engine in self.dead]
        lines += [f"  inconsistent  {p}" for p in self.problems]
        if self.swept is not None:
            lines.append(f"swept: {self.swept['pins']} pins, {self.swept['writes']} half-written "
                         f"rows, {self.swept['engines']} engine entries of dead processes")
        lines.append("consistent" if not self.problems else
                     f"{len(self.problems)} invariant(s) do not hold (the next engine that "
                     f"finds the pool's lock left mid-mutation repairs it; else remove the pool "
                     f"once no engine uses it: shmtier clean)")
        return "\n".join(lines)


class NodeFsck(TierFsck):
    target = "a node pool"
    usage = "--node-pool NAME"
    clean_what = "node pools no live engine uses (not those kept, unless --node-pools-kept)"

    def add_arguments(self, parser) -> None:
        parser.add_argument("--node-pool", metavar="NAME", default=None,
                            help="a node pool's name (shmtier ls lists them): check its "
                            "invariants (taking its lock); --repair also drops what dead "
                            "processes left (pins, half-written rows, engine entries)")

    def chosen(self, args) -> bool:
        return bool(args.node_pool)

    def run(self, args, mac_key: bytes | None) -> NodeFsckReport:
        from shmtier.tiers.node.layout import shm_name
        from shmtier.tiers.node.pool import NodePool, NodePoolError

        try:
            pool = NodePool.open(args.node_pool)
        except NodePoolError as e:
            raise ValueError(str(e)) from e
        try:
            stats = pool.stats()
            report = NodeFsckReport(
                args.node_pool, f"/dev/shm{shm_name(args.node_pool)}", bool(args.repair),
                stats["rows"], stats["used"], [e["engine_id"] for e in stats["engines"]],
                [e["engine_id"] for e in stats["engines"] if not e["alive"]])
            if args.repair:
                report.swept = pool.sweep()
            report.problems = pool.check()
            return report
        except NodePoolError as e:
            raise ValueError(str(e)) from e
        finally:
            pool.close()

    def engine_died(self, tiers: list) -> list[str]:
        """Sweep the pools the dead engine's node tiers used (its entry, its workers'
        pins and half-written rows go) and remove those no live engine uses, unless kept."""
        from shmtier.tiers.node.tools import clean_pools

        pools = {t.where["pool"] for t in tiers
                 if t.type == self.tier_type and t.where.get("pool")}
        if not pools:
            return []
        try:
            removed = clean_pools(pools)
        except OSError as e:
            return [f"node pools {sorted(pools)}: not swept ({e}); `shmtier clean` does it"]
        return [f"node pool {pool}: its last engine died; removed" for pool in removed]

    def add_clean_arguments(self, parser) -> None:
        parser.add_argument("--node-pool", action="append", default=[], metavar="NAME",
                            help="only these node pools (repeatable; default: every pool no "
                            "live engine uses, or with ENGINE_IDs those they used)")
        parser.add_argument("--node-pools-kept", action="store_true",
                            help="also remove node pools their last engine asked to keep")

    def clean(self, args) -> tuple[list[str], int]:
        """Remove the node pools no live engine uses (after sweeping what dead ones left):
        those named with ``--node-pool``, else those the named engines used (their entries,
        or the default pool of their ids), else all."""
        from shmtier.tiers.node.config import default_pool_name
        from shmtier.tiers.node.tools import clean_pools, list_pools

        names: set[str] | None = set(args.node_pool) or None
        engine_ids = getattr(args, "engine_ids", None)
        if names is None and engine_ids:
            names = {default_pool_name(e) for e in engine_ids}
            names |= {p.pool for p in list_pools()
                      if any(engine in engine_ids for engine, _, _ in p.engines)}
        try:
            removed = clean_pools(names, include_kept=args.node_pools_kept)
        except OSError as e:
            print(f"shmtier clean: node pools: {e}", file=sys.stderr)
            return [], 2
        return [f"removed node pool {pool}" for pool in removed], 0


def pool_status(pool: str) -> dict | None:
    """What ``top`` and ``ls`` show of pool ``pool``: its figures and, per engine, its
    entry, counters and hit rate (``NodePool.stats``); None when there is no such pool
    (or it is not ready yet)."""
    from shmtier.tiers.node.pool import NodePool, NodePoolError

    try:
        with NodePool.open(pool, timeout_s=_OPEN_TIMEOUT_S) as p:
            stats = p.stats()
    except (NodePoolError, ValueError, OSError):
        return None
    for e in stats["engines"]:
        e["hit_rate"] = round(e["hits"] / e["lookups"], 4) if e["lookups"] else None
    return stats


class NodeStatus(TierStatus):
    """``shmtier top``'s node part: the pools engine ``engine_id``'s node tiers use (from
    the pool config in its segment), each with every engine that shares it and their hit
    rates, under ``"node"`` in ``--json``; and ``shmtier ls``'s list of the pools."""

    def sessions(self, engine_id: str) -> list[dict]:
        from shmtier.shared.snapshot import snapshot

        try:
            tiers = snapshot(engine_id, rows=False).tiers
        except (FileNotFoundError, ValueError, OSError):
            return []
        pools = dict.fromkeys(t.where["pool"] for t in tiers
                              if t.type == self.tier_type and t.where.get("pool"))
        return [s for s in (pool_status(p) for p in pools) if s is not None]

    def host(self) -> list[dict]:
        from shmtier.tiers.node.tools import list_pools

        out = []
        for status in list_pools():
            stats = pool_status(status.pool) if status.valid else None
            out.append(stats if stats is not None else
                       {"pool": status.pool, "valid": status.valid, "engines": []})
        return out

    def lines(self, session: dict) -> list[str]:
        """A pool in words: its rows, then one line per engine that uses it."""
        from shmtier.shared.segment import human_bytes

        s = session
        if "rows" not in s:
            return [f"node   pool {s['pool']}  (not a complete pool: `shmtier clean` "
                    f"removes it once no process creates it)"]
        lines = [f"node   pool {s['pool']}  rows {s['used']}/{s['rows']} x "
                 f"{human_bytes(s['row_bytes'])}  pinned {s['pinned']}  evictions "
                 f"{s['evictions']}  corrupt {s['corrupt']}  repairs {s['repairs']}"]
        for e in s["engines"]:
            rate = "-" if e["hit_rate"] is None else f"{100 * e['hit_rate']:.1f}%"
            lines.append(f"  {e['engine_id']}  pid {e['pid']} {'alive' if e['alive'] else 'DEAD'}"
                         f"  lookups {e['lookups']} hits {e['hits']} ({rate})  stores "
                         f"{e['stores']} (found {e['exists']}, rejected {e['rejected']})  loads "
                         f"{e['loads']} (missed {e['misses']}, corrupt {e['corrupt']})  in "
                         f"{human_bytes(e['bytes_in'])} out {human_bytes(e['bytes_out'])}")
        return lines

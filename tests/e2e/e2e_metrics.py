"""Reading a server's ``/metrics`` and asserting shmtier's tier work from it (e2e suite).

``Metrics.scrape(server)`` parses the Prometheus text once; ``m.value(name, **labels)``
sums the samples of ``name`` (its exact sample name, e.g. ``..._total``) whose labels
include ``labels``. ``after - before`` gives a :class:`Delta` of every sample;
``m.of_engine(rank)`` keeps one data-parallel replica's samples.

:func:`assert_tier_served` is the suite's one assertion that a tier served a prefix: in
a window (two scrapes), the tier's promoted bytes (``vllm:kv_offload_tiering_read_bytes``,
``tier="i:type"``; the CPU tier: the connector's loads into the device,
``vllm:kv_offload_load_bytes``), its chunk hits, and the tokens vLLM took from the
connector (``vllm:external_prefix_cache_hits``) all grew. It raises AssertionError
naming every figure otherwise, so a broken tier (nothing read, every load refused)
fails the scenario that uses it; ``tests/e2e/test_assertions.py`` checks that it does.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metrics:
    samples: dict[tuple[str, frozenset], float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "Metrics":
        from prometheus_client.parser import text_string_to_metric_families
        out: dict[tuple[str, frozenset], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, frozenset(s.labels.items()))] = float(s.value)
        return cls(out)

    @classmethod
    def scrape(cls, server) -> "Metrics":
        return cls.parse(server.metrics_text())

    def value(self, name: str, **labels: str) -> float:
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)

    def names(self, prefix: str = "") -> list[str]:
        return sorted({n for n, _ in self.samples if n.startswith(prefix)})

    def of_engine(self, index: int) -> "Metrics":
        """The samples of one engine (vLLM's ``engine`` label: a data-parallel replica's
        rank), of the same class (a :class:`Delta` stays one)."""
        want = ("engine", str(index))
        return type(self)({k: v for k, v in self.samples.items() if want in k[1]})

    def tiers(self) -> list[str]:
        """Tier labels seen (``"0:primary"``, ``"1:fs"``...)."""
        return sorted({v for (_, ls) in self.samples for k, v in ls if k == "tier"})

    def __sub__(self, before: "Metrics") -> "Delta":
        return Delta({k: v - before.samples.get(k, 0.0) for k, v in self.samples.items()})


class Delta(Metrics):
    """The change of every sample between two scrapes."""


# Counters, by the name Prometheus gives their samples.
TIER_READ_BYTES = "vllm:kv_offload_tiering_read_bytes_total"
TIER_WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes_total"
TIER_HITS = "vllm:kv_offload_tiering_chunk_hits_total"
TIER_QUERIES = "vllm:kv_offload_tiering_chunk_queries_total"
LOAD_BYTES = "vllm:kv_offload_load_bytes_total"      # CPU tier -> device
STORE_BYTES = "vllm:kv_offload_store_bytes_total"    # device -> CPU tier
EXTERNAL_HIT_TOKENS = "vllm:external_prefix_cache_hits_total"
DEVICE_HIT_TOKENS = "vllm:prefix_cache_hits_total"
CHECKSUM_FAILURES = "vllm:kv_offload_shmtier_checksum_failures_total"
WORKER_RESTARTS = "vllm:kv_offload_shmtier_worker_restarts_total"
PROMOTION_FAILURES = "vllm:kv_offload_tiering_promotion_job_failures_total"

CPU_TIER = "0:primary"


def tier_figures(d: Metrics, tier: str) -> dict[str, float]:
    """What ``tier`` did in a window (a :class:`Delta`), or in total (a scrape)."""
    figures = {"hits": d.value(TIER_HITS, tier=tier),
               "queries": d.value(TIER_QUERIES, tier=tier),
               "external_hit_tokens": d.value(EXTERNAL_HIT_TOKENS),
               "device_loaded_bytes": d.value(LOAD_BYTES)}
    if tier != CPU_TIER:
        figures["read_bytes"] = d.value(TIER_READ_BYTES, tier=tier)
        figures["written_bytes"] = d.value(TIER_WRITE_BYTES, tier=tier)
    return figures


def assert_tier_served(d: Metrics, tier: str, what: str = "") -> dict[str, float]:
    """Assert that ``tier`` served prefixes in the window ``d`` (a :class:`Delta`): its
    chunk hits, the bytes it moved up (a secondary tier: promoted into the CPU tier; the
    CPU tier: loaded into the device) and vLLM's external prefix-cache hit tokens all
    grew. Returns the figures; AssertionError naming all of them otherwise."""
    f = tier_figures(d, tier)
    moved = f["read_bytes"] if tier != CPU_TIER else f["device_loaded_bytes"]
    ok = f["hits"] > 0 and moved > 0 and f["external_hit_tokens"] > 0 and \
        f["device_loaded_bytes"] > 0
    assert ok, (f"tier {tier} served nothing{' (' + what + ')' if what else ''}: "
                + ", ".join(f"{k} {v:g}" for k, v in f.items()))
    return f

"""``shmtier workers --metrics-port N``: a Prometheus endpoint for an external worker pool.

Runs in: the ``shmtier workers`` process (``external.py``), on prometheus_client's HTTP
server thread. Each scrape reads the engine's ring area (``ring_tools.inspect_area``: the
worker slots' heartbeat words, their counters and ring depths) and nothing else; the
workers themselves do no extra work for it: they add to their slot's counters as they
answer results (``WorkerRings.tally``, four 8-byte stores per result) whether or not
anyone scrapes.

Metrics (labels ``engine``, ``worker``; counters survive a worker's restart, since they
belong to the slot, and restart from zero with the engine):

=========================================  =======  ========================================
``shmtier_worker_jobs_total``              counter  job parts run and answered
``shmtier_worker_bytes_total``             counter  logical chunk bytes stored and loaded
``shmtier_worker_codec_seconds_total``     counter  time in the codec (encode, decode)
``shmtier_worker_errors_total``            counter  keys answered ERROR, CORRUPT or INVALID
``shmtier_worker_restarts_total``          counter  processes that claimed the slot, less one
``shmtier_worker_job_ring_depth``          gauge    jobs waiting in the slot's job ring
``shmtier_worker_result_ring_depth``       gauge    results the scheduler has not taken yet
``shmtier_worker_heartbeat_age_seconds``   gauge    since the worker's last heartbeat
``shmtier_worker_up``                      gauge    1 while a live process holds the slot
=========================================  =======  ========================================
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shmtier.shared.ring_tools import inspect_area

_LABELS = ["engine", "worker"]


class PoolCollector:
    """Collects the worker slots of one engine's ring area (``rings``, a view of the
    segment's ring area that outlives the collector's registration)."""

    def __init__(self, engine_id: str, rings):
        self.engine_id = engine_id
        self.rings = rings

    def collect(self):
        area = inspect_area(self.rings)
        fams = {
            "jobs": CounterMetricFamily("shmtier_worker_jobs", "Job parts a tier worker ran "
                                        "and answered", labels=_LABELS),
            "bytes": CounterMetricFamily("shmtier_worker_bytes", "Logical chunk bytes a tier "
                                         "worker stored and loaded", labels=_LABELS),
            "codec": CounterMetricFamily("shmtier_worker_codec_seconds", "Seconds a tier "
                                         "worker spent in the codec", labels=_LABELS),
            "errors": CounterMetricFamily("shmtier_worker_errors", "Keys a tier worker "
                                          "answered ERROR, CORRUPT or INVALID",
                                          labels=_LABELS),
            "restarts": CounterMetricFamily("shmtier_worker_restarts", "Processes that "
                                            "claimed the worker slot, less the first",
                                            labels=_LABELS),
            "jobq": GaugeMetricFamily("shmtier_worker_job_ring_depth", "Jobs waiting in the "
                                      "worker's job ring", labels=_LABELS),
            "resq": GaugeMetricFamily("shmtier_worker_result_ring_depth", "Results waiting "
                                      "in the worker's result ring", labels=_LABELS),
            "beat": GaugeMetricFamily("shmtier_worker_heartbeat_age_seconds", "Seconds since "
                                      "the worker's last heartbeat", labels=_LABELS),
            "up": GaugeMetricFamily("shmtier_worker_up", "1 while a live process holds the "
                                    "worker slot", labels=_LABELS),
        }
        if area is not None:
            now = time.monotonic_ns()
            for w in area.workers:
                labels = [self.engine_id, str(w.index)]
                c, hb = w.counters, w.heartbeat
                fams["jobs"].add_metric(labels, c.jobs)
                fams["bytes"].add_metric(labels, c.bytes)
                fams["codec"].add_metric(labels, c.codec_ns / 1e9)
                fams["errors"].add_metric(labels, c.failed_keys)
                fams["restarts"].add_metric(labels, max(0, hb.claims - 1))
                fams["jobq"].add_metric(labels, w.job_depth)
                fams["resq"].add_metric(labels, w.result_depth)
                if hb.beat_ns:
                    fams["beat"].add_metric(labels, hb.age_s(now))
                fams["up"].add_metric(labels, 1.0 if w.holder_alive else 0.0)
        yield from fams.values()


def serve(engine_id: str, rings, port: int, addr: str = "127.0.0.1"):
    """Start the endpoint (a daemon thread) on ``addr:port`` (0: any free port); returns
    ``(server, port)``. Stop it with ``server.shutdown(); server.server_close()`` before
    the ring area's view is released."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(PoolCollector(engine_id, rings))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server, server.server_port

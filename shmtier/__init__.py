"""shmtier: multi-tier KV-cache offloading for vLLM around one shared-memory segment.

Where code runs (docs/design.md §1-2):

- ``shmtier.shared``    every process: the segment and its chunk table (no torch)
- ``shmtier.scheduler`` the scheduler process: primary-tier manager and policies
- ``shmtier.gpu``       GPU worker processes: block copies between KV caches and arena
- ``shmtier.workers``   tier worker processes (pipeline)
- ``shmtier.contract``, ``shmtier.metrics``, ``shmtier.config``: plain types and parsing
"""

__version__ = "0.1.0"

"""Code the storage tiers (``fs``, ``obj``) share; not a tier type of its own (the tier
types live in ``shmtier/tiers/``, one folder each).

Which process runs each module: the storage tiers' scheduler half in the scheduler
process: ``scheduler.py`` (the tier's face to the tiering manager), ``ledger.py`` (each
key's state and bytes against ``max_bytes``: pure), ``dispatch.py`` and ``results.py``
(queued work to pool jobs, and their answers back into the ledger), ``transfers.py`` (a
tier job until its keys are final), ``lookup_probes.py`` (keys the index does not know),
``tier_metrics.py`` (its series); ``config.py`` (their options) and ``chunk_names.py``
(namespace and chunk names) in every process; ``fsck.py`` (what ``shmtier fsck`` shares
between them) in the ``shmtier`` command's process.
"""

"""Code the storage tiers (``fs``, ``obj``) share; not a tier type of its own (the tier
types live in ``shmtier/tiers/``, one folder each).

Which process runs each module: ``scheduler.py`` and ``lookup_probes.py`` (the storage
tiers' scheduler half) in the scheduler process; ``config.py`` (their options) and
``chunk_names.py`` (namespace and chunk names) in every process; ``fsck.py`` (what
``shmtier fsck`` shares between them) in the ``shmtier`` command's process.
"""

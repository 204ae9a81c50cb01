"""Secondary tiers, one folder per built-in tier type.

A tier type is three pieces, each in its tier's folder and named for the process
that runs it (``shmtier/tiers/registry.py`` lists them):

- ``config.py``: its frozen, validated config (any process: built with the spec);
- ``scheduler.py``: its scheduler half, a ``SecondaryTierManager`` (scheduler process);
- ``backend.py``: its worker half, a :class:`shmtier.tiers.backend.TierBackend`
  (tier worker processes), absent for a tier that does its I/O in the scheduler.

and, if it adds to the ``shmtier`` command, its tools (the ``shmtier`` CLI's process,
:mod:`shmtier.tiers.commands`): a ``TierFsck`` (``fsck`` and ``clean``) and a
``TierStatus`` (``top``). Its registry line names them all, and its backpressure profile.

Importing this package imports nothing else.
"""

"""The ``node`` tier: one pool of KV chunks in shared memory per layout and host, which
every engine (and every data-parallel replica) on the host maps (issue 31;
docs/node-pool.md).

By the process that runs it:

- every process that maps the pool: ``pool.py`` (``NodePool``: attach, lock-free lookups,
  batched stores and loads, detach) and its parts, one job each: ``opening.py`` (create or
  join the segment; the errors), ``layout.py`` (the bytes: header, tables, records,
  views), ``index.py`` (the hash index), ``lru.py`` (the LRU and free lists), ``tables.py``
  (the pin and engine tables), ``mutations.py`` (reserve, evict, publish, unpin, drop,
  free: each under the lock), ``repair.py`` (repair after a lock holder died, sweeps of
  dead processes' leftovers, the invariant check);
- the ``shmtier`` CLI and tests: ``tools.py`` (list and clean pools from outside).

Importing this package imports nothing.
"""

"""Build hook for the C extensions (shmtier.shared._planes: the codec's byte planes and
CRC-32C; shmtier.shared._wire: the ring data path and the job encoder; shmtier.scheduler.policies._lru:
the LRU policy's ranks and heap; shmtier.scheduler._rows: the CPU tier's per-key row
bookkeeping; shmtier.tiers.node._index: the node pool's lock-free lookup); all metadata is in
setup.cfg. posix_ipc already needs a C compiler at install time, so this adds no new
requirement."""

from setuptools import Extension, setup

_FLAGS = ["-O3", "-std=c11", "-Wall", "-Werror=implicit-function-declaration"]

setup(ext_modules=[
    Extension("shmtier.shared._planes", ["shmtier/shared/_planes.c"], extra_compile_args=_FLAGS),
    Extension("shmtier.shared._wire", ["shmtier/shared/_wire.c"], extra_compile_args=_FLAGS),
    Extension("shmtier.scheduler.policies._lru", ["shmtier/scheduler/policies/_lru.c"],
              extra_compile_args=_FLAGS),
    Extension("shmtier.scheduler._rows", ["shmtier/scheduler/_rows.c"], extra_compile_args=_FLAGS),
    Extension("shmtier.tiers.node._index", ["shmtier/tiers/node/_index.c"],
              extra_compile_args=_FLAGS),
])

"""Build hook for the one C extension (shmtier.shared._planes); all metadata is in
setup.cfg. posix_ipc already needs a C compiler at install time, so this adds no new
requirement."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "shmtier.shared._planes", ["shmtier/shared/_planes.c"],
    extra_compile_args=["-O3", "-std=c11", "-Wall", "-Werror=implicit-function-declaration"],
)])

"""The benchmark scripts, run from a checkout's root as modules of this package:
``.venv/bin/python -m bench.<name> [--help]`` (bench/README.md has each one's method and
figures). What they share is ``shmtier.bench`` (``shmtier.bench.common``: timing,
spreads, JSON output), the code behind ``shmtier bench``. Importing this package imports
nothing."""

"""What the benchmarks share. The code lives in ``shmtier.bench.common`` (one source of
truth for these scripts and ``shmtier bench``); this module re-exports it for the scripts
in bench/ (run as ``python bench/<name>.py``, which puts bench/ on ``sys.path``)."""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from shmtier.bench.common import *  # noqa: E402,F401,F403
from shmtier.bench.common import __all__  # noqa: E402,F401

"""``python -m shmtier.tiers.p2p.endpoint``: the p2p endpoint process (``process.main``).

Runs in: the endpoint process, spawned by the tier's scheduler half
(``shmtier/tiers/p2p/supervisor.py``) with its settings as msgpack on stdin.
"""

import sys

from shmtier.tiers.p2p.endpoint.process import main

sys.exit(main())

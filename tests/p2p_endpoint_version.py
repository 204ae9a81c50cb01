"""``python -m p2p_endpoint_version``: the real p2p endpoint process, announcing the channel
version in ``$P2P_TEST_CHANNEL_VERSION`` instead of its own (as an endpoint of another
shmtier version would). Spawned by tests/test_p2p_channel.py through the supervisor's
``ENDPOINT_MODULE`` (with tests/ on ``PYTHONPATH``)."""

import os
import sys

from shmtier.tiers.p2p import channel

channel.VERSION = int(os.environ["P2P_TEST_CHANNEL_VERSION"])

from shmtier.tiers.p2p.endpoint.process import main  # noqa: E402

sys.exit(main())

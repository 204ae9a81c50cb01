"""Test helper (run as a script by tests/test_secrets.py): one engine's scheduler, with
every secret option set, run in this process so that the test can read everything it and
its children write.

``python tests/secrets_engine.py CONFIG_JSON``. CONFIG: ``engine_id``; ``obj`` (an obj
tier dict: ``store_config`` with access key, secret key and session token, ``mac_key``);
``p2p`` (a p2p tier dict with ``secret_key``); ``refused`` (a tier dict the spec must
refuse, e.g. an ``endpoint_override`` with a password in it); ``root_debug`` (true:
configure the root logger at DEBUG, as an application that wants every log line does;
botocore's wire log then runs in this process too, during the spec's bucket check).

What it does, logging each step at INFO under ``shmtier.test``: logs the refused config's
ConfigError (as an application would); builds the engine (scheduler manager, a real
segment, one fake GPU rank; tier workers spawned: their stderr reaches this process's
fd 2); stores 4 chunks (cascaded to the bucket: PUTs), stores 4 more so that the first
leave the CPU tier, looks the first up until HIT (HEADs, GETs: a promotion), loads them
and checks the bytes; prints ``shmtier ls --json`` and ``shmtier top --once --json``;
closes the engine. Exit code 0 when all of that worked.
"""

from __future__ import annotations

import json
import logging
import sys


def main(config: dict) -> int:
    if config.get("root_debug"):
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr,
                            format="%(levelname)s scheduler %(name)s: %(message)s")
    log = logging.getLogger("shmtier.test")
    log.setLevel(logging.INFO)
    import torch

    import fs_engine
    from shmtier.cli import main as cli
    from shmtier.config import ConfigError
    from shmtier.contract import ReqContext
    from shmtier.spec import TieringOffloadingSpec

    try:
        TieringOffloadingSpec({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [config["refused"]]},
                              _layout(), "refused")
        log.error("the refused config was accepted")
        return 1
    except ConfigError as e:
        log.warning("config refused: %s", e)

    tiers = [config["obj"], config["p2p"]]
    engine = fs_engine.Engine(config["engine_id"], None, tier_type="example", chunks=4,
                              top={"secondary_tiers": tiers})
    try:
        first = [fs_engine.key(i) for i in range(4)]
        engine.offload(first, 0, ReqContext("a"))
        engine.settle()
        engine.offload([fs_engine.key(100 + i) for i in range(4)], 4, ReqContext("b"))
        engine.settle()
        reader = ReqContext("r")
        engine.until_hit(first, reader)
        got = engine.load(first, reader, list(range(40, 44)))
        if not torch.equal(got, engine.originals[0][:4]):
            log.error("wrong bytes loaded")
            return 1
        log.info("promoted %d chunks from the bucket", len(first))
        sys.stdout.flush()
        cli(["ls", "--json"])
        cli(["top", config["engine_id"], "--once", "--json"])
        sys.stdout.flush()
    finally:
        engine.close()
    log.info("done")
    return 0


def _layout():
    from shmtier.config import KVLayout
    return KVLayout("m", "bfloat16", 16, 8192, 1)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))

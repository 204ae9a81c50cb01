"""The obj tier's part of the ``shmtier`` command: ``shmtier fsck --bucket ...`` (or
``--tier-config FILE``) (:class:`ObjFsck`, named in the tier registry).

Runs in: the ``shmtier`` CLI's process. Importing it is cheap (no boto3); ``run`` makes
the tier's own client from the arguments and walks the bucket with
``shmtier/tiers/obj/fsck.py`` (blocks on the network).
"""

from __future__ import annotations

import json

from shmtier.tiers.commands import TierFsck, read_mac_key


class ObjFsck(TierFsck):
    target = "an obj tier bucket"
    usage = "--bucket / --tier-config for an obj tier bucket"

    def add_arguments(self, parser) -> None:
        obj = parser.add_argument_group("obj tier bucket (instead of ROOT); credentials from "
                                        "--tier-config or boto3's chain (AWS_ACCESS_KEY_ID, ...)")
        obj.add_argument("--bucket")
        obj.add_argument("--endpoint", default="", help="endpoint URL (default: AWS)")
        obj.add_argument("--prefix", default="", help="the tier's key prefix")
        obj.add_argument("--region", default="")
        obj.add_argument("--tier-config", metavar="FILE",
                         help="a JSON secondary_tiers entry of type obj (store_config, prefix, "
                         "mac_key_file)")

    def chosen(self, args) -> bool:
        return bool(args.bucket or args.tier_config)

    def run(self, args, mac_key: bytes | None):
        from shmtier.tiers.obj.client import make_client
        from shmtier.tiers.obj.config import ObjTierConfig, StoreConfigCheck, _prefix
        from shmtier.tiers.obj.fsck import fsck_bucket

        store: dict = {}
        prefix = args.prefix
        if args.tier_config:
            with open(args.tier_config) as f:
                entry = json.load(f)
            if not isinstance(entry, dict) or not isinstance(entry.get("store_config"), dict):
                raise ValueError(f"{args.tier_config}: expected a JSON object with store_config")
            store = dict(entry["store_config"])
            prefix = prefix or entry.get("prefix", "")
            if mac_key is None and entry.get("mac_key_file"):
                mac_key = read_mac_key(entry["mac_key_file"])
        for name, value in (("bucket", args.bucket), ("endpoint_override", args.endpoint),
                            ("region", args.region)):
            if value:
                store[name] = value
        checked = StoreConfigCheck()("store_config", store)
        client = make_client(ObjTierConfig(store_config=checked, max_attempts=3))
        try:
            return fsck_bucket(client, checked.bucket, _prefix(prefix), verify=args.verify,
                               repair=args.repair, mac_key=mac_key,
                               endpoint=checked.endpoint_label())
        finally:
            client.close()

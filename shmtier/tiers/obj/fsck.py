"""``shmtier fsck --bucket ...`` (or ``--tier-config``): check (and repair) an obj tier
bucket.

Runs in: the ``shmtier`` CLI's process. Blocks on the network: ListObjectsV2 pages of
each namespace, one ranged GET of each chunk's header (the whole object with
``verify``), one DeleteObject per object removed.

It walks the tier's own layout (``backend.py``: ``[<prefix>/]shmtier-<hex>/config.json``
and ``<key hex[0:3]>/<key hex>.kv``) with the tier's own names (``chunk_names``,
``backend.FANOUT_CHARS``, ``CONFIG_NAME``, ``FORMAT_NAME``) and judges frames with the
codec (``shmtier.storage.fsck.FrameCheck``, with the chunk size the namespace's
fingerprint names). Objects beside the namespaces are counted
and never read or touched. The tier writes every object whole with one PUT, so there
are no temp objects; an object deleted mid-walk is skipped.
"""

from __future__ import annotations

from typing import Any

from shmtier.storage.chunk_names import chunk_key, is_namespace_name, mac_id_of, namespace_dir_name
from shmtier.storage.fsck import (
    FrameCheck,
    FsckError,
    FsckReport,
    NamespaceReport,
    layout_chunk_bytes,
)
from shmtier.tiers.obj.backend import (
    CONFIG_NAME,
    FANOUT_CHARS,
    FORMAT_NAME,
    FORMAT_VERSION,
    _parse_config,
    _status,
)
from shmtier.tiers.obj.client import error_detail


def fsck_bucket(client: Any, bucket: str, prefix: str = "", *, verify: bool = False,
                repair: bool = False, mac_key: bytes | None = None,
                endpoint: str = "") -> FsckReport:
    """Check every namespace of ``bucket`` under ``prefix`` through boto3 ``client``;
    with ``repair`` delete the objects found bad. Raises :class:`FsckError` when the
    bucket cannot be listed."""
    base = f"{prefix}/" if prefix else ""
    report = FsckReport("obj", f"s3://{bucket}/{base}" + (f" at {endpoint}" if endpoint else ""),
                        verify, repair)
    try:
        names = []
        for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=base, Delimiter="/"):
            for cp in page.get("CommonPrefixes", ()) or ():
                name = cp["Prefix"][len(base):].rstrip("/")
                if is_namespace_name(name):
                    names.append(name)
                else:
                    report.other_entries += 1
            report.other_entries += len(page.get("Contents", ()) or ())
    except Exception as e:
        raise FsckError(f"cannot list s3://{bucket}/{base}: {error_detail(e)}") from None
    for name in sorted(names):
        _Walk(client, bucket, base + name, name, report, verify, repair, mac_key).run()
    return report.done()


class _Walk:
    def __init__(self, client, bucket: str, ns_key: str, name: str, report: FsckReport,
                 verify: bool, repair: bool, mac_key: bytes | None):
        self.client, self.bucket, self.ns_key, self.name = client, bucket, ns_key, name
        self.report, self.verify, self.repair, self.mac_key = report, verify, repair, mac_key

    def run(self) -> None:
        fingerprint = self._config()
        if fingerprint is None:
            return
        ns = NamespaceReport(self.name, fingerprint, layout_chunk_bytes(fingerprint))
        mac_id = mac_id_of(fingerprint)
        self.check = FrameCheck(mac_id, self.mac_key, ns.chunk_bytes)
        ns.mac, ns.mac_checked = mac_id is not None, self.check.mac_checked
        self.report.namespaces.append(ns)
        start = self.ns_key + "/"
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=start):
                for obj in page.get("Contents", ()) or ():
                    rest = obj["Key"][len(start):]
                    if rest == CONFIG_NAME:
                        continue
                    size = int(obj.get("Size") or 0)
                    fan, _, name = rest.partition("/")
                    key = chunk_key(name)
                    if key is None:
                        self._bad(obj["Key"], "foreign", "", size)
                    elif fan != name[:FANOUT_CHARS]:
                        self._bad(obj["Key"], "misplaced", f"belongs under {name[:FANOUT_CHARS]}/",
                                  size)
                    elif self._chunk(obj["Key"], key, size):
                        ns.chunks += 1
                        ns.bytes += size
        except Exception as e:
            self.report.add("unreadable", start, f"listing failed: {error_detail(e)}",
                            removable=False)

    def _config(self) -> str | None:
        """The namespace's fingerprint from its config.json, or None (a problem noted)."""
        where = f"{self.ns_key}/{CONFIG_NAME}"
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=where)
            cfg = _parse_config(got["Body"].read())
        except Exception as e:
            detail = "no config.json" if _status(e) == 404 else error_detail(e)
            self.report.add("bad_namespace", self.ns_key, detail, removable=False)
            return None
        fingerprint = cfg.get("fingerprint") if isinstance(cfg, dict) else None
        if (not isinstance(cfg, dict) or cfg.get("format") != FORMAT_NAME
                or cfg.get("format_version") != FORMAT_VERSION):
            self.report.add("bad_namespace", self.ns_key,
                            f"{CONFIG_NAME} is not a {FORMAT_NAME} v{FORMAT_VERSION} config",
                            removable=False)
            return None
        if not isinstance(fingerprint, str) or namespace_dir_name(fingerprint) != self.name:
            self.report.add("bad_namespace", self.ns_key,
                            f"{CONFIG_NAME} names fingerprint {fingerprint!r}, not this "
                            f"namespace's", removable=False)
            return None
        return fingerprint

    def _chunk(self, obj: str, key: bytes, size: int) -> bool:
        """Whether object ``obj`` of ``key`` holds a good frame (a problem noted if not)."""
        head_len = min(size, FrameCheck.head_bytes(len(key)))
        try:
            if self.verify:
                got = self.client.get_object(Bucket=self.bucket, Key=obj)
            else:
                if head_len == 0:
                    self._bad(obj, "truncated", "length: an empty object", size)
                    return False
                got = self.client.get_object(Bucket=self.bucket, Key=obj,
                                             Range=f"bytes=0-{head_len - 1}")
            body = got["Body"].read()
        except Exception as e:
            if _status(e) == 404:
                return False  # deleted meanwhile (an engine's eviction)
            self.report.add("unreadable", obj, f"{error_detail(e)} (get)", size,
                            removable=False)
            return False
        if self.verify:
            size = len(body)
        judged = self.check.check_header(body[:head_len], key, size)
        if isinstance(judged, tuple):
            self._bad(obj, judged[0], judged[1], size)
            return False
        if self.verify:
            bad = self.check.check_frame(body, key, judged)
            if bad is not None:
                self._bad(obj, bad[0], bad[1], size)
                return False
        return True

    def _bad(self, obj: str, kind: str, detail: str, size: int) -> None:
        problem = self.report.add(kind, obj, detail, size)
        if not self.repair:
            return
        try:
            self.client.delete_object(Bucket=self.bucket, Key=obj)
        except Exception as e:
            problem.detail = (detail + "; " if detail else "") + f"not removed: {error_detail(e)}"
            return
        problem.repaired = True

"""``obj`` tier options (any process): what ``secondary_tiers[i]`` of type ``obj`` accepts.

vLLM 0.33's obj tier config is accepted unchanged (``store_config``, ``prefix``,
``io_threads``, ``enable_kv_events``, ``locality``), plus shmtier's own keys. Checked
when the spec is built: every value, then (``check_together``) a HeadBucket against the
configured endpoint (``client.check_bucket``), so wrong credentials, a missing bucket or
an unreachable endpoint fail there, in one ConfigError naming endpoint, bucket and
reason, before any tier worker starts.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from shmtier.options import Check, ConfigError, Secret, choice_upper, integer, invalid, number
from shmtier.shared.redact import install as redact_logs
from shmtier.shared.redact import redact_url
from shmtier.storage.config import StorageTierConfig
from shmtier.tiers.config import REQUIRED, TierContext, option

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: Longest prefix: object keys (prefix, namespace, fan-out, 200 hex digits) stay far
#: under S3's 1024 bytes.
MAX_PREFIX_CHARS = 512


@dataclass(frozen=True)
class S3StoreConfig:
    """``store_config`` checked: where the objects go and how to sign requests.

    ``endpoint_override`` is normalised to a URL with its scheme (``"http://host:port"``),
    or "" for AWS's default endpoint. ``secret_key`` and ``session_token`` are kept as
    :class:`~shmtier.options.Secret` (their ``repr`` shows only a length), so the config
    object can be logged; :meth:`as_plain` gives the workers plain strings. "" (or None)
    for a credential means not given: boto3's default credential chain applies."""

    bucket: str
    endpoint_override: str = ""
    access_key: str = ""
    secret_key: Secret | None = None
    session_token: Secret | None = None
    region: str = ""
    scheme: str | None = None  # as given (None: http for an endpoint without scheme)
    ca_bundle: str = ""

    def as_plain(self) -> dict[str, str]:
        """The store config as msgpack-able plain data (secrets as their strings; "" for
        what was not given): how it reaches the tier workers (``ObjTierConfig.to_dict``)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Secret):
                v = v.value.decode("utf-8")
            out[f.name] = "" if v is None else v
        return out

    @classmethod
    def from_plain(cls, plain: Mapping[str, str]) -> "S3StoreConfig":
        """The store config :meth:`as_plain` made ``plain`` from (not checked again)."""
        def secret(name: str) -> Secret | None:
            value = plain.get(name) or ""
            return Secret(value.encode("utf-8"), name) if value else None

        return cls(bucket=plain["bucket"], endpoint_override=plain.get("endpoint_override", ""),
                   access_key=plain.get("access_key", ""), secret_key=secret("secret_key"),
                   session_token=secret("session_token"), region=plain.get("region", ""),
                   scheme=plain.get("scheme") or None, ca_bundle=plain.get("ca_bundle", ""))

    def secret_text(self, name: str) -> str:
        """A credential (``secret_key``, ``session_token``) as its string; "" if not given."""
        secret = getattr(self, name)
        return secret.value.decode("utf-8") if secret is not None else ""

    def endpoint_label(self) -> str:
        """How errors and logs name the endpoint: its URL, or AWS's default endpoint."""
        if self.endpoint_override:
            return self.endpoint_override
        return f"the AWS default endpoint (region {self.region or 'us-east-1'})"


def _bucket(key: str, v: Any) -> str:
    if not isinstance(v, str):
        raise invalid(key, v, "a bucket name (a string)")
    problem = None
    if not 3 <= len(v) <= 63:
        problem = f"{len(v)} characters"
    elif not _BUCKET.match(v):
        problem = ("lower-case letters, digits, '.' and '-' only, starting and ending "
                   "with a letter or digit")
    elif ".." in v:
        problem = "two adjacent periods"
    else:
        try:
            ipaddress.IPv4Address(v)
            problem = "formatted as an IP address"
        except ValueError:
            pass
    if problem is not None:
        raise invalid(key, v, f"an S3 bucket name of 3..63 characters ({problem})")
    return v


def _scheme(key: str, v: Any) -> str | None:
    if v is None or v == "":
        return None
    if isinstance(v, str) and v.lower() in ("http", "https"):
        return v.lower()
    raise invalid(key, v, "'http' or 'https'")


def _endpoint(key: str, v: Any, scheme: str | None) -> str:
    """The endpoint normalised (module docstring of S3StoreConfig); errors show the value
    without its user part (``http://***@host``): it may hold a password."""
    accepted = ("an endpoint as host:port or http(s)://host:port (scheme from "
                "store_config.scheme when absent), or \"\" for AWS's default endpoint")
    if v is None:
        return ""
    if not isinstance(v, str):
        raise invalid(key, v, accepted)
    shown = redact_url(v)
    text = v.strip()
    if not text:
        return ""
    if "://" not in text:
        text = f"{scheme or 'http'}://{text}"
    try:
        parts = urlsplit(text)
        port = parts.port  # ValueError for a port out of range or not a number
    except ValueError as e:
        raise invalid(key, shown, f"{accepted} ({e})") from None
    problem = None
    if parts.scheme.lower() not in ("http", "https"):
        problem = f"scheme {parts.scheme!r}"
    elif not parts.hostname:
        problem = "no host"
    elif parts.username is not None or parts.password is not None:
        problem = "credentials in the URL: use store_config.access_key / secret_key"
    elif parts.path not in ("", "/") or parts.query or parts.fragment:
        problem = "a path, query or fragment"
    if problem is not None:
        raise invalid(key, shown, f"{accepted} ({problem})")
    host = parts.hostname
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{parts.scheme.lower()}://{host}" + (f":{port}" if port is not None else "")


def _plain_text(key: str, v: Any, what: str) -> str:
    if v is None:
        return ""
    if not isinstance(v, str):
        raise invalid(key, v, what)
    return v.strip()


def _secret_text(key: str, v: Any) -> Secret | None:
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise ConfigError(f"{key} = <secret, not shown> is invalid: expected a string "
                          f"(got {type(v).__name__}), or \"\" for boto3's credential chain")
    return Secret(v.encode("utf-8"), key.rsplit(".", 1)[-1])


def _ca_bundle(key: str, v: Any) -> str:
    accepted = "the path of an existing CA bundle file (PEM), or \"\""
    if v is None or v == "":
        return ""
    if not isinstance(v, (str, os.PathLike)):
        raise invalid(key, v, accepted)
    path = os.path.abspath(os.fspath(v))
    try:
        st = os.stat(path)
    except OSError as e:
        raise invalid(key, v, f"{accepted} ({path}: {e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise invalid(key, v, f"{accepted} ({path} is not a regular file)")
    if not os.access(path, os.R_OK):
        raise invalid(key, v, f"{accepted} ({path} is not readable)")
    return path


class StoreConfigCheck(Check):
    """``store_config``: a mapping of the keys of :class:`S3StoreConfig`. Errors name
    the inner key (``secondary_tiers[0].store_config.bucket``) and never show a secret."""

    KEYS = ("bucket", "endpoint_override", "access_key", "secret_key", "session_token",
            "region", "scheme", "ca_bundle")

    def __init__(self) -> None:
        super().__init__(f"a mapping with keys {list(self.KEYS)} (bucket required)",
                         lambda v: v, to_plain=S3StoreConfig.as_plain,
                         from_plain=S3StoreConfig.from_plain)

    def __call__(self, key: str, value: Any) -> S3StoreConfig:
        if not isinstance(value, Mapping):
            shown = type(value).__name__  # never the value: it may hold credentials
            raise ConfigError(f"{key} is invalid: expected {self.accepted}, got {shown}")
        for name in value:
            if name not in self.KEYS:
                close = difflib.get_close_matches(str(name), self.KEYS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"{key}.{name} is not an accepted key{hint}; accepted "
                                  f"keys: {list(self.KEYS)}")
        if "bucket" not in value:
            raise ConfigError(f"{key}.bucket is required (an S3 bucket name)")

        def sub(name: str) -> str:
            return f"{key}.{name}"

        scheme = _scheme(sub("scheme"), value.get("scheme"))
        store = S3StoreConfig(
            bucket=_bucket(sub("bucket"), value["bucket"]),
            endpoint_override=_endpoint(sub("endpoint_override"),
                                        value.get("endpoint_override"), scheme),
            access_key=_plain_text(sub("access_key"), value.get("access_key"),
                                   "an access key id (a string), or \"\""),
            secret_key=_secret_text(sub("secret_key"), value.get("secret_key")),
            session_token=_secret_text(sub("session_token"), value.get("session_token")),
            region=_plain_text(sub("region"), value.get("region"),
                               "a region name (a string), or \"\" for us-east-1"),
            scheme=scheme,
            ca_bundle=_ca_bundle(sub("ca_bundle"), value.get("ca_bundle")),
        )
        if bool(store.access_key) != (store.secret_key is not None):
            raise ConfigError(
                f"{key}: access_key and secret_key go together (give both, or neither for "
                f"boto3's credential chain)")
        if store.session_token is not None and not store.access_key:
            raise ConfigError(f"{key}.session_token needs access_key and secret_key")
        return store


def _prefix(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"got {type(v).__name__}")
    if any(ord(c) < 0x20 or c in "\\\x7f" for c in v):
        raise ValueError("control characters or a backslash")
    parts = [p for p in v.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ValueError("'.' or '..' as a path part")
    out = "/".join(parts)  # no leading or trailing '/', never '//'
    if len(out) > MAX_PREFIX_CHARS:
        raise ValueError(f"{len(out)} characters")
    return out


@dataclass(frozen=True, kw_only=True)
class ObjTierConfig(StorageTierConfig):
    """An ``obj`` tier: each chunk one object in shmtier's frame, at
    ``<prefix>/shmtier-<layout digest>/<fan-out>/<key hex>.kv`` in an S3 bucket (AWS S3,
    MinIO, Ceph RGW, SeaweedFS), with boto3 in the tier workers, with the options every
    storage tier takes (``StorageTierConfig``; ``locality`` defaults to "REMOTE" here,
    vLLM's obj default). Requests use botocore's "standard" retry mode: throttling, 5xx,
    timeouts and dropped connections are retried with exponential backoff."""

    frame_word = "object"

    store_config: S3StoreConfig = option(
        REQUIRED, StoreConfigCheck(),
        doc="vLLM's obj store_config: bucket (must exist), endpoint_override (host:port or "
            "http(s)://host:port; empty: AWS S3), access_key and secret_key (+ session_token; "
            "empty: boto3's credential chain), region (empty: us-east-1), scheme (for an "
            "endpoint without one), ca_bundle (a PEM file); checked with one HeadBucket when "
            "the spec is built")
    prefix: str = option(
        "", Check(f"a key prefix of at most {MAX_PREFIX_CHARS} characters (a string)", _prefix),
        doc="key prefix of every object (slashes at its ends dropped, repeated ones folded: "
            "no object key holds //)")
    io_threads: int = option(
        4, integer(1, 256),
        doc="requests (PUT, GET, HEAD) a tier worker keeps in flight, and its connection "
            "pool's size")
    locality: str = option(
        "REMOTE", choice_upper("LOCAL", "REMOTE"),
        doc="for vLLM's kv_load_tiers request filters and the backpressure defaults")
    connect_timeout_s: float = option(
        2.0, number(0, min_open=True), doc="connect timeout of each request")
    read_timeout_s: float = option(
        10.0, number(0, min_open=True),
        doc="read timeout of each request: bounds each wait for bytes, not a whole transfer")
    max_attempts: int = option(
        4, integer(1, 20),
        doc="attempts per request, the first included; then the key fails (a store: its "
            "cascade fails; a load: MISS)")

    def where_words(self) -> str:
        """The bucket and endpoint in log lines and errors."""
        endpoint = self.store_config.endpoint_override or "AWS S3's default endpoint"
        return f"bucket {self.store_config.bucket!r} at {endpoint}"

    def check_together(self, where: str, context: TierContext) -> None:
        """The MAC options and ``max_bytes`` (``StorageTierConfig``), then one HeadBucket
        (``client.check_bucket``: blocks for a few seconds at most)."""
        super().check_together(where, context)
        from shmtier.tiers.obj.client import check_bucket

        redact_logs()  # botocore's wire log shows credential headers (boto3's chain too)
        check_bucket(self, where)

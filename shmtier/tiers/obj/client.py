"""The ``obj`` tier's S3 client: built in one place from the tier's frozen config
(``ObjTierConfig``), for the start-up check (``check_bucket``) and for every tier
worker's backend.

Who calls: ``ObjTierConfig.check_together`` (any process that builds the spec) calls
:func:`check_bucket`; ``ObjBackend.open`` (tier worker processes) calls
:func:`make_client`. ``make_client`` does no I/O; ``check_bucket`` blocks on one
HeadBucket request (bounded by short timeouts). boto3 is imported here, lazily, and
nowhere else in shmtier: without it, a config naming an ``obj`` tier fails with a
ConfigError saying what to install.

Client settings: region ``us-east-1`` when none is given; path-style addressing for a
custom endpoint (SeaweedFS, MinIO, Ceph: no bucket DNS names); a connection pool of
``io_threads``; botocore's ``standard`` retry mode with ``max_attempts`` attempts in all
(the first one included), which retries throttling (503 SlowDown), 5xx answers, timeouts
and dropped connections with exponential backoff; request and response checksums only
where S3 requires them (every frame carries CRC-32Cs of its own, and many S3-compatible
servers refuse botocore's trailing-checksum uploads); ``ca_bundle`` as the TLS trust
store. Empty credentials are left out, so boto3's default chain (environment, profile,
instance role) applies.
"""

from __future__ import annotations

from typing import Any

from shmtier.options import ConfigError

#: The start-up check's limits: it runs while the engine starts, so it must not wait long.
CHECK_CONNECT_TIMEOUT_S = 2.0
CHECK_READ_TIMEOUT_S = 5.0
CHECK_MAX_ATTEMPTS = 2


def import_boto3():
    """boto3 and botocore's ``Config`` and ``exceptions``; ConfigError when missing."""
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError as e:
        raise ConfigError(
            f"the obj tier needs boto3, which cannot be imported ({e}): "
            f"pip install shmtier[s3] (or pip install boto3)") from None
    return boto3, botocore.config.Config, botocore.exceptions


def make_client(config, *, connect_timeout_s: float | None = None,
                read_timeout_s: float | None = None, max_attempts: int | None = None):
    """A boto3 S3 client for the tier's ``config`` (an ``ObjTierConfig``); the keyword
    arguments override its timeouts and attempts (the start-up check uses shorter ones).
    No I/O. Thread-safe to use from many threads (boto3 clients are); one per process.
    Raises ConfigError when boto3 is missing."""
    boto3, Config, _ = import_boto3()
    store = config.store_config
    endpoint = store.endpoint_override
    region = store.region or "us-east-1"
    client_config = Config(
        region_name=region,
        max_pool_connections=config.io_threads,
        connect_timeout=float(connect_timeout_s if connect_timeout_s is not None
                              else config.connect_timeout_s),
        read_timeout=float(read_timeout_s if read_timeout_s is not None
                           else config.read_timeout_s),
        retries={"total_max_attempts": max_attempts if max_attempts is not None
                 else config.max_attempts, "mode": "standard"},
        s3={"addressing_style": "path"} if endpoint else {},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    kwargs: dict[str, Any] = {"config": client_config, "region_name": region}
    if endpoint:
        kwargs["endpoint_url"] = endpoint
    elif store.scheme == "http":
        kwargs["use_ssl"] = False  # asked for explicitly: plain HTTP to AWS's endpoint
    if store.ca_bundle:
        kwargs["verify"] = store.ca_bundle
    for arg, value in (("aws_access_key_id", store.access_key),
                       ("aws_secret_access_key", store.secret_text("secret_key")),
                       ("aws_session_token", store.secret_text("session_token"))):
        if value:
            kwargs[arg] = value
    # A session of its own: boto3's default session is not thread-safe to create from.
    return boto3.session.Session().client("s3", **kwargs)


def _root_oserror(exc: BaseException) -> OSError | None:
    """The innermost OSError with an errno in ``exc``'s causes (botocore wraps urllib3
    wrapping the socket's error), or None."""
    seen = set()
    found = None
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            found = e
        stack += [e.__cause__, e.__context__]
        for v in getattr(e, "kwargs", {}).values():
            if isinstance(v, BaseException):
                stack.append(v)
        stack += [a for a in getattr(e, "args", ()) if isinstance(a, BaseException)]
    return found


def error_detail(exc: BaseException) -> str:
    """A short text for a failed request: ``"HTTP 503 SlowDown"``, ``"connection
    refused"``, ``"read timeout"``... (the per-key detail of an ERROR outcome)."""
    _, _, bx = import_boto3()
    if isinstance(exc, bx.ClientError):
        resp = getattr(exc, "response", {}) or {}
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = resp.get("Error", {}).get("Code", "")
        text = f"HTTP {status}" if status else "error"
        if code and code != str(status):
            text += f" {code}"
        return text
    if isinstance(exc, bx.ConnectTimeoutError):
        return "connect timeout"
    if isinstance(exc, bx.ReadTimeoutError):
        return "read timeout"
    if isinstance(exc, bx.NoCredentialsError):
        return "no credentials"
    if isinstance(exc, bx.SSLError):
        return f"TLS error: {exc}"
    if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectionClosedError,
                        bx.ConnectionError)):
        root = _root_oserror(exc)
        if root is not None and root.strerror:
            return f"{root.strerror.lower()} (errno {root.errno})"
        return "connection failed"
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _check_reason(exc: BaseException, bx) -> str:
    """Why the start-up HeadBucket failed, in words an operator can act on."""
    detail = error_detail(exc)
    if isinstance(exc, bx.ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status == 403:
            return (f"access denied ({detail}): wrong access_key / secret_key / "
                    f"session_token, or no permission on the bucket")
        if status == 404:
            return f"no such bucket ({detail}): create it first"
        if status in (301, 307):
            return f"the bucket is in another region ({detail}): set store_config.region"
        return detail
    if isinstance(exc, bx.NoCredentialsError):
        return ("no credentials: set store_config.access_key and secret_key, or "
                "configure boto3's credential chain (environment, profile, role)")
    if isinstance(exc, bx.ConnectTimeoutError):
        return f"connect timeout ({detail})"
    return detail


def check_bucket(config, where: str) -> None:
    """One HeadBucket with the configured client (short timeouts, at most
    ``CHECK_MAX_ATTEMPTS`` attempts): ConfigError naming the endpoint, the bucket and
    why when it fails (wrong credentials, no such bucket, endpoint unreachable, boto3
    missing). Called by ``ObjTierConfig.check_together`` when the spec is built; blocks
    for at most a few seconds."""
    store = config.store_config
    try:
        _, _, bx = import_boto3()
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    client = make_client(
        config,
        connect_timeout_s=min(CHECK_CONNECT_TIMEOUT_S, config.connect_timeout_s),
        read_timeout_s=min(CHECK_READ_TIMEOUT_S, config.read_timeout_s),
        max_attempts=min(CHECK_MAX_ATTEMPTS, config.max_attempts))
    try:
        client.head_bucket(Bucket=store.bucket)
    except Exception as e:  # any failure: the tier cannot be used
        raise ConfigError(
            f"{where}: cannot use bucket {store.bucket!r} at {store.endpoint_label()} : "
            f"{_check_reason(e, bx)}") from None
    finally:
        client.close()

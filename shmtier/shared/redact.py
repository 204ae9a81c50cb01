"""Secrets out of text: the one place errors and log lines lose what must not be shown.

Who calls: :class:`shmtier.options.ConfigError` (every config error's text goes through
:func:`redact`); config checks that show a URL (:func:`redact_url`); every process that
holds a secret: :class:`shmtier.options.Secret` registers its value
(:func:`register_secret`), which also :func:`install`\\ s the log hook (so a tier
worker registers its secrets as it reads its tiers' frozen configs); the p2p endpoint
registers those of its settings (:func:`register_secrets_in`). Pure text work, no I/O,
never blocks (registration takes a lock for a moment); thread-safe.

What :func:`redact` removes from a text:

- the user part of a URL with a scheme (``http://user:password@host`` →
  ``http://***@host``);
- every registered secret value (at least ``MIN_SECRET_CHARS`` characters: a shorter one
  would blank out ordinary words) → ``***``;
- the value of credential headers wherever a log shows them: ``Authorization``,
  ``Proxy-Authorization``, ``X-Amz-Security-Token`` (botocore's canonical request lines
  ``x-amz-security-token:...``, its header dicts ``'X-Amz-Security-Token': b'...'``, a
  presigned URL's ``X-Amz-Security-Token=...``) → ``***``.

:func:`install` makes every log record of the process pass through :func:`redact` (a
log record factory wrapping the one in place, so every handler, present or added later,
and every library's logger gets redacted records): a record whose message or exception
text holds a secret carries the redacted text instead.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

__all__ = ["MIN_SECRET_CHARS", "SECRET_OPTIONS", "install", "redact", "redact_url",
           "register_secret", "register_secrets_in"]

#: Shown in place of what is removed.
MASK = "***"
#: Registered secrets shorter than this are not redacted in free text (they would blank
#: out ordinary words); every secret shmtier takes is longer (S3 secret keys 40
#: characters, Curve keys 40, MAC keys 32 hex digits at least).
MIN_SECRET_CHARS = 8
#: Option names whose values are secrets wherever they appear in a mapping of options
#: (``store_config.secret_key``, ``store_config.session_token``, ``mac_key``, p2p's
#: ``secret_key``; the p2p endpoint's settings call its key ``secret``).
SECRET_OPTIONS = frozenset({"secret_key", "session_token", "mac_key", "secret"})
#: Environment variables boto3's credential chain reads secrets from.
_ENV_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")

_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://)[^/?#@\s'\"<>]+@")
_HEADERS = r"(?:x-amz-security-token|proxy-authorization|authorization)"
# 'X-Amz-Security-Token': b'...'  /  "Authorization": "..."
_QUOTED_HEADER = re.compile(
    rf"""(?i)(?P<name>(?P<q>['"]){_HEADERS}(?P=q)\s*:\s*b?)"""
    r"""(?P<vq>['"])(?:\\.|(?!(?P=vq)).)*(?P=vq)""")
# x-amz-security-token:...  /  Authorization: AWS4-HMAC-SHA256 ...  /  ...Token=...&
_PLAIN_HEADER = re.compile(rf"""(?i)(\b{_HEADERS}\s*[:=]\s*)(?!['"\s])[^&\r\n'"]*""")

_lock = threading.Lock()
_secrets: set[str] = set()
_secret_pattern: re.Pattern | None = None
_installed = False


def redact_url(url: str) -> str:
    """``url`` (a value given as a URL, with or without a scheme) without its user part:
    everything between the scheme (if any) and the last ``@`` becomes ``***`` (a
    password may hold any character, so nothing before that ``@`` is kept)."""
    if not isinstance(url, str) or "@" not in url:
        return url
    match = re.match(r"([A-Za-z][A-Za-z0-9+.\-]*://)?(.*)", url, re.S)
    scheme, rest = match.group(1) or "", match.group(2)
    return f"{scheme}{MASK}@{rest.rpartition('@')[2]}"


def redact(text: str) -> str:
    """``text`` without URL credentials, registered secrets and credential header values
    (the module docstring's list). Cheap when there is nothing to remove."""
    if not isinstance(text, str) or not text:
        return text
    pattern = _secret_pattern
    if pattern is not None:
        text = pattern.sub(MASK, text)
    if "://" in text and "@" in text:
        text = _USERINFO.sub(rf"\1{MASK}@", text)
    lowered = text.lower()
    if "authorization" in lowered or "security-token" in lowered:
        text = _QUOTED_HEADER.sub(lambda m: f"{m['name']}{m['vq']}{MASK}{m['vq']}", text)
        text = _PLAIN_HEADER.sub(rf"\1{MASK}", text)
    return text


def register_secret(value: str | bytes | None) -> None:
    """Redact ``value`` from every error and log line of this process from now on (as
    text; bytes also as lower- and upper-case hex). Installs the log hook. Values
    shorter than ``MIN_SECRET_CHARS`` are ignored."""
    global _secret_pattern
    if not value:
        return
    forms = set()
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        forms |= {raw.hex(), raw.hex().upper()}
        try:
            forms.add(raw.decode("ascii"))
        except UnicodeDecodeError:
            pass
    else:
        forms.add(str(value).strip())
    forms = {f for f in forms if len(f) >= MIN_SECRET_CHARS}
    if forms:
        with _lock:
            if not forms <= _secrets:
                _secrets.update(forms)
                _secret_pattern = re.compile("|".join(
                    re.escape(s) for s in sorted(_secrets, key=len, reverse=True)))
    install()


def register_secrets_in(options: Any) -> None:
    """Register the value of every ``SECRET_OPTIONS`` key found in ``options`` (nested
    mappings and lists walked): the p2p endpoint's settings."""
    if isinstance(options, Mapping):
        for key, value in options.items():
            if key in SECRET_OPTIONS and isinstance(value, (str, bytes)):
                register_secret(value)
            else:
                register_secrets_in(value)
    elif isinstance(options, (list, tuple)):
        for value in options:
            register_secrets_in(value)


def install() -> None:
    """Make every log record of this process carry redacted text (once per process; the
    record factory in place is kept and wrapped). Also registers the secrets of boto3's
    environment credentials (``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            _redact_record(record)
            return record

        logging.setLogRecordFactory(factory)
    for name in _ENV_SECRETS:
        register_secret(os.environ.get(name))


def _redact_record(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # a bad format: the handler reports it as it would have
        return
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, ()
    if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
        text = logging.Formatter().formatException(record.exc_info)
        clean = redact(text)
        if clean != text:
            record.exc_text = clean

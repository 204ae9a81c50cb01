"""Checked option values: the one place a config value becomes a valid value or a
:class:`ConfigError` naming the key, the value and what is accepted.

Who calls: the config classes (``shmtier.config``, each tier's ``config.py``), in
any process that builds a spec, before anything is created. Pure functions over
plain values; never block (a check that looks at the filesystem, such as
:func:`writable_dir`, makes a few system calls).

A :class:`Check` knows what it accepts (``accepted``, the text errors show) and
converts a value: ``check("secondary_tiers[0].fsync", "no")`` raises
``ConfigError("secondary_tiers[0].fsync = 'no' is invalid: expected true or false")``.
"""

from __future__ import annotations

import difflib
import errno
import hmac
import os
import stat
import tempfile
from collections.abc import Callable, Collection, Mapping
from typing import Any

from shmtier.shared.redact import redact, register_secret


class ConfigError(ValueError):
    """Invalid configuration: names the key, the value and what is accepted. Its text
    never holds a secret: a URL's user part, a registered secret value and credential
    headers are taken out (``shmtier.shared.redact.redact``), whoever built the text."""

    def __init__(self, *args: Any):
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


def invalid(key: str, value: Any, accepted: str) -> ConfigError:
    """The error for ``key`` holding ``value``, with what is ``accepted``."""
    return ConfigError(f"{key} = {value!r} is invalid: expected {accepted}")


class Check:
    """A value check: ``convert(value)`` returns the value to keep or raises
    ValueError; a ValueError with text explains more than ``accepted`` does."""

    def __init__(self, accepted: str, convert: Callable[[Any], Any]):
        self.accepted = accepted
        self._convert = convert

    def __call__(self, key: str, value: Any) -> Any:
        try:
            return self._convert(value)
        except (ValueError, TypeError) as e:
            detail = str(e)
            accepted = f"{self.accepted} ({detail})" if detail else self.accepted
            raise invalid(key, value, accepted) from None

    def or_none(self, what: str = "null") -> "Check":
        """The same check, also accepting None."""
        return Check(f"{self.accepted}, or {what}",
                     lambda v: None if v is None else self._convert(v))

    def or_text(self, word: str, what: str) -> "Check":
        """The same check, also accepting the string ``word`` (``what`` says what it
        means in the error text)."""
        return Check(f"{self.accepted}, or {word!r} ({what})",
                     lambda v: v if isinstance(v, str) and v == word else self._convert(v))


def _fail(detail: str = "") -> Any:
    raise ValueError(detail)


def integer(minimum: int | None = None, maximum: int | None = None) -> Check:
    """An int (a float with an integral value is taken as one; bool is not)."""
    if minimum is not None and maximum is not None:
        accepted = f"an integer in {minimum}..{maximum}"
    elif minimum is not None:
        accepted = f"an integer >= {minimum}"
    else:
        accepted = "an integer"

    def convert(v):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            _fail()
        if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
            _fail()
        return v
    return Check(accepted, convert)


def number(minimum: float | None = None, maximum: float | None = None, *,
           min_open: bool = False, accepted: str | None = None) -> Check:
    """An int or float (not bool) within bounds; ``min_open`` excludes ``minimum``."""
    if accepted is None:
        low = "" if minimum is None else f"{'>' if min_open else '>='} {minimum:g}"
        high = "" if maximum is None else f"<= {maximum:g}"
        accepted = "a number" + (" " + " and ".join(x for x in (low, high) if x) if low or high else "")

    def convert(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            _fail()
        if minimum is not None and (v < minimum or (min_open and v == minimum)):
            _fail()
        if maximum is not None and v > maximum:
            _fail()
        return v
    return Check(accepted, convert)


def boolean() -> Check:
    return Check("true or false", lambda v: v if isinstance(v, bool) else _fail())


def text() -> Check:
    return Check("a non-empty string", lambda v: v if isinstance(v, str) and v else _fail())


def one_of(*values: Any, accepted: str | None = None) -> Check:
    """One of ``values``, compared by value and type (True is not 1); ``accepted``: the
    error's words for them (default: "one of" the values)."""
    shown = ", ".join(_show(v) for v in values)

    def convert(v):
        for allowed in values:
            if type(v) is type(allowed) and v == allowed:
                return v
        _fail()
    return Check(accepted or f"one of {shown}", convert)


def choice_upper(*names: str) -> Check:
    """A string naming one of ``names``, any case; kept upper case."""
    def convert(v):
        if isinstance(v, str) and v.upper() in names:
            return v.upper()
        _fail()
    return Check(" or ".join(repr(n) for n in names), convert)


def writable_dir() -> Check:
    """An existing directory this process can create files in (tried: a temp file is
    created and removed, so permissions, read-only mounts and ACLs all count)."""
    def convert(v):
        if not isinstance(v, (str, os.PathLike)) or not os.fspath(v):
            _fail()
        path = os.path.abspath(os.fspath(v))
        try:
            st = os.stat(path)
        except FileNotFoundError:
            _fail(f"{path} does not exist; create it first")
        except OSError as e:
            _fail(f"{path} cannot be examined: {e.strerror}")
        if not stat.S_ISDIR(st.st_mode):
            _fail(f"{path} is not a directory")
        try:
            fd, probe = tempfile.mkstemp(prefix=".shmtier-probe.", dir=path)
        except OSError as e:
            name = errno.errorcode.get(e.errno or 0, "")
            _fail(f"{path} is not writable: {name} {e.strerror}".replace("  ", " "))
        os.close(fd)
        os.unlink(probe)
        return path
    return Check("an existing, writable directory", convert)


class Secret:
    """Key material from the config (e.g. the fs tier's MAC key): compares by value and
    never shows it -- ``repr`` and ``str`` name only its length and where it came from,
    so a config object can be logged. Made, it is registered with
    ``shmtier.shared.redact``: no error or log line of this process shows its value."""

    __slots__ = ("value", "source")

    def __init__(self, value: bytes, source: str):
        self.value = bytes(value)
        self.source = source
        register_secret(self.value)  # never in this process's errors and logs

    def __repr__(self) -> str:
        return f"<secret: {len(self.value)} bytes from {self.source}>"

    __str__ = __repr__

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(self.value, other.value)

    def __hash__(self) -> int:
        return hash((Secret, len(self.value)))


class SecretCheck(Check):
    """A check whose value must never appear in an error (a key given inline): the
    error names the key and what is accepted, and shows the value as ``<secret>``."""

    def __call__(self, key: str, value: Any) -> Any:
        try:
            return self._convert(value)
        except (ValueError, TypeError) as e:
            detail = f" ({e})" if str(e) else ""
            raise ConfigError(f"{key} = <secret, not shown> is invalid: expected "
                              f"{self.accepted}{detail}") from None

    def or_none(self, what: str = "null") -> "SecretCheck":
        return SecretCheck(f"{self.accepted}, or {what}",
                           lambda v: None if v is None else self._convert(v))


def _hex_bytes(text: str) -> bytes | None:
    """``text`` (whitespace around it ignored) as the bytes its hex digits spell, or None
    if it is not an even number of hex digits."""
    text = text.strip()
    if not text or len(text) % 2 or any(c not in "0123456789abcdefABCDEF" for c in text):
        return None
    return bytes.fromhex(text)


def secret_hex(min_bytes: int, max_bytes: int, source: str) -> SecretCheck:
    """A string of hex digits spelling ``min_bytes``..``max_bytes`` bytes, kept as a
    :class:`Secret` (from ``source``). Errors never show the value."""
    def convert(v):
        if not isinstance(v, str):
            _fail(f"got {type(v).__name__}")
        key = _hex_bytes(v)
        if key is None:
            _fail("not an even number of hex digits")
        if not min_bytes <= len(key) <= max_bytes:
            _fail(f"{len(key)} bytes")
        return Secret(key, source)
    return SecretCheck(f"a secret of {min_bytes}..{max_bytes} bytes as "
                       f"{2 * min_bytes}..{2 * max_bytes} hex digits", convert)


def secret_file(min_bytes: int, max_bytes: int) -> Check:
    """The path of a regular file, accessible to its owner only (no permission bit for
    group or others, as ssh requires of a private key), holding a secret of
    ``min_bytes``..``max_bytes`` bytes: as hex digits (whitespace around them ignored)
    or, if the file is not hex, its raw bytes. Read when the check runs; kept as a
    :class:`Secret`. Errors name the path and what is wrong, never the content."""
    def convert(v):
        if not isinstance(v, (str, os.PathLike)) or not os.fspath(v):
            _fail()
        path = os.path.abspath(os.fspath(v))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            _fail(f"{path} does not exist")
        except OSError as e:
            name = errno.errorcode.get(e.errno or 0, "")
            _fail(f"{path} cannot be read: {name} {e.strerror}".replace("  ", " "))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                _fail(f"{path} is not a regular file")
            mode = stat.S_IMODE(st.st_mode)
            if mode & 0o077:
                _fail(f"{path} is accessible by group or others (mode {mode:04o}); "
                      f"make it private: chmod 600 {path}")
            limit = 2 * max_bytes + 64  # hex digits and some whitespace
            if st.st_size > limit:
                _fail(f"{path} holds {st.st_size} bytes, more than a key")
            data = os.read(fd, limit + 1)
        except OSError as e:
            _fail(f"{path} cannot be read: {e.strerror}")
        finally:
            os.close(fd)
        key = _hex_bytes(data.decode("ascii", "replace"))
        if key is None:
            key = data
        if not min_bytes <= len(key) <= max_bytes:
            _fail(f"{path} holds {len(key)} bytes" if key is data else
                  f"{path} holds {len(key)} bytes as hex")
        return Secret(key, f"file {path}")
    return Check(f"a private file (mode 600 or 400) holding a secret of "
                 f"{min_bytes}..{max_bytes} bytes, raw or as {2 * min_bytes}..{2 * max_bytes} "
                 f"hex digits", convert)


def require_string_keys(given: Collection[Any], where: str,
                        known: Collection[str] | None = None) -> None:
    """ConfigError when a key of ``given`` (a mapping's keys) is not a string: option
    names are strings (a Python caller may pass ``{1: ...}``; JSON cannot)."""
    bad = [k for k in given if not isinstance(k, str)]
    if bad:
        shown = ", ".join(repr(k) for k in bad)
        accepted = f"; accepted keys: {sorted(known)}" if known is not None else ""
        raise ConfigError(f"{where} has a key that is not a string: {shown} (keys are "
                          f"option names){accepted}")


def reject_unknown(given: Collection[str], known: Collection[str], where: str) -> None:
    """ConfigError for keys of ``given`` not in ``known``, with did-you-mean hints (and
    for a key that is not a string)."""
    require_string_keys(given, where, known)
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, list(known), n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ConfigError(f"{where} has unknown key(s) {', '.join(hints)}; "
                      f"accepted keys: {sorted(known)}")


def require_mapping(value: Any, where: str, what: str = "a mapping") -> Mapping:
    if not isinstance(value, Mapping):
        raise invalid(where, value, what)
    return value


def _show(v: Any) -> str:
    """A value as JSON-ish config text: true, false, null, else repr."""
    if v is True or v is False or v is None:
        return {True: "true", False: "false", None: "null"}[v]
    return repr(v)

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
import os
import stat
import tempfile
from collections.abc import Callable, Collection, Mapping
from typing import Any


class ConfigError(ValueError):
    """Invalid configuration: names the key, the value and what is accepted."""


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


def one_of(*values: Any) -> Check:
    """One of ``values``, compared by value and type (True is not 1)."""
    shown = ", ".join(_show(v) for v in values)

    def convert(v):
        for allowed in values:
            if type(v) is type(allowed) and v == allowed:
                return v
        _fail()
    return Check(f"one of {shown}", convert)


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


def reject_unknown(given: Collection[str], known: Collection[str], where: str) -> None:
    """ConfigError for keys of ``given`` not in ``known``, with did-you-mean hints."""
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

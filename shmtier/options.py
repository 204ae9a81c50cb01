"""Checked option values: the one place a config value becomes a valid value or a
:class:`ConfigError` naming the key, the value and what is accepted.

Who calls: the config classes (``shmtier.config``, each tier's ``config.py``), in
any process that builds a spec, before anything is created. Pure functions over
plain values; never block (a check that looks at the filesystem, such as
:func:`writable_dir`, makes a few system calls).

A :class:`Check` knows what it accepts (``accepted``, the text errors show) and
converts a value: ``check("secondary_tiers[0].fsync", "no")`` raises
``ConfigError("secondary_tiers[0].fsync = 'no' is invalid: expected true or false")``.

Every config is a frozen dataclass subclass of :class:`Options` whose fields are declared
with :func:`option` -- its default (stated there once), its check and a one-line
description::

    @dataclass(frozen=True, kw_only=True)
    class FsTierConfig(StorageTierConfig):
        root_dir: str = option(REQUIRED, writable_dir(), doc="where the tier keeps its files")
        fsync: bool = option(False, boolean(), doc="fsync each file before publishing it")

The style gives every config the same three things: ``from_mapping`` (check a mapping:
unknown keys, required keys, each value), ``to_dict`` / ``from_dict`` (plain, msgpack-able
data and back, for a config that crosses a process boundary: the tier worker pool's
config in the segment) and ``reference_rows`` (what ``docs/configuration.md`` lists:
``python -m shmtier.options_doc`` writes it).
"""

from __future__ import annotations

import difflib
import errno
import hmac
import math
import os
import stat
import tempfile
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, TypeVar

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
    ValueError; a ValueError with text explains more than ``accepted`` does.

    ``accepted``: the text errors and the configuration reference show (a callable
    gives it when asked: what is accepted may grow, e.g. registered policy names).
    ``to_plain`` / ``from_plain``: how a kept value travels as msgpack-able data and
    back (default: as it is, lists read back as tuples); None always travels as None."""

    def __init__(self, accepted: str | Callable[[], str], convert: Callable[[Any], Any], *,
                 to_plain: Callable[[Any], Any] | None = None,
                 from_plain: Callable[[Any], Any] | None = None):
        self._accepted = accepted
        self._convert = convert
        self._to_plain = to_plain
        self._from_plain = from_plain

    @property
    def accepted(self) -> str:
        return self._accepted() if callable(self._accepted) else self._accepted

    def __call__(self, key: str, value: Any) -> Any:
        try:
            return self._convert(value)
        except (ValueError, TypeError) as e:
            detail = str(e)
            accepted = f"{self.accepted} ({detail})" if detail else self.accepted
            raise invalid(key, value, accepted) from None

    def to_plain(self, value: Any) -> Any:
        """``value`` (one this check returned) as msgpack-able data."""
        return value if value is None or self._to_plain is None else self._to_plain(value)

    def from_plain(self, plain: Any) -> Any:
        """The value ``to_plain`` made ``plain`` from (not checked again)."""
        if plain is None:
            return None
        return _tuples(plain) if self._from_plain is None else self._from_plain(plain)

    def _like(self, accepted: str | Callable[[], str], convert: Callable[[Any], Any]) -> "Check":
        return Check(accepted, convert, to_plain=self._to_plain, from_plain=self._from_plain)

    def or_none(self, what: str = "null") -> "Check":
        """The same check, also accepting None."""
        return self._like(lambda: f"{self.accepted}, or {what}",
                          lambda v: None if v is None else self._convert(v))

    def or_text(self, word: str, what: str) -> "Check":
        """The same check, also accepting the string ``word`` (``what`` says what it
        means in the error text)."""
        return self._like(lambda: f"{self.accepted}, or {word!r} ({what})",
                          lambda v: v if isinstance(v, str) and v == word else self._convert(v))

    def then(self, convert: Callable[[Any], Any]) -> "Check":
        """The same check, its value then passed through ``convert`` (e.g. ``float``)."""
        return self._like(self._accepted, lambda v: convert(self._convert(v)))


class KeyedCheck(Check):
    """A check whose ``convert(key, value)`` raises :class:`ConfigError` itself (its
    errors say more than one ``accepted`` text can, e.g. per inner key)."""

    def __call__(self, key: str, value: Any) -> Any:
        return self._convert(key, value)


def _tuples(plain: Any) -> Any:
    """msgpack reads a tuple back as a list: lists become tuples again (nested too)."""
    if isinstance(plain, list):
        return tuple(_tuples(v) for v in plain)
    return plain


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
           min_open: bool = False, max_open: bool = False, finite: bool = False,
           accepted: str | None = None) -> Check:
    """An int or float (not bool, not NaN) within bounds; ``min_open`` / ``max_open``
    exclude ``minimum`` / ``maximum``; ``finite`` refuses infinities."""
    if accepted is None:
        low = "" if minimum is None else f"{'>' if min_open else '>='} {minimum:g}"
        high = "" if maximum is None else f"{'<' if max_open else '<='} {maximum:g}"
        accepted = (f"a {'finite ' if finite else ''}number"
                    + (" " + " and ".join(x for x in (low, high) if x) if low or high else ""))

    def convert(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            _fail()
        if finite and v in (math.inf, -math.inf):
            _fail()
        if minimum is not None and (v < minimum or (min_open and v == minimum)):
            _fail()
        if maximum is not None and (v > maximum or (max_open and v == maximum)):
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
                           lambda v: None if v is None else self._convert(v),
                           to_plain=self._to_plain, from_plain=self._from_plain)


def secret_plain(source: str) -> dict[str, Callable[[Any], Any]]:
    """How a :class:`Secret` travels to the tier workers: its bytes (in the engine's 0600
    segment), made a Secret again there (registered: never in that process's logs)."""
    return {"to_plain": lambda s: s.value, "from_plain": lambda b: Secret(b, source)}


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
                       f"{2 * min_bytes}..{2 * max_bytes} hex digits", convert,
                       **secret_plain(source))


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
                 f"hex digits", convert, **secret_plain("a key file the scheduler read"))


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


# --------------------------------------------------------------------------- options

#: The default of an option that must be given.
REQUIRED: Any = MISSING

_ABSENT = object()
_O = TypeVar("_O", bound="Options")


def option(default: Any, check: Check, *, doc: str = "", default_doc: str | None = None) -> Any:
    """A config field: its ``default`` (or ``REQUIRED``), the ``check`` a given value
    passes, ``doc`` (what it does, one line, for the configuration reference) and
    ``default_doc`` (the default in words, where the value alone would mislead: one read
    from the environment, one that depends on the tier type)."""
    return field(default=default,
                 metadata={"check": check, "doc": doc, "default_doc": default_doc})


@dataclass(frozen=True)
class Options:
    """Base of a frozen config whose fields are declared with :func:`option`. Fields
    declared otherwise (plain dataclass fields) are derived values the config's own
    constructor sets; ``from_mapping`` takes them as keyword arguments, and neither
    ``to_dict`` nor the reference lists them."""

    @classmethod
    def declared(cls) -> tuple[Field, ...]:
        """The option fields, in declaration order."""
        return tuple(f for f in fields(cls) if "check" in f.metadata)

    @classmethod
    def keys(cls) -> frozenset[str]:
        return frozenset(f.name for f in cls.declared())

    @classmethod
    def _declaration(cls, name: str) -> Field:
        for f in cls.declared():
            if f.name == name:
                return f
        raise KeyError(f"{cls.__name__} declares no option {name!r}")

    @classmethod
    def default(cls, name: str) -> Any:
        """The declared default of option ``name`` (``REQUIRED`` if it has none)."""
        return cls._declaration(name).default

    @classmethod
    def check_value(cls, name: str, value: Any, key: str | None = None) -> Any:
        """``value`` checked by option ``name``'s check; errors call it ``key``."""
        return cls._declaration(name).metadata["check"](key or name, value)

    @classmethod
    def accepted_keys(cls) -> str:
        """What a mapping of these options accepts, in words (for error texts)."""
        parts = [f"{f.name!r} ({f.metadata['check'].accepted})" for f in cls.declared()]
        return "a mapping of " + ", ".join(parts)

    @classmethod
    def as_check(cls) -> "KeyedCheck":
        """The check of a config field holding one of these (given as a mapping, or as
        one already made); it travels as its ``to_dict``."""
        return KeyedCheck(cls.accepted_keys,
                          lambda key, v: v if isinstance(v, cls) else cls.from_mapping(
                              require_mapping(v, key), where=key),
                          to_plain=cls.to_dict, from_plain=cls.from_dict)

    @classmethod
    def from_mapping(cls: type[_O], given: Mapping[str, Any], *, where: str,
                     key: Callable[[str], str] | None = None, strict: bool = True,
                     null_is_absent: bool = False, **derived: Any) -> _O:
        """The config for ``given``: each option's value checked, the default where it
        is absent. ``where`` names the mapping in errors; ``key(name)`` names one of its
        keys (default ``where.name``). ``strict``: a key of ``given`` that is no option
        is an error (with a did-you-mean hint; off where the mapping holds other
        sections' keys too and the caller checks them all). ``null_is_absent``: None
        means "not given" (``kv_connector_extra_config``'s rule). ``derived``: values of
        the plain fields (and of options the caller parsed itself). Raises ConfigError."""
        if key is None:
            def key(name: str) -> str:
                return f"{where}.{name}"
        declared = cls.declared()
        if strict:
            reject_unknown(given, [f.name for f in declared], where)
        values = dict(derived)
        for f in declared:
            if f.name in derived:
                continue
            check = f.metadata["check"]
            value = given.get(f.name, _ABSENT)
            if value is _ABSENT or (null_is_absent and value is None):
                if f.default is MISSING:
                    raise ConfigError(f"{key(f.name)} is required ({check.accepted})")
                continue
            values[f.name] = check(key(f.name), value)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The options as msgpack-able plain data (each check's ``to_plain``)."""
        return {f.name: f.metadata["check"].to_plain(getattr(self, f.name))
                for f in self.declared()}

    @classmethod
    def from_dict(cls: type[_O], plain: Mapping[str, Any]) -> _O:
        """The config ``to_dict`` made ``plain`` from. Its values are not checked again:
        they were when the config was made (checks may read files or ask a server, which
        a tier worker must not). A key this class does not declare is a ValueError (data
        written by another version)."""
        declared = {f.name: f for f in cls.declared()}
        unknown = sorted(set(plain) - set(declared))
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown option(s) {unknown} in its plain form; "
                             f"declared: {sorted(declared)}")
        return cls(**{name: declared[name].metadata["check"].from_plain(value)
                      for name, value in plain.items()})

    @classmethod
    def reference_rows(cls) -> list[tuple[str, str, str, str]]:
        """One row per option for the configuration reference: key, default, what is
        accepted and what it does (Markdown-safe: ``|`` escaped, one line each); a class's
        own options first, then those it inherits."""
        own = [c.__dict__.get("__annotations__", {}) for c in cls.__mro__]
        depth = {f.name: next(i for i, names in enumerate(own) if f.name in names)
                 for f in cls.declared()}
        rows = []
        for f in sorted(cls.declared(), key=lambda f: depth[f.name]):
            if f.metadata["default_doc"] is not None:
                default = f.metadata["default_doc"]
            elif f.default is MISSING:
                default = "**required**"
            else:
                default = f"`{_json(f.default)}`"
            rows.append((f"`{f.name}`", default, f.metadata["check"].accepted,
                         f.metadata["doc"]))
        return [tuple(" ".join(cell.split()).replace("|", "\\|") for cell in row)
                for row in rows]


def _json(v: Any) -> str:
    """A default as the JSON a user writes (tuples as lists)."""
    try:
        return json.dumps(v)
    except TypeError:
        return repr(v)

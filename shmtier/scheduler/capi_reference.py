"""CPython's C-API argument conversions, spelled in Python, for the pure-Python references
of the scheduler's C helpers (``rows_reference.py``, ``policies/lru_reference.py``).

Who calls: those references only, in whatever process runs them (the scheduler's tests,
bench/c_vs_reference.py). Each function raises what the C-API call it is named after
raises for the same value, with the same message on CPython 3.10-3.13, so that a
reference refuses input exactly as the C type does; the differential tests
(tests/test_c_reference.py) hold both to that.
"""

from __future__ import annotations

import functools
import operator

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE


def tp_name(obj: object) -> str:
    """``Py_TYPE(obj)->tp_name``: a class defined in Python or a builtin by its name, any
    other static type as ``module.name``."""
    cls = type(obj)
    if cls.__flags__ & _HEAPTYPE or cls.__module__ == "builtins":
        return cls.__name__
    return f"{cls.__module__}.{cls.__name__}"


def as_ssize(value) -> int:
    """``PyLong_AsSsize_t``: ints only (bool included, no ``__index__``)."""
    if not isinstance(value, int):
        raise TypeError("an integer is required")
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise OverflowError("Python int too large to convert to C ssize_t")
    return int(value)


def as_long_long(value) -> int:
    """``PyLong_AsLongLong``: ints and objects with ``__index__``."""
    value = operator.index(value)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise OverflowError("int too big to convert")
    return value


def ssize_arg(value) -> int:
    """The ``n`` unit of ``PyArg_Parse*``: like ``as_ssize`` but through ``__index__``."""
    value = operator.index(value)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise OverflowError("Python int too large to convert to C ssize_t")
    return value


def dict_arg(value, position: int) -> dict:
    """The ``O!`` unit with ``&PyDict_Type`` (a dict or a subclass)."""
    if not isinstance(value, dict):
        raise TypeError(f"argument {position} must be dict, not {tp_name(value)}")
    return value


def keys_snapshot(obj) -> list | tuple:
    """What the C helpers iterate for a ``keys`` argument: an exact list's items as a tuple
    (code run during the call cannot change them), else ``PySequence_Fast``'s (a tuple as it
    is, any other iterable as a new list; a TypeError from ``iter`` says "keys must be
    iterable")."""
    if type(obj) is list:
        return tuple(obj)
    if type(obj) is tuple:
        return obj
    try:
        it = iter(obj)
    except TypeError:
        raise TypeError("keys must be iterable") from None
    return list(it)


def guarded(message: str):
    """Decorator: the method holds ``self._busy`` while it runs and refuses, with
    RuntimeError(``message``), a call made from inside another guarded call of the same
    object (a callback, or a key's ``__hash__`` or ``__eq__``): the C types' re-entry guard."""
    def decorate(method):
        @functools.wraps(method)
        def guarded_method(self, *args):
            if self._busy:
                raise RuntimeError(message)
            self._busy = True
            try:
                return method(self, *args)
            finally:
                self._busy = False
        return guarded_method
    return decorate


def get_buffer(obj, *, writable: bool) -> memoryview:
    """``PyObject_GetBuffer`` with ``PyBUF_C_CONTIGUOUS`` (and ``PyBUF_WRITABLE``): a view
    the caller releases. Refuses a non-buffer, a read-only buffer when ``writable`` and a
    non-contiguous one with the C call's exception type (and, for bytes, bytearray and
    memoryview exporters, its message)."""
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"a bytes-like object is required, not '{tp_name(obj)}'") from None
    try:
        if writable and view.readonly:
            raise BufferError("memoryview: underlying buffer is not writable"
                              if isinstance(obj, memoryview) else "Object is not writable.")
        if not view.c_contiguous:
            raise BufferError("memoryview: underlying buffer is not C-contiguous")
    except BaseException:
        view.release()
        raise
    return view


def all_views(views) -> list[memoryview]:
    """The views an iterable makes, as ``PyObject_GetBuffer`` calls in a row: if making one
    raises, those already made are released before the error propagates."""
    made: list[memoryview] = []
    try:
        for view in views:
            made.append(view)
    except BaseException:
        release(made)
        raise
    return made


def release(views) -> None:
    """``PyBuffer_Release`` of each view."""
    for view in views:
        view.release()


def key_hex(key) -> str:
    """``PyObject_CallMethod(key, "hex", NULL)`` as the C helpers format it into a KeyError
    message (``%S``: the result's ``str``)."""
    return str(key.hex())

"""Logging of the processes shmtier starts itself (tier workers; the p2p endpoint and the
segment guardian can use it too): shmtier's own loggers only, third-party loggers only
when asked for by name, and never a secret.

Who calls: the entry point of such a process, once, before anything logs
(``workers/job_loop.py``'s ``main``). Reads the environment, adds one stderr handler;
never blocks.

- ``SHMTIER_LOG`` (default ``WARNING``): the level of the ``shmtier`` loggers (every
  module of shmtier logs under ``shmtier.``). The root logger is left alone, so a
  library's debug output (botocore's wire log: request headers with the S3 session
  token) does not follow it.
- ``SHMTIER_LOG_THIRD_PARTY`` (default empty): other loggers to show, by name, each with
  its level or ``SHMTIER_LOG``'s: ``"botocore=DEBUG,urllib3=INFO"``, ``"botocore"``.
  Everything else third-party logs only at WARNING and above (Python's last-resort
  output, as before).

Every record of the process goes through ``shmtier.shared.redact`` (installed here):
URL credentials, the secrets the process registered (the ``Secret`` values of its tiers'
configs, ``redact.register_secret``) and credential headers are replaced by ``***``, also in
third-party output asked for. A malformed variable is reported in one WARNING line and
otherwise ignored: logging never stops a process from starting.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import IO

from shmtier.shared import redact

__all__ = ["ENV_LEVEL", "ENV_THIRD_PARTY", "configure_logging"]

ENV_LEVEL = "SHMTIER_LOG"
ENV_THIRD_PARTY = "SHMTIER_LOG_THIRD_PARTY"
DEFAULT_LEVEL = logging.WARNING
#: The loggers shmtier's own code logs to (``logging.getLogger(__name__)`` in shmtier.*).
OWN_LOGGER = "shmtier"
_MARK = "_shmtier_log_setup"  # on the handler this module added, to replace it when re-run


def configure_logging(role: str, *, stream: IO[str] | None = None) -> None:
    """Log ``shmtier``'s loggers (at ``SHMTIER_LOG``) and the third-party loggers named
    in ``SHMTIER_LOG_THIRD_PARTY`` to ``stream`` (stderr), each line naming the
    process's ``role`` (e.g. ``"tier-worker 0"``) and pid. Installs the redaction hook.
    Calling it again replaces what an earlier call set up."""
    redact.install()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {role} [%(process)d] %(name)s: %(message)s"))
    setattr(handler, _MARK, True)
    problems = []
    level, problem = _level(os.environ.get(ENV_LEVEL, ""), DEFAULT_LEVEL, ENV_LEVEL)
    if problem:
        problems.append(problem)
    loggers = {OWN_LOGGER: level}
    named, more = _third_party(os.environ.get(ENV_THIRD_PARTY, ""), level)
    problems += more
    loggers.update(named)
    for name, name_level in loggers.items():
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if getattr(h, _MARK, False)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(name_level)
        logger.propagate = False  # one line per record, whatever the root logger has
    for problem in problems:
        logging.getLogger(__name__).warning("%s", problem)


def _level(text: str, default: int, where: str) -> tuple[int, str | None]:
    """The logging level ``text`` names (``DEBUG``, ``info``, ``10``), or ``default``
    and why when it names none."""
    text = text.strip()
    if not text:
        return default, None
    if text.isdigit():
        return int(text), None
    level = logging.getLevelName(text.upper())
    if isinstance(level, int):
        return level, None
    return default, (f"{where}={text!r} is not a logging level (DEBUG, INFO, WARNING, "
                     f"ERROR, CRITICAL or a number); using {logging.getLevelName(default)}")


def _third_party(text: str, default: int) -> tuple[dict[str, int], list[str]]:
    """``SHMTIER_LOG_THIRD_PARTY``'s loggers and levels, and what was wrong in it."""
    loggers, problems = {}, []
    for item in text.replace(";", ",").replace(" ", ",").split(","):
        if not item.strip():
            continue
        name, _, level_text = item.partition("=")
        name = name.strip()
        if not name or name == OWN_LOGGER or name.startswith(OWN_LOGGER + "."):
            problems.append(f"{ENV_THIRD_PARTY}: {item.strip()!r} is not a third-party "
                            f"logger name (shmtier's own follow {ENV_LEVEL}); ignored")
            continue
        level, problem = _level(level_text, default, f"{ENV_THIRD_PARTY}: {name}")
        if problem:
            problems.append(problem)
        loggers[name] = level
    return loggers, problems

"""Logging: one `quantopt` logger, upstream-style `OPT_*` helpers, a log file in output_dir and step timing.

The level comes from `--log-level` or the `QUANTOPT_LOG` environment variable (debug, info, warning, error).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Iterator, List, Optional, Tuple

LOGGER = logging.getLogger("quantopt")
_FORMAT = "[%(levelname)s] %(message)s"
_FILE_FORMAT = "%(asctime)s [%(levelname)s] %(message)s"
_console_handler: Optional[logging.Handler] = None
_file_handler: Optional[logging.Handler] = None
_warning_count = 0


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the call (redirections and test captures work)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _CountingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        global _warning_count
        if record.levelno >= logging.WARNING:
            _warning_count += 1
        return True


def level_from_name(name: str) -> int:
    levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "warn": logging.WARNING,
              "error": logging.ERROR}
    key = str(name).strip().lower()
    if key not in levels:
        raise ValueError(f"unknown log level '{name}', expected one of debug, info, warning, error")
    return levels[key]


def setup_console(level: Optional[str] = None) -> None:
    """Attach the console handler once; later calls only change the level."""
    global _console_handler
    level = level or os.environ.get("QUANTOPT_LOG", "info")
    LOGGER.setLevel(logging.DEBUG)
    LOGGER.propagate = False
    if _console_handler is None:
        _console_handler = _StderrHandler()
        _console_handler.setFormatter(logging.Formatter(_FORMAT))
        _console_handler.addFilter(_CountingFilter())
        LOGGER.addHandler(_console_handler)
    _console_handler.setLevel(level_from_name(level))


def attach_file(path: str) -> None:
    """Mirror the log (at DEBUG level) into `path`, replacing a previous log file handler."""
    global _file_handler
    detach_file()
    _file_handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    _file_handler.setFormatter(logging.Formatter(_FILE_FORMAT))
    _file_handler.setLevel(logging.DEBUG)
    LOGGER.addHandler(_file_handler)


def detach_file() -> None:
    global _file_handler
    if _file_handler is not None:
        LOGGER.removeHandler(_file_handler)
        _file_handler.close()
        _file_handler = None


def error_to_file(msg: str) -> None:
    """Write an error line to the attached log file only: the CLI prints the same error to the console once the
    run has unwound, after the file is detached, and the log must hold it too."""
    if _file_handler is not None:
        _file_handler.handle(LOGGER.makeRecord(LOGGER.name, logging.ERROR, __file__, 0, msg, None, None))


def warning_count() -> int:
    return _warning_count


def OPT_DEBUG(msg: str) -> None:  # noqa: N802 - upstream-compatible name
    LOGGER.debug(msg)


def OPT_INFO(msg: str) -> None:  # noqa: N802
    LOGGER.info(msg)


def OPT_WARN(msg: str) -> None:  # noqa: N802
    LOGGER.warning(msg)


def OPT_ERROR(msg: str) -> None:  # noqa: N802
    LOGGER.error(msg)


class StepTimer:
    """Records how long each named workflow step took, for the log and the final report."""

    def __init__(self) -> None:
        self.steps: List[Tuple[str, float]] = []

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        OPT_INFO(f"[step] {name} ...")
        start, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.steps.append((name, elapsed))
            # CPU seconds of the process too: on a shared machine they measure the work, wall time the wait
            OPT_INFO(f"[step] {name} done in {elapsed:.3f}s (cpu {time.process_time() - cpu:.3f}s)")

"""Shared by the global-calibration tests: a handler that records log lines. They run at whatever thread count torch
has: the methods' results do not depend on it (quantopt/threads.py, tests/test_threads.py)."""
from __future__ import annotations

import logging
from typing import List


class RecordedLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

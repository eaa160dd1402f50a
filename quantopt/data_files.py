"""Reading user data files for dataset plugins: every failure is a DataError naming the file."""
from __future__ import annotations

import os
from typing import List, Tuple

from .errors import DataError


def read_head(path: str, count: int, expected: str) -> bytes:
    """The first `count` bytes of `path` (to tell formats apart by their magic bytes); `expected` describes the
    files the plugin reads, for the message when `path` is a folder."""
    if not os.path.exists(path):
        raise DataError("file not found", file=path)
    if os.path.isdir(path):
        raise DataError(f"is a directory, expected {expected}", file=path)
    try:
        with open(path, "rb") as f:
            return f.read(count)
    except OSError as e:
        raise DataError(f"cannot read the file: {e.strerror or e}", file=path) from None


def text_lines(path: str, skip_comments: bool = False) -> List[Tuple[int, str]]:
    """(line number, stripped text) of the non-blank lines of a UTF-8 text file (without `#` comment lines when
    `skip_comments`)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise DataError("file not found", file=path) from None
    except UnicodeDecodeError:
        raise DataError("not a UTF-8 text file", file=path) from None
    except OSError as e:
        raise DataError(f"cannot read the file: {e.strerror or e}", file=path) from None
    return [(n, s.strip()) for n, s in enumerate(text.splitlines(), 1)
            if s.strip() and not (skip_comments and s.lstrip().startswith("#"))]

"""Progress bars for the loops over data (statistics, calibration, similarity, metrics, search).

A run over a large data set takes minutes; a bar with the rate and the time left tells the user it is moving and
when it will end. Bars are drawn only when the stream (stderr by default) is a terminal, so logs captured by CI or
redirected to a file stay free of carriage-return noise. `QUANTOPT_PROGRESS=1` forces bars on, `=0` forces them
off. tqdm draws the bar when it is installed; otherwise a small built-in bar does the same job.
"""
from __future__ import annotations

import os
import sys
import time
from typing import IO, Any, Generic, Iterable, Iterator, Optional, TypeVar

try:  # optional: a nicer bar when installed, never required
    from tqdm import tqdm as _tqdm
except ImportError:  # pragma: no cover - depends on the environment
    _tqdm = None

T = TypeVar("T")

ENV_VAR = "QUANTOPT_PROGRESS"


def progress_enabled(stream: Optional[IO[str]] = None) -> bool:
    """Whether bars are drawn on `stream`: the env override if set, else whether the stream is a terminal."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or unusual stream objects
        return False


def format_duration(seconds: float) -> str:
    """`mm:ss`, or `h:mm:ss` past an hour; `--:--` when unknown."""
    if seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "--:--"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress(Generic[T]):
    """An iterable that yields the items of `iterable` unchanged and draws a bar while doing so.

    It also answers `len()` when the total is known, so it can stand in for a list where a callee both iterates
    and counts (e.g. `layer_similarity(..., progress(batches, "similarity"))`).
    """

    def __init__(self, iterable: Iterable[T], desc: str = "", total: Optional[int] = None,
                 stream: Optional[IO[str]] = None, enabled: Optional[bool] = None, backend: str = "auto",
                 min_interval: float = 0.1) -> None:
        self.iterable = iterable
        self.desc = desc
        if total is None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.total = total
        self.stream = stream
        self.enabled = progress_enabled(stream) if enabled is None else enabled
        if backend not in ("auto", "tqdm", "builtin"):
            raise ValueError(f"progress backend must be 'auto', 'tqdm' or 'builtin', not {backend!r}")
        self.backend = "tqdm" if backend == "auto" and _tqdm is not None else backend
        if self.backend == "tqdm" and _tqdm is None:
            self.backend = "builtin"
        self.min_interval = min_interval

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError(f"progress '{self.desc}' has no known total")
        return self.total

    def __iter__(self) -> Iterator[T]:
        if not self.enabled:
            yield from self.iterable
            return
        if self.backend == "tqdm":
            bar = _tqdm(self.iterable, desc=self.desc, total=self.total, file=self.stream or sys.stderr,
                        leave=False, dynamic_ncols=True, mininterval=self.min_interval)
            try:
                yield from bar
            finally:
                bar.close()
            return
        yield from self._builtin()

    # ------------------------------------------------------------------------------------------ built-in bar
    def _builtin(self) -> Iterator[T]:
        stream = self.stream or sys.stderr
        start = time.perf_counter()
        last_draw = -float("inf")
        count = 0
        width = 0

        def draw(final: bool = False) -> None:
            nonlocal width
            line = self.render_line(count, time.perf_counter() - start)
            stream.write("\r" + line.ljust(width))
            width = max(width, len(line))
            if final:
                stream.write("\r" + " " * width + "\r")  # leave the line clean for the log messages after it
            stream.flush()

        try:
            draw()
            for item in self.iterable:
                yield item
                count += 1
                now = time.perf_counter()
                if now - last_draw >= self.min_interval or (self.total is not None and count >= self.total):
                    last_draw = now
                    draw()
        finally:
            draw(final=True)

    def render_line(self, count: int, elapsed: float, bar_width: int = 24) -> str:
        """One status line: `desc: 40%|#####     | 4/10 [00:02<00:03, 2.00 it/s]` (no total: no bar, no ETA)."""
        rate = count / elapsed if elapsed > 0 else 0.0
        prefix = f"{self.desc}: " if self.desc else ""
        speed = f"{rate:.2f} it/s" if rate >= 1 or rate == 0 else f"{1 / rate:.2f} s/it"
        if self.total:
            frac = min(count / self.total, 1.0)
            filled = int(frac * bar_width)
            eta = (self.total - count) / rate if rate > 0 else float("nan")
            return (f"{prefix}{frac * 100:3.0f}%|{'#' * filled}{' ' * (bar_width - filled)}| {count}/{self.total} "
                    f"[{format_duration(elapsed)}<{format_duration(eta)}, {speed}]")
        return f"{prefix}{count} [{format_duration(elapsed)}, {speed}]"


def progress(iterable: Iterable[T], desc: str = "", total: Optional[int] = None, **kwargs: Any) -> Progress[T]:
    """Wrap a loop over data with a progress bar (rate and ETA) drawn only on a terminal.

    `total` defaults to `len(iterable)` when it has one; generators need it passed for a percentage and an ETA.
    Keyword arguments: `stream` (default stderr), `enabled` (None: decide from the stream and QUANTOPT_PROGRESS),
    `backend` ('auto', 'tqdm', 'builtin'), `min_interval` (seconds between redraws).
    """
    return Progress(iterable, desc, total, **kwargs)

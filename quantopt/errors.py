"""One family of user-facing errors, each carrying where the problem is (file:line or field) and an exit code.

The CLI prints `str(error)` as a single line and exits with `error.exit_code`; anything that is not a
`QuantOptError` is a bug in quantopt and is reported with a traceback hint.
"""
from __future__ import annotations

from typing import Optional


class QuantOptError(Exception):
    """Base of all errors caused by user input (files, cfg values, data, plugins)."""

    exit_code = 1
    kind = "error"

    def __init__(self, message: str, *, file: Optional[str] = None, line: Optional[int] = None,
                 field: Optional[str] = None, layer: Optional[str] = None) -> None:
        self.message = self._from_worker(str(message))
        self.file = file
        self.line = line
        self.field = field
        self.layer = layer
        """The layer whose setting of `field` is refused: the run names the file that set it for that layer
        (config/layer_settings.py `locate_setting_error`)."""
        super().__init__(self.__str__())

    def moved(self, message: str, *, file: Optional[str] = None, line: Optional[int] = None) -> QuantOptError:
        """The same kind of error with another message and location (its field and layer dropped)."""
        return type(self)(message, file=file, line=line)

    @classmethod
    def _from_worker(cls, message: str) -> str:
        """torch's DataLoader re-raises an error of a worker process as `type(error)(text)`, the text holding the
        worker's traceback; the last line of that traceback is the original one-line error, which is kept."""
        if not (message.startswith("Caught ") and "\nOriginal Traceback" in message):
            return message
        last = message.rstrip().rsplit("\n", 1)[-1]  # "quantopt.errors.PluginError: plugin error: f.py:3: ..."
        text = last.split(": ", 1)[1] if ": " in last else last
        return text[len(cls.kind) + 2:] if text.startswith(cls.kind + ": ") else text

    def location(self) -> str:
        if self.file and self.line:
            return f"{self.file}:{self.line}"
        if self.file:
            return str(self.file)
        if self.field:
            return f"field '{self.field}'"
        return ""

    def __str__(self) -> str:
        where = self.location()
        return f"{self.kind}: {where}: {self.message}" if where else f"{self.kind}: {self.message}"


class ConfigError(QuantOptError):
    """Invalid cfg file, unknown/duplicate key or a value outside what the field allows."""

    exit_code = 2
    kind = "config error"


class IRError(QuantOptError):
    """Malformed or inconsistent Compass IR text or binary."""

    exit_code = 3
    kind = "IR error"


class DataError(QuantOptError):
    """Dataset/label files that are missing, unreadable or do not fit the model."""

    exit_code = 4
    kind = "data error"


class PluginError(QuantOptError):
    """A plugin that cannot be found, constructed or registered."""

    exit_code = 5
    kind = "plugin error"


class UnsupportedError(QuantOptError):
    """A valid request for something quantopt does not implement (yet)."""

    exit_code = 6
    kind = "unsupported"


class BatchSizeError(UnsupportedError):
    """A layer that cannot run at the data's batch size (graph/batch.py): a caller that chose a larger batch itself
    (the statistics pass's grouped forwards) runs the IR batches one by one instead."""


class OutOfMemoryError(QuantOptError):
    """The machine (or the GPU) could not give the memory a step needed: the model, its input shapes or the batch
    sizes ask for more than there is. Made from numpy's and torch's allocation failures by `as_out_of_memory`."""

    exit_code = 7
    kind = "out of memory"


OOM_MARKERS = ("can't allocate memory", "Unable to allocate", "out of memory", "not enough memory")
"""Texts of the allocation failures numpy (MemoryError), torch's CPU allocator (RuntimeError "can't allocate
memory") and CUDA (torch.cuda.OutOfMemoryError "CUDA out of memory") raise."""


def as_out_of_memory(error: BaseException) -> Optional[OutOfMemoryError]:
    """`error` as one line of kind "out of memory" when it is an allocation failure, else None."""
    text = " ".join(str(error).split())
    if not isinstance(error, MemoryError) and not any(m in text for m in OOM_MARKERS):
        return None
    if len(text) > 200:
        text = text[:200] + "..."
    return OutOfMemoryError(f"{text or type(error).__name__}: use smaller batch sizes or input shapes, or a machine "
                            "with more memory")


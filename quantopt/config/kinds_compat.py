"""Value kinds of the compat_quantized_model fields (docs/compat-quantized.md).

Upstream accepts values here that only its closed quantization library acts on; quantopt refuses each value it
cannot honour when the cfg is read, naming what it does instead, rather than accepting it and doing nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .kinds import ChoiceKind, IntKind, ValueKind


@dataclass
class HonouredChoiceKind(ValueKind):
    """A choice among upstream's values, of which quantopt implements `honoured`; the rest are refused with
    `why`."""

    honoured: Sequence[str]
    upstream_only: Sequence[str]
    why: str

    def parse(self, text: str) -> str:
        low = text.strip().lower()
        for c in self.upstream_only:
            if c.lower() == low:
                raise ValueError(f"'{c}' is one of upstream's values that quantopt does not implement: {self.why}")
        return ChoiceKind(self.honoured).parse(text)

    def allowed(self) -> str:
        return "one of " + ", ".join(self.honoured)


class CompatOpsKind(ValueKind):
    """`compat_quantized_model_ops`: only the empty list; every layer keeps the model's own quantization."""

    def parse(self, text: str) -> str:
        if text.strip():
            raise ValueError("quantopt keeps the given quantization of every layer of a pre-quantized model and "
                             "does not re-quantize operator types with another method; leave it empty")
        return ""

    def allowed(self) -> str:
        return "empty (the default)"


class FixedBoolKind(ValueKind):
    """A bool field of which quantopt implements one value only."""

    def __init__(self, value: bool, why: str) -> None:
        self.value = value
        self.why = why

    def parse(self, text: str) -> bool:
        from .kinds import BoolKind

        v = BoolKind().parse(text)
        if v != self.value:
            raise ValueError(self.why)
        return v

    def allowed(self) -> str:
        return "true" if self.value else "false"


class LeftShiftBitsKind(IntKind):
    """`compat_quantized_model_left_shift_bits`: upstream's Eltwise input left shift, which quantopt's Eltwise
    integer form does not have; any value set is refused."""

    def __init__(self) -> None:
        super().__init__(2, 15)

    def parse(self, text: str) -> int:
        super().parse(text)
        raise ValueError("quantopt's Eltwise integer form has no input left shift to set (docs/integer-semantics.md); "
                         "leave the field unset")

    def allowed(self) -> str:
        return "unset (upstream's default 8 has no counterpart in quantopt)"


def check_compat_cfg(cfg: Any) -> None:
    """Fields that cannot go with compat_quantized_model: they would change the given quantization."""
    if not cfg.compat_quantized_model:
        for name in ("compat_quantized_model_strategy", "compat_quantized_model_int8_to_uint8",
                     "compat_quantized_model_force_weight_asym", "compat_quantized_model_unify_shifts_mode"):
            if cfg.is_set(name):
                raise cfg.error(name, "acts only with compat_quantized_model = true")
        return
    gc = cfg.global_calibration
    if gc and not (isinstance(gc, str) and gc.strip().lower() == "none"):
        raise cfg.error("global_calibration", "would change the given quantization of a pre-quantized model "
                                              "(compat_quantized_model = true)")
    if cfg.mixed_precision_auto_search.enabled:
        raise cfg.error("mixed_precision_auto_search", "would change the given quantization of a pre-quantized "
                                                       "model (compat_quantized_model = true)")

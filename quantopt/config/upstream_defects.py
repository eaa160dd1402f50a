"""The cfg field `upstream_defects`: upstream behaviours quantopt deliberately does not copy, reproduced on request.

quantopt writes what the upstream Compass Optimizer writes except where upstream is wrong (docs/golden-differences.md
explains each case). A user whose toolchain was validated against upstream's IRs may need those exact IRs, defects
included; each name below brings one of them back. Torch-free: the cfg reader parses the field before any model
work (docs/performance.md, "Fast start").
"""
from __future__ import annotations

from typing import Dict, FrozenSet

from .kinds import ValueKind

MASK_AS_DATA = "mask_as_data"
WHERE_INTEGER_PASSTHROUGH = "where_integer_passthrough"
COUNT_INPUT_ZP = "count_input_zp"
REGION_INPUT_ZP = "region_input_zp"
CONVINTEGER_PRODUCER_ZP = "convinteger_producer_zp"
EQUAL_SCALE_PASSTHROUGH = "eltwise_equal_scale_passthrough"

DEFECTS: Dict[str, str] = {
    MASK_AS_DATA: "attention-mask values (±inf, |x| >= 1e30) are statistics data clipped to the int32 range, and a "
                  "Constant of integer-valued floats holding them (-FLT_MAX) is an int32 of scale 1; "
                  "enable_pass_detect_inf_mask_nodes sets Constant values below -32767 to -32768. Masked attention "
                  "then ignores the scores",
    WHERE_INTEGER_PASSTHROUGH: "a Where whose value inputs are one integer (scale 1) and one quantized tensor passes "
                               "the integer branch through unscaled (multiplier 1, shift 0)",
    COUNT_INPUT_ZP: "Count writes its input's zero point on its integer count output",
    REGION_INPUT_ZP: "Region writes its input's zero point on its score output",
    CONVINTEGER_PRODUCER_ZP: "ConvInteger rewrites the zero point of the layer producing its input to -x_zero_point",
    EQUAL_SCALE_PASSTHROUGH: "an Eltwise SUB, MAX or MIN of two inputs with equal scales and zero points writes "
                             "multiplier 1, shift 0, ignoring the output scale",
}
"""Each reproducible upstream defect: its name in the cfg and what it brings back."""

ALL = "all"


class UpstreamDefectsKind(ValueKind):
    """`mask_as_data, count_input_zp` (comma separated, brackets optional), `all`, or empty (the default)."""

    def parse(self, text: str) -> FrozenSet[str]:
        t = str(text).strip().strip("[]").strip()
        if not t:
            return frozenset()
        names = [s.strip().lower() for s in t.split(",")]
        if ALL in names:
            if names != [ALL]:
                raise ValueError(f"'{ALL}' already names every defect; give it alone")
            return frozenset(DEFECTS)
        for name in names:
            if name not in DEFECTS:
                raise ValueError(f"unknown upstream defect '{name}'; known: {', '.join(DEFECTS)} (or '{ALL}')")
        if len(set(names)) != len(names):
            raise ValueError("a defect is named twice")
        return frozenset(names)

    def allowed(self) -> str:
        return f"empty, '{ALL}', or a comma-separated list of: {', '.join(DEFECTS)}"

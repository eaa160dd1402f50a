"""The `global_calibration` value (methods, parameters, scopes): its grammar is `quantopt/config/global_calibration.py`,
kept free of torch so that reading a cfg and `quantopt --field` import no tensor code; re-exported here for the
methods of this package."""
from __future__ import annotations

from ...config.global_calibration import (
    FIELD,
    FLAG_PARAMS,
    INTEGER_PARAMS,
    METHOD_INTEGER_PARAMS,
    METHODS,
    MVN_BITS,
    GlobalCalibrationKind,
    GlobalMethodSpec,
    MethodInfo,
    Scope,
    format_global_calibration,
    parse_global_calibration,
)

__all__ = [
    "FIELD", "FLAG_PARAMS", "INTEGER_PARAMS", "METHOD_INTEGER_PARAMS", "METHODS", "MVN_BITS", "GlobalCalibrationKind",
    "GlobalMethodSpec", "MethodInfo", "Scope", "format_global_calibration", "parse_global_calibration",
]

"""The value grammars of the calibration fields: local strategies (`calibration_strategy_for_*`),
`trim_infinity_before_statistic` and `unify_scales_for_multi_inputs_operators`.

They live here, without torch, so that reading a cfg and `quantopt --field` import no tensor code; the calibration
modules that apply these values (`calibration/strategies.py`, `statistics.py`, `unify_scales.py`) import them from
here and re-export them under their old names.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple, Union

from ..errors import UnsupportedError
from .optypes import lookup_optype

__all__ = [
    "STRATEGY_FORMS", "Strategy", "WEIGHTED_SCALE_PARAM_DEFAULTS", "check_not_auto", "invalid_strategy",
    "parse_strategy", "Trim", "parse_trim", "UNIFY_ALLOWED_TEXT", "UNIFY_METHODS", "UnifyRule", "UnifyRules",
    "parse_unify_rules",
]

# ------------------------------------------------------------------------------------------ local strategies
WEIGHTED_SCALE_PARAM_DEFAULTS = (0.685, 0.875, 0.7175, 0.01965)

STRATEGY_FORMS = ("extrema", "mean", "in_ir", "Nstd (e.g. 3std, 2.5std)", "[R]percentile (e.g. percentile, "
                  "0.9percentile)", "[N]kld (e.g. kld, 5kld)", "[R]aciq_laplace", "[R]aciq_gauss",
                  "weighted_scale_param", "weighted_scale_param[r1,r2,r3,r4]",
                  "quantile[P] (a true percentile, e.g. quantile[99.99]; plain quantile: 99.99)", "mse")

QUANTILE_DEFAULT = 99.99

_STRATEGY_NUM = r"(?:\d+\.?\d*|\.\d+)"
_RE_STD = re.compile(rf"^({_STRATEGY_NUM})std$")
_RE_KLD = re.compile(r"^(\d*)kld$")
_RE_R = re.compile(rf"^({_STRATEGY_NUM})?(percentile|aciq_laplace|aciq_gauss)$")
_RE_QUANTILE = re.compile(rf"^quantile(?:\[({_STRATEGY_NUM})\])?$")  # spaces removed
_RE_WSP = re.compile(rf"^weighted_scale_param(?:\[({_STRATEGY_NUM}),({_STRATEGY_NUM}),({_STRATEGY_NUM}),"
                     rf"({_STRATEGY_NUM}),?\])?$")  # spaces removed


@dataclass(frozen=True)
class Strategy:
    """A parsed local calibration strategy.

    name: 'extrema' | 'mean' | 'in_ir' | 'std' | 'percentile' | 'kld' | 'aciq_laplace' | 'aciq_gauss' |
    'weighted_scale_param' | 'quantile' | 'mse'. value: N for std, R for percentile/aciq, top-N for kld (an
    integer >= 2), P (percent) for quantile, unused otherwise. params: (r1, r2, r3, r4) for
    weighted_scale_param. text: the normalised spelling.
    """

    name: str
    value: float = 1.0
    params: Tuple[float, ...] = ()
    text: str = ""

    @property
    def needs_histogram(self) -> bool:
        return self.name in ("kld", "quantile", "mse")

    @property
    def needs_moments(self) -> bool:
        return self.name in ("std", "aciq_laplace", "aciq_gauss", "weighted_scale_param")

    @property
    def is_auto_weighted(self) -> bool:
        return self.name == "weighted_scale_param" and self.params[0] > 1.0

    def __str__(self) -> str:
        return self.text or self.name


def invalid_strategy(text: str, why: str = "unknown calibration strategy") -> ValueError:
    """The error for a strategy quantopt does not know, listing the valid forms."""
    return ValueError(f"{why} {text!r}; valid forms: {', '.join(STRATEGY_FORMS)}")


def parse_strategy(text: Union[str, Strategy]) -> Strategy:
    """Parse a strategy name (case-insensitive, surrounding spaces ignored). Unknown -> ValueError.

    `weighted_scale_param[r1,...]` with r1 > 1 (upstream's automatic search) raises UnsupportedError.
    """
    if isinstance(text, Strategy):
        return text
    if not isinstance(text, str):
        raise TypeError(f"calibration strategy must be a string, got {type(text).__name__}")
    s = text.strip().lower()
    if s in ("extrema", "mean", "in_ir", "mse"):
        return Strategy(s, text=s)
    m = _RE_QUANTILE.match(s.replace(" ", ""))
    if m:
        percent = QUANTILE_DEFAULT if m.group(1) is None else float(m.group(1))
        if not 0.0 < percent <= 100.0:
            raise invalid_strategy(text, "quantile percent must be in (0, 100] in")
        return Strategy("quantile", percent, text=f"quantile[{percent:g}]")
    m = _RE_STD.match(s)
    if m:
        return Strategy("std", float(m.group(1)), text=s)
    m = _RE_KLD.match(s)
    if m:
        n = 10 if not m.group(1) else max(2, int(m.group(1)))
        return Strategy("kld", float(n), text=s)
    m = _RE_R.match(s)
    if m:
        r = 1.0 if m.group(1) is None else float(m.group(1))
        return Strategy(m.group(2), r, text=s)
    m = _RE_WSP.match(s.replace(" ", ""))
    if m:
        params = WEIGHTED_SCALE_PARAM_DEFAULTS if m.group(1) is None else tuple(float(g) for g in m.groups())
        strategy = Strategy("weighted_scale_param", params=params,
                            text="weighted_scale_param[" + ",".join(f"{p:g}" for p in params) + "]")
        check_not_auto(strategy)
        return strategy
    raise invalid_strategy(text)


def check_not_auto(strategy: Strategy) -> None:
    """Refuse upstream's automatic weighted_scale_param search (r1 > 1), which quantopt does not implement."""
    if strategy.is_auto_weighted:
        raise UnsupportedError(
            f"calibration strategy '{strategy}': weighted_scale_param with r1 > 1 selects upstream's automatic "
            "heuristic search (spectral divergence + cosine over the raw tensor values, with state shared across "
            "tensors); quantopt does not implement it. Give explicit r1..r4 <= 1, e.g. "
            "weighted_scale_param[0.685,0.875,0.7175,0.01965].")


# ------------------------------------------------------------------------------------------ trimming
class Trim(NamedTuple):
    """`trim_infinity_before_statistic`: method 'clip' or 'second', and the bounds lo <= 0 <= hi."""

    method: str
    lo: float
    hi: float


_TRIM_NUM = r"[-+]?(?:inf|(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)"
_TRIM_RE = re.compile(rf"^(clip|second)\s*\(\s*({_TRIM_NUM})\s*,\s*({_TRIM_NUM})\s*\)$", re.IGNORECASE)


def parse_trim(text: Optional[str]) -> Optional[Trim]:
    """Parse the upstream field text `clip(-inf, inf)` / `second(-1e4, 1e4)`; '' or None means no trimming.

    Bounds are decimal numbers or +-inf and must satisfy lo <= 0 <= hi (upstream's requirement).
    """
    if text is None:
        return None
    s = str(text).strip()
    if not s:
        return None
    m = _TRIM_RE.match(s)
    if not m:
        raise ValueError(f"invalid trim_infinity_before_statistic {text!r}: expected 'clip(lo, hi)' or "
                         "'second(lo, hi)' with numbers or -inf/inf, e.g. 'clip(-inf, inf)' or "
                         "'second(-65504, 65504)'")
    lo, hi = float(m.group(2)), float(m.group(3))
    if not lo <= 0.0 <= hi:
        raise ValueError(f"invalid trim_infinity_before_statistic {text!r}: need lo <= 0 <= hi")
    return Trim(m.group(1).lower(), lo, hi)


# ------------------------------------------------------------------------------------------ scale unification
UNIFY_METHODS = ("max", "min", "avg", "out", "skip")
"""How the common scale is chosen: the largest (finest) or smallest (coarsest) branch scale, their mean, the
target's own output scale, or leave the layer alone."""


@dataclass(frozen=True)
class UnifyRule:
    """One `(OpType, depth, threshold, method)` entry: depth 0 means no limit."""

    optype: str
    depth: int
    threshold: float
    method: str

    def __str__(self) -> str:
        return f"({self.optype}, {self.depth}, {self.threshold:g}, {self.method})"


class UnifyRules(tuple):
    """The parsed value of `unify_scales_for_multi_inputs_operators` (a tuple of UnifyRule)."""

    def rule_for(self, optype: str) -> Optional[UnifyRule]:
        low = str(optype).lower()
        return next((r for r in self if r.optype.lower() == low), None)

    def __str__(self) -> str:
        return "[" + ", ".join(str(r) for r in self) + "]"


UNIFY_ALLOWED_TEXT = ("[(OpType, depth, threshold, method), ...] with depth an integer >= 0 (0: no limit), "
                      "threshold a number >= 1 and method one of " + ", ".join(UNIFY_METHODS))


def parse_unify_rules(text: str) -> UnifyRules:
    """Parse `[(Concat, 20, 1.05, max), (Eltwise, 0, 1.0, avg)]`; raises ValueError saying what is wrong."""
    t = text.strip()
    if not t:
        return UnifyRules()
    if not (t.startswith("[") and t.endswith("]")):
        raise ValueError("expected a list in brackets: [(OpType, depth, threshold, method), ...]")
    body = t[1:-1].strip()
    rules: List[UnifyRule] = []
    pos = 0
    while pos < len(body):
        m = re.compile(r"\s*,?\s*").match(body, pos)
        pos = m.end() if m else pos
        if pos >= len(body):
            break
        if body[pos] != "(":
            raise ValueError(f"expected '(' at '{body[pos:pos + 20]}'")
        end = body.find(")", pos)
        if end < 0:
            raise ValueError(f"missing ')' after '{body[pos:pos + 20]}'")
        rules.append(_parse_rule(body[pos + 1:end]))
        pos = end + 1
    seen = set()
    for r in rules:
        if r.optype.lower() in seen:
            raise ValueError(f"operator type '{r.optype}' is listed twice")
        seen.add(r.optype.lower())
    return UnifyRules(rules)


def _parse_rule(text: str) -> UnifyRule:
    parts = [p.strip() for p in text.split(",")]
    if parts and parts[-1] == "":
        parts = parts[:-1]
    if len(parts) != 4:
        raise ValueError(f"'({text})' needs 4 items: OpType, depth, threshold, method")
    name, depth, threshold, method = parts
    try:
        optype = str(lookup_optype(name))
    except KeyError:
        raise ValueError(f"unknown operator type '{name}'") from None
    if not re.fullmatch(r"\d+", depth):
        raise ValueError(f"depth '{depth}' of {optype} is not an integer >= 0")
    try:
        thr = float(threshold)
    except ValueError:
        raise ValueError(f"threshold '{threshold}' of {optype} is not a number") from None
    if not thr >= 1.0 or thr == float("inf"):
        raise ValueError(f"threshold {threshold} of {optype} must be a finite number >= 1")
    if method.lower() not in UNIFY_METHODS:
        raise ValueError(f"method '{method}' of {optype} is not one of {', '.join(UNIFY_METHODS)}")
    return UnifyRule(optype, int(depth), thr, method.lower())

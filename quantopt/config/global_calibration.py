"""The `global_calibration` value: methods joined by `&`, each `name`, `name[p1,p2,...]` or `name[params]<scope>`.

Upstream's syntax (docs/global-calibration.md): `none`, or one or more methods joined by `&`; each method takes
positional numeric parameters in brackets (missing ones take their defaults) and an optional scope right after them:
`[OpType,...]` (operator types, case-insensitive; an Activation layer also matches its `method`),
`[(i,j),...]` (inclusive ranges of layer ids of the input float IR) or `{regex}` (`re.match` on layer names).
As upstream, every space of the value is removed before parsing. Methods run in the order written.

This grammar lives in the config package, without torch, so that reading a cfg needs no tensor code;
`tuning/global_methods/spec.py` re-exports it for the methods.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..errors import ConfigError
from .kinds import ValueKind
from .optypes import known_optype as _known_optype
from .perlayer import IdRangeSelector, OpTypeSelector, RegexSelector

FIELD = "global_calibration"

Scope = Union[IdRangeSelector, OpTypeSelector, RegexSelector]


@dataclass(frozen=True)
class MethodInfo:
    """Positional parameter names and defaults of one method; `implemented` says whether quantopt runs it."""

    params: Tuple[str, ...]
    defaults: Tuple[Optional[float], ...]
    implemented: bool
    summary: str


METHODS: Dict[str, MethodInfo] = {
    "easy_quant": MethodInfo(("batches", "epochs", "alpha", "beta", "nsteps", "ngroups"),
                             (1, 1, 0.5, 2.0, 10, 4), True,
                             "grid search of weight and input scales maximising each layer's output cosine"),
    "adaround": MethodInfo(("batches", "epochs", "batch_size", "lr", "reg_param", "beta_start", "beta_end",
                            "warm_start"), (1, 1, 1, 0.001, 0.01, 20, 2, 0.2), True,
                           "learned up/down rounding of every weight minimising the layer reconstruction error"),
    "bias_correction": MethodInfo(("batches",), (1,), True,
                                  "per-channel output-mean correction of MAC layer biases"),
    "adaquant_zy": MethodInfo(("batches", "epochs", "batch_size", "lr_weight", "lr_bias", "lr_quant_param_weight",
                               "lr_quant_param_activation"), (1, 1, 1, 1e-5, 1e-3, 1e-3, 0.1), True,
                              "learned weight/bias offsets, weight scale and input scale of every MAC layer"),
    "svd_quant": MethodInfo(("mode", "alpha", "beta", "nsteps", "thresh"), (0, 0.5, 2.0, 10, 0.09), True,
                            "spectrum-based search (and SVD denoising) of activation ranges; mode >= 3: weight "
                            "ranges of FullyConnected layers"),
    "smooth_quant_zy": MethodInfo(("default_alpha", "auto_tune", "alpha_min", "alpha_max", "nsteps",
                                   "insert_norm_if_none"), (0.5, 0, 0, 1, 10, 0), True,
                                  "per-channel smoothing folded into Norm -> FullyConnected pairs"),
    "awq_zy": MethodInfo(("n_grid", "max_shrink", "insert_norm_if_none"), (20, 0.0, 0), True,
                         "activation-aware per-channel scaling of Norm -> FullyConnected pairs"),
    "gptq_zy": MethodInfo(("batches", "use_act_order", "perc_damp", "block_size"), (1, 1, 0.01, 128), True,
                          "Hessian-based column-by-column weight quantization with error feedback"),
    "mvn_correction": MethodInfo(("mode", "alpha", "beta", "gamma", "act_bits", "wgt_bits", "bias_bits", "lut_bits",
                                  "multiplier_bits"), (0, None, 0, 0, 16, 16, 48, 10, None), True,
                                 "range correction (and promotion) around normalization layers"),
}
"""Every method upstream knows plus `bias_correction`; the ones not implemented are refused by the parser.
A default of None is resolved by the method: mvn_correction's alpha is 0.5 for mode 0 and 1.0 otherwise, its
multiplier_bits follows act_bits."""

INTEGER_PARAMS = {"batches", "epochs", "batch_size", "nsteps", "ngroups", "mode", "n_grid", "block_size",
                  "act_bits", "wgt_bits", "bias_bits", "lut_bits", "multiplier_bits"}
METHOD_INTEGER_PARAMS = {"mvn_correction": {"beta", "gamma"}}
"""Parameters that are integers for one method only (easy_quant's and svd_quant's `beta` is a float)."""
FLAG_PARAMS = {"use_act_order", "auto_tune", "insert_norm_if_none"}
"""0/1 switches; `param()` returns them as bool."""


def _is_integer(method: str, key: str) -> bool:
    return key in INTEGER_PARAMS or key in FLAG_PARAMS or key in METHOD_INTEGER_PARAMS.get(method, ())


@dataclass(frozen=True)
class GlobalMethodSpec:
    """One method of the field: its name, every positional parameter (given or default) and its scope."""

    name: str
    params: Tuple[Optional[float], ...]
    given: int
    scope: Optional[Scope] = None

    def param(self, key: str) -> Any:
        """Parameter `key` (ints for count-like parameters)."""
        value = self.params[METHODS[self.name].params.index(key)]
        if value is None:
            return None
        if key in FLAG_PARAMS:
            return bool(value)
        return int(value) if _is_integer(self.name, key) else value

    def in_scope(self, node: Any) -> bool:
        """Whether the method may touch `node` (every layer when no scope was written)."""
        if self.scope is None:
            return True
        method = node.params.get("method") if str(node.type) == "Activation" else None
        return self.scope.matches(node.layer_id, str(node.type), None if method is None else str(method), node.name)

    def __str__(self) -> str:
        given = self.params[:self.given]
        text = self.name + ("[" + ",".join(f"{v:g}" for v in given) + "]" if given else "")
        if self.scope is not None:
            text += ("" if given else "[]") + str(self.scope)
        return text


def _error(message: str) -> ConfigError:
    return ConfigError(message, field=FIELD)


def _closing(text: str, start: int) -> int:
    """Index of the bracket closing text[start] (`[` or `{`); regex braces nest only with braces."""
    opening = text[start]
    close = "]" if opening == "[" else "}"
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\" and opening == "{":
            i += 2
            continue
        if ch == opening:
            depth += 1
        elif ch == close:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise _error(f"missing '{close}' for the '{opening}' at position {start + 1} of '{text}'")


def _split_methods(text: str) -> List[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[({":
            depth += 1
        elif ch in "])}":
            depth -= 1
        elif ch == "&" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _parse_scope(text: str, method: str) -> Scope:
    if text.startswith("{"):
        pattern = text[1:-1]
        try:
            return RegexSelector(pattern, re.compile(pattern))
        except re.error as e:
            raise _error(f"{method}: invalid regex scope {text}: {e}") from None
    body = text[1:-1]
    if not body:
        raise _error(f"{method}: empty scope []")
    if body.startswith("("):
        ranges = []
        pos = 0
        for m in re.finditer(r"\((\d+),(\d+)\)(,|$)", body):
            if m.start() != pos:
                break
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise _error(f"{method}: layer-id range ({lo},{hi}) in {text} is empty (first > last)")
            ranges.append((lo, hi))
            pos = m.end()
        if pos != len(body) or body.endswith(","):
            raise _error(f"{method}: scope {text} must be layer-id ranges written [(first,last),...]")
        return IdRangeSelector(ranges)
    names = body.split(",")
    if any(not n for n in names):
        raise _error(f"{method}: empty operator type name in scope {text}")
    bad = [n for n in names if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) or not _known_optype(n)]
    if bad:
        raise _error(f"{method}: unknown operator type(s) {', '.join(bad)} in scope {text}")
    return OpTypeSelector(names)


def _parse_params(text: str, name: str, info: MethodInfo) -> Tuple[Optional[float], ...]:
    body = text[1:-1]
    values: List[float] = []
    if body:
        for item in body.split(","):
            try:
                v = float(item)
            except ValueError:
                raise _error(f"{name}: parameter '{item}' in {text} is not a number (parameters are positional "
                             f"numbers: {name}[{','.join(info.params)}]; a scope follows them, e.g. "
                             f"{name}[]{'[Convolution]'})") from None
            if v != v or v in (float("inf"), float("-inf")):
                raise _error(f"{name}: parameter '{item}' in {text} is not a finite number")
            values.append(v)
    if len(values) > len(info.params):
        raise _error(f"{name} takes at most {len(info.params)} parameters ({', '.join(info.params)}), "
                     f"got {len(values)}")
    full = list(values) + list(info.defaults[len(values):])
    for key, v in zip(info.params, full):
        if v is None:
            continue
        if _is_integer(name, key) and v != int(v):
            raise _error(f"{name}: parameter {key}={v:g} must be an integer")
    _check_values(name, dict(zip(info.params, full)))
    return tuple(full)


def _check_values(name: str, p: Dict[str, Optional[float]]) -> None:
    for key in ("batches", "epochs", "batch_size", "nsteps", "block_size", "n_grid"):
        if key in p and p[key] is not None and p[key] < 1:
            raise _error(f"{name}: parameter {key}={p[key]:g} must be >= 1")
    for key in FLAG_PARAMS:
        if key in p and p[key] not in (0, 1):
            raise _error(f"{name}: parameter {key}={p[key]:g} must be 0 or 1")
    check = _METHOD_CHECKS.get(name)
    if check is not None:
        check(p)
    if "ngroups" in p and p["ngroups"] < 0:
        raise _error(f"{name}: parameter ngroups={p['ngroups']:g} must be >= 0 (0: each channel on its own)")
    if name == "easy_quant" and not 0 < p["alpha"] <= p["beta"]:
        raise _error(f"easy_quant: needs 0 < alpha <= beta, got alpha={p['alpha']:g}, beta={p['beta']:g}")
    if name == "adaround":
        if p["lr"] <= 0 or p["reg_param"] < 0:
            raise _error(f"adaround: needs lr > 0 and reg_param >= 0, got lr={p['lr']:g}, "
                         f"reg_param={p['reg_param']:g}")
        if not 0 <= p["warm_start"] < 1:
            raise _error(f"adaround: warm_start={p['warm_start']:g} must be in [0, 1)")
        if p["beta_start"] <= 0 or p["beta_end"] <= 0:
            raise _error("adaround: beta_start and beta_end must be > 0")


def _check_adaquant(p: Dict[str, Any]) -> None:
    lrs = ("lr_weight", "lr_bias", "lr_quant_param_weight", "lr_quant_param_activation")
    if any(p[k] < 0 for k in lrs) or all(p[k] == 0 for k in lrs):
        raise _error("adaquant_zy: learning rates must be >= 0 (0 freezes that group) and not all 0, got "
                     + ", ".join(f"{k}={p[k]:g}" for k in lrs))


def _check_svd(p: Dict[str, Any]) -> None:
    if p["mode"] < 0:
        raise _error(f"svd_quant: mode={p['mode']:g} must be >= 0")
    if not 0 < p["alpha"] <= p["beta"]:
        raise _error(f"svd_quant: needs 0 < alpha <= beta, got alpha={p['alpha']:g}, beta={p['beta']:g}")
    if not 0 <= p["thresh"] < 1:
        raise _error(f"svd_quant: thresh={p['thresh']:g} must be in [0, 1)")


def _check_smooth(p: Dict[str, Any]) -> None:
    if not 0 <= p["default_alpha"] <= 1 or not 0 <= p["alpha_min"] <= p["alpha_max"] <= 1:
        raise _error(f"smooth_quant_zy: needs 0 <= default_alpha <= 1 and 0 <= alpha_min <= alpha_max <= 1, got "
                     f"default_alpha={p['default_alpha']:g}, alpha_min={p['alpha_min']:g}, "
                     f"alpha_max={p['alpha_max']:g}")
    _no_insertion("smooth_quant_zy", p)


def _check_awq(p: Dict[str, Any]) -> None:
    if not 0 <= p["max_shrink"] <= 1:
        raise _error(f"awq_zy: max_shrink={p['max_shrink']:g} must be in [0, 1]")
    _no_insertion("awq_zy", p)


def _no_insertion(name: str, p: Dict[str, Any]) -> None:
    if p["insert_norm_if_none"]:
        raise _error(f"{name}: insert_norm_if_none=1 (inserting an identity BatchNorm before FullyConnected layers "
                     "that follow no norm) is not implemented yet in quantopt; use 0")


def _check_gptq(p: Dict[str, Any]) -> None:
    if p["perc_damp"] < 0:
        raise _error(f"gptq_zy: perc_damp={p['perc_damp']:g} must be >= 0")


MVN_BITS = {"act_bits": (8, 16), "wgt_bits": (4, 16), "bias_bits": (16, 48), "lut_bits": (8, 16),
            "multiplier_bits": (2, 15)}
"""Allowed promoted bit widths of mvn_correction: those the per-layer fields accept."""


def _check_mvn(p: Dict[str, Any]) -> None:
    if p["mode"] < 0:
        raise _error(f"mvn_correction: mode={p['mode']:g} must be >= 0")
    for key in ("alpha", "beta", "gamma"):
        if p[key] is not None and p[key] < 0:
            raise _error(f"mvn_correction: parameter {key}={p[key]:g} must be >= 0")
    for key, (lo, hi) in MVN_BITS.items():
        if p[key] is not None and not lo <= p[key] <= hi:
            raise _error(f"mvn_correction: parameter {key}={p[key]:g} must be in [{lo}, {hi}]")


_METHOD_CHECKS = {"adaquant_zy": _check_adaquant, "svd_quant": _check_svd, "smooth_quant_zy": _check_smooth,
                  "awq_zy": _check_awq, "gptq_zy": _check_gptq, "mvn_correction": _check_mvn}


def _parse_one(item: str) -> GlobalMethodSpec:
    m = re.match(r"[A-Za-z_][A-Za-z0-9_]*", item)
    if not m:
        raise _error(f"'{item}' does not start with a method name (e.g. easy_quant, adaround[1,2])")
    name = m.group(0).lower()
    info = METHODS.get(name)
    if info is None:
        close = difflib.get_close_matches(name, list(METHODS), n=2, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else f"; known methods: {', '.join(METHODS)}"
        raise _error(f"unknown method '{m.group(0)}'{hint}")
    if not info.implemented:
        done = ", ".join(k for k, v in METHODS.items() if v.implemented)
        raise _error(f"method '{name}' ({info.summary}) is not implemented yet in quantopt; implemented: {done}")
    pos = m.end()
    params: Tuple[Optional[float], ...] = tuple(info.defaults)
    given = 0
    scope: Optional[Scope] = None
    if pos < len(item):
        if item[pos] != "[":
            raise _error(f"{name}: expected '[' after the method name, got '{item[pos:]}'")
        end = _closing(item, pos)
        params = _parse_params(item[pos:end + 1], name, info)
        given = len(item[pos + 1:end].split(",")) if end > pos + 1 else 0
        pos = end + 1
    if pos < len(item):
        if item[pos] not in "[{":
            raise _error(f"{name}: expected a scope [OpType,...], [(i,j),...] or {{regex}} after the parameters, "
                         f"got '{item[pos:]}'")
        end = _closing(item, pos)
        scope = _parse_scope(item[pos:end + 1], name)
        pos = end + 1
    if pos < len(item):
        raise _error(f"{name}: unexpected '{item[pos:]}' after the scope (one scope per method; join methods "
                     "with '&')")
    return GlobalMethodSpec(name, params, given, scope)


def parse_global_calibration(text: Union[str, Sequence[GlobalMethodSpec], None]) -> List[GlobalMethodSpec]:
    """Parse the field value; `none` or an empty value give no methods. Errors are one-line ConfigErrors naming
    the field."""
    if text is None:
        return []
    if not isinstance(text, str):
        return list(text)
    compact = re.sub(r"\s+", "", text)
    if compact.lower() in ("", "none"):
        return []
    items = _split_methods(compact)
    if any(not s for s in items):
        raise _error(f"empty method in '{compact}' (methods are joined by a single '&')")
    return [_parse_one(s) for s in items]


def format_global_calibration(specs: Sequence[GlobalMethodSpec]) -> str:
    """The canonical text of parsed methods (`none` for no method)."""
    return "&".join(str(s) for s in specs) if specs else "none"


class GlobalCalibrationKind(ValueKind):
    """cfg value kind of `global_calibration`: parses into a list of GlobalMethodSpec."""

    def parse(self, text: str) -> List[GlobalMethodSpec]:
        try:
            return parse_global_calibration(text)
        except ConfigError as e:
            raise ValueError(e.message) from None

    def allowed(self) -> str:
        done = ", ".join(k for k, v in METHODS.items() if v.implemented)
        return ("none, or methods joined by '&', each name, name[p1,p2,...] or name[params] followed by a scope "
                f"[OpType,...], [(i,j),...] or {{regex}}; methods: {done}")

"""The statistics pass's deferred extrema (calibration/collect.py `_PassUpdates`): the same statistics as
`update_statistics` batch by batch, whatever paths the batches take, and the float32 EMA on Python floats."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import List, Optional

import numpy as np
import pytest
import torch

from quantopt.calibration import collect
from quantopt.calibration.collect import _PassUpdates, collect_activation_statistics
from quantopt.calibration.statistics import StatisticsConfig, _ema32, update_statistics
from quantopt.config.layer_settings import LayerSettings
from quantopt.graph.tables import TensorStatistics
from quantopt.ir.reader import read_ir

CORPUS = Path(__file__).resolve().parents[1] / "data" / "golden_corpus"


def _fields(stats: TensorStatistics) -> dict:
    out = {}
    for name in stats.__dataclass_fields__:
        v = getattr(stats, name)
        out[name] = v.tolist() if isinstance(v, torch.Tensor) else v
        if isinstance(v, torch.Tensor):
            out[name + ".dtype"] = v.dtype
    return out


def _equal(a: dict, b: dict) -> bool:
    """Field by field, NaN equal to NaN."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            continue
        if x != y:
            return False
    return True


def _batches(seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(3, 7, generator=g) * (1 + i) for i in range(4)]
    nan = torch.randn(3, 7, generator=g)
    nan[1, 2] = math.nan
    mask = torch.randn(3, 7, generator=g)
    mask[0, :3] = -math.inf
    huge = torch.randn(3, 7, generator=g)
    huge[2, 1] = 5e9  # beyond the int32 range the statistics are clipped to
    return [xs[0], xs[1], nan, xs[2], mask, torch.empty(0), xs[3], huge, torch.randint(-9, 9, (5,))]


@pytest.mark.parametrize("order", [None, [0, 1, 3, 6], [2, 0, 1], [4, 1, 6], [5, 0, 8, 7], [0, 0, 1]])
@pytest.mark.parametrize("momentum", [0.9, 0.0, 1.0, 0.37])
def test_deferred_updates_equal_the_batch_by_batch_ones(order: Optional[List[int]], momentum: float) -> None:
    batches = _batches(1)
    picked = [batches[i] for i in (order if order is not None else range(len(batches)))]
    cfg = StatisticsConfig(momentum=momentum, need_moments=False)
    assert cfg.extrema_only
    want, got = TensorStatistics(), TensorStatistics()
    updates = _PassUpdates()
    index = 0
    for x in picked:
        update_statistics(want, x, cfg, index)
        updates.update(got, x, cfg, index)
        index += 1 if order != [0, 0, 1] or index else 0  # [0, 0, 1]: one tensor updated twice in batch 0
    updates.store()
    assert _equal(_fields(got), _fields(want)), (_fields(got), _fields(want))


def test_deferred_updates_continue_earlier_statistics() -> None:
    """A pass whose first batch index is not 0 folds into the statistics it finds (and the other paths in
    between store the held state first)."""
    cfg = StatisticsConfig(need_moments=False)
    batches = _batches(2)
    want, got = TensorStatistics(), TensorStatistics()
    for s in (want, got):
        update_statistics(s, batches[0], cfg, 0)
    updates = _PassUpdates()
    for i, x in enumerate(batches[1:], start=1):
        update_statistics(want, x, cfg, i)
        updates.update(got, x, cfg, i)
    updates.store()
    assert _equal(_fields(got), _fields(want))


def test_other_strategies_take_update_statistics_as_is() -> None:
    cfg = StatisticsConfig(need_moments=True, need_histogram=True, histc_bins=16)
    assert not cfg.extrema_only
    want, got = TensorStatistics(), TensorStatistics()
    updates = _PassUpdates()
    for i, x in enumerate(_batches(3)[:4]):
        update_statistics(want, x, cfg, i)
        updates.update(got, x, cfg, i)
    assert _equal(_fields(got), _fields(want))  # nothing held back: equal before `store`


@pytest.mark.parametrize("model", ["bilstm", "mask_arithmetic", "convnext_block"])
def test_collect_gives_the_statistics_of_update_statistics(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole statistics pass over corpus models (recurrent placeholders, attention masks, convolutions),
    deferred and batch by batch (a stand-in that updates at once), field for field; every other layer collects
    per-channel statistics (the general path) and every third one moments. One forward per batch (grouped forwards:
    tests/calibration/test_grouped_statistics.py)."""

    class Immediate:
        def update(self, stats: TensorStatistics, x: torch.Tensor, cfg: StatisticsConfig, batch_index: int) -> None:
            update_statistics(stats, x, cfg, batch_index)

        def store(self) -> None:
            pass

    folder = CORPUS / model
    graph = read_ir(folder / f"{model}.txt", folder / f"{model}.bin")
    for i, n in enumerate(graph.nodes):
        n.settings = dataclasses.replace(
            LayerSettings(), q_mode_activation="per_channel_asymmetric" if i % 2 else "per_tensor_asymmetric",
            q_strategy_activation="3std" if i % 3 == 0 else "extrema")
    npz = folder / "calib.npz"
    data = dict(np.load(npz, allow_pickle=False)) if npz.exists() else {
        graph.input_tensors[0].name: np.load(folder / "calib.npy", allow_pickle=False)}
    arrays = [data[t.name if t.name in data else t.pnode.name] for t in graph.input_tensors]
    batch = graph.input_tensors[0].ir_shape[0]
    batches = [[torch.from_numpy(a[i:i + batch]) for a in arrays] for i in range(0, 3 * batch, batch)]
    results = []
    for updates in (_PassUpdates, Immediate):
        with monkeypatch.context() as m:
            m.setattr(collect, "_PassUpdates", updates)
            assert collect_activation_statistics(graph, batches, group=1) == len(batches)
        names = sorted({t.name for n in graph.nodes for t in [*n.outputs, *n.placeholders] if t in graph.statistics})
        results.append({name: _fields(graph.statistics.get(name)) for name in names})
    got, want = results
    assert got.keys() == want.keys() and len(got) > 3
    for name in got:
        assert _equal(got[name], want[name]), name


def test_ema32_equals_numpy_float32_arithmetic() -> None:
    rng = np.random.default_rng(5)
    olds = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-40, 9, 4000),
                           [0.0, -0.0, 1e-45, -1e-45, 1.17549435e-38, 2.1e9, -2.1e9, 3.4e38, 0.1, 1 / 3]])
    news = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-40, 9, 4000),
                           [1e-45, 0.0, -1e-45, 1e-40, 2.1e9, -2.1e9, 1e-30, -3.4e38, 0.2, 2 / 3]])
    for m in (0.9, 0.0, 1.0, 0.99, 0.123456789):
        for old, new in zip(olds.tolist(), news.tolist()):
            want = float(np.float32(m) * np.float32(old) + np.float32(1.0 - m) * np.float32(new))
            got = _ema32(old, new, m)
            assert got == want or (math.isnan(got) and math.isnan(want)), (old, new, m)

"""One-operator golden cases of the box post-processing operators (quantopt/ops/boxes.py): each graph is the
operator fed by model inputs (and integer constants for counts and labels), with params as upstream's IR spells
them."""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.quant.dtype import Dtype

from . import IrCase

SAMPLES = 8


def _const(b: GraphBuilder, name: str, values: list, shape: Optional[list] = None) -> str:
    """A count/label tensor as a float constant holding integers (both tools make it an integer tensor)."""
    data = np.array(values, dtype=np.float32).reshape(shape or [len(values)])
    return b.layer("Constant", [], [list(data.shape)], name=name, constants={"weights": data})


def _boxes(rng: np.random.Generator, n: int) -> np.ndarray:
    """SAMPLES x n normalized boxes (ymin, xmin, ymax, xmax) inside [0, 1]."""
    y0, x0 = rng.uniform(0.0, 0.6, size=(2, SAMPLES, n))
    h, w = rng.uniform(0.02, 0.4, size=(2, SAMPLES, n))
    return np.stack([y0, x0, y0 + h, x0 + w], axis=-1).astype(np.float32)


# ------------------------------------------------------------------------------------------------ GetValidCount
def _get_valid_count() -> PyGraph:
    b = GraphBuilder("get_valid_count")
    x = b.input("rows", [1, 10, 6])
    y = b.layer("GetValidCount", [x], [[1], [1, 10, 6], [1, 10]], name="get_valid_count",
                params={"score_threshold": 0.3, "score_index": 1, "id_index": 0},
                outputs=["count", "valid_rows", "indices"], output_dtypes=[Dtype.INT32, Dtype.FP32, Dtype.INT32])
    return b.build(y)


def _get_valid_count_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    ids = rng.choice([-1.0, 0.0, 1.0, 2.0], size=(SAMPLES, 10, 1))
    scores = rng.uniform(0.0, 1.0, size=(SAMPLES, 10, 1))
    rows = np.concatenate([ids, scores, _boxes(rng, 10)], axis=-1)
    return {"rows": rows.astype(np.float32)}


# ------------------------------------------------------------------------------------------------ FilterBoxes
def _filter_boxes() -> PyGraph:
    b = GraphBuilder("filter_boxes")
    boxes = b.input("boxes", [1, 10, 4])
    scores = b.input("scores", [1, 10])
    per_class = _const(b, "box_num_perclass", [4, 3, 3], [1, 3])
    labels = _const(b, "label_perclass", [1, 2, 5], [1, 3])
    total = _const(b, "total_class_num", [3], [1, 1])
    y = b.layer("FilterBoxes", [boxes, scores, per_class, labels, total], [[1, 6, 4], [1, 6], [1, 3], [1, 3], [1, 1]],
                name="filter_boxes", params={"score_threshold": 0.25, "min_size": [0.1, 0.1], "maxnum": 6},
                outputs=["kept_boxes", "kept_scores", "kept_perclass", "kept_labels", "kept_classes"],
                output_dtypes=[Dtype.FP32, Dtype.FP32, Dtype.INT32, Dtype.INT32, Dtype.INT32])
    return b.build(y)


def _filter_boxes_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"boxes": _boxes(rng, 10), "scores": rng.uniform(0.0, 1.0, size=(SAMPLES, 10)).astype(np.float32)}


# ------------------------------------------------------------------------------------------------ BoundingBox
def _bounding_box() -> PyGraph:
    b = GraphBuilder("bounding_box")
    p = b.input("proposals", [1, 8, 4])
    d = b.input("deltas", [1, 8, 4])
    y = b.layer("BoundingBox", [p, d], [[1, 8, 4]], name="bounding_box", params={"coordinate_order": "YX"})
    return b.build([y])


def _bounding_box_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"proposals": _boxes(rng, 8), "deltas": rng.normal(0.0, 1.0, size=(SAMPLES, 8, 4)).astype(np.float32)}


# ------------------------------------------------------------------------------------------------ MultiboxTransformLoc
def _multibox() -> PyGraph:
    b = GraphBuilder("multibox")
    c = b.input("class_scores", [1, 4, 12])
    d = b.input("deltas", [1, 48])
    a = b.input("anchors", [1, 12, 4])
    y = b.layer("MultiboxTransformLoc", [c, d, a], [[1, 12, 6], [1]], name="multibox",
                params={"variance": [0.1, 0.1, 0.2, 0.2], "score_threshold": 0.3}, outputs=["rows", "count"],
                output_dtypes=[Dtype.FP32, Dtype.INT32])
    return b.build(y)


def _multibox_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    logits = rng.normal(0.0, 1.5, size=(SAMPLES, 4, 12))
    scores = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    anchors = np.repeat(_boxes(np.random.default_rng(11), 12)[:1][..., [1, 0, 3, 2]], SAMPLES, axis=0)
    return {"class_scores": scores.astype(np.float32),
            "deltas": rng.normal(0.0, 1.0, size=(SAMPLES, 48)).astype(np.float32), "anchors": anchors}


# ------------------------------------------------------------------------------------------------ Region
def _region() -> PyGraph:
    b = GraphBuilder("region")
    x = b.input("features", [1, 4, 4, 2, 8])
    y = b.layer("Region", [x], [[1, 96], [1, 96, 4], [1, 3], [1, 3], [1, 1]], name="region",
                params={"grid_width": 4, "grid_height": 4, "box_per_grid": 2, "max_box_num": 96, "class_num": 3,
                        "obj_thresh": 0.3, "anchors": [1.0, 1.5, 2.5, 2.0], "grid_compensate": True},
                outputs=["scores", "boxes", "box_num_perclass", "label_perclass", "total_class_num"],
                output_dtypes=[Dtype.FP32] * 5)
    return b.build(y)


def _region_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"features": rng.normal(0.0, 1.5, size=(SAMPLES, 4, 4, 2, 8)).astype(np.float32)}


# ------------------------------------------------------------------------------------------------ RegionFuse
def _region_fuse() -> PyGraph:
    b = GraphBuilder("region_fuse")
    outs = []
    for i, grid in enumerate((4, 2)):
        x = b.input(f"features{i}", [1, grid, grid, 2, 8])
        m = grid * grid * 2 * 3  # every candidate fits (upstream fails when there are more than max_box_num)
        outs.append(b.layer("Region", [x], [[1, m], [1, m, 4], [1, 3], [1, 3], [1, 1]], name=f"region{i}",
                            params={"grid_width": grid, "grid_height": grid, "box_per_grid": 2, "max_box_num": m,
                                    "class_num": 3, "obj_thresh": 0.35, "anchors": [1.0, 1.5, 2.5, 2.0],
                                    "grid_compensate": True},
                            outputs=[f"scores{i}", f"boxes{i}", f"box_num_perclass{i}", f"label_perclass{i}",
                                     f"total_class_num{i}"], output_dtypes=[Dtype.FP32] * 5))
    inputs = [outs[i][k] for k in range(5) for i in range(2)]
    y = b.layer("RegionFuse", inputs, [[1, 120], [1, 120, 4], [1, 3], [1, 3], [1, 1]], name="region_fuse",
                outputs=["scores", "boxes", "box_num_perclass", "label_perclass", "total_class_num"],
                output_dtypes=[Dtype.FP32] * 5)
    return b.build(y)


def _region_fuse_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"features0": rng.normal(0.0, 1.5, size=(SAMPLES, 4, 4, 2, 8)).astype(np.float32),
            "features1": rng.normal(0.0, 1.5, size=(SAMPLES, 2, 2, 2, 8)).astype(np.float32)}


# ------------------------------------------------------------------------------------------------ HeatmapMaxKeypoint
def _heatmap() -> PyGraph:
    b = GraphBuilder("heatmap")
    hm = b.input("heatmaps", [1, 8, 8, 4])  # one ROI per sample (the corpus' samples are batch 1)
    bx = b.input("rois", [1, 4])
    y = b.layer("HeatmapMaxKeypoint", [hm, bx], [[1, 4, 1], [1, 4, 2], [1, 4, 1]], name="keypoints",
                params={"isSoftmax": False}, outputs=["scores", "keypoints", "zeros"], output_dtypes=[Dtype.FP32] * 3)
    return b.build(y)


def _heatmap_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    # integer-valued heatmaps: upstream's float forward truncates the heatmaps to integers
    maps = np.round(rng.normal(0.0, 6.0, size=(SAMPLES, 8, 8, 4)))
    x0, y0 = rng.uniform(0.0, 150.0, size=(2, SAMPLES))
    w, h = rng.uniform(20.0, 100.0, size=(2, SAMPLES))
    return {"heatmaps": maps.astype(np.float32),
            "rois": np.stack([x0, y0, x0 + w, y0 + h], axis=-1).astype(np.float32)}


# ------------------------------------------------------------------------------------------------ PostNMS1/2
def _pixel_boxes(rng: np.random.Generator, n: int) -> np.ndarray:
    """SAMPLES x n boxes (ymin, xmin, ymax, xmax) in pixels of a 600 x 800 image."""
    return (_boxes(rng, n) * np.array([600.0, 800.0, 600.0, 800.0])).astype(np.float32)


def _post_nms1() -> PyGraph:
    b = GraphBuilder("post_nms1")
    p = b.input("proposals", [1, 12, 4])
    keep = _const(b, "keep", [3, 0, 7, 1, 2, 5], [1, 6])
    counts = _const(b, "nms_box_num_perclass", [4, 2], [1, 2])
    y = b.layer("PostNMS1", [p, keep, counts], [[1, 6, 4], [1, 6, 4]], name="post_nms1",
                params={"image_width": 800, "image_height": 600, "proposal_cnt": 6},
                outputs=["kept", "normalized"], output_dtypes=[Dtype.FP32, Dtype.FP32])
    return b.build(y)


def _post_nms2() -> PyGraph:
    b = GraphBuilder("post_nms2")
    d = b.input("detections", [1, 10, 4])
    ins = [d] + [_const(b, name, vals, [1, len(vals)]) for name, vals in (
        ("box_num_perclass", [4, 3, 3]), ("nms_box_num_perclass", [2, 2, 1]), ("total_class_num", [2]),
        ("class_label", [1, 2, 3]), ("keep", [1, 0, 3, 2, 2, 0, 1, 0, 1, 2]))]
    y = b.layer("PostNMS2", ins, [[1, 5, 4], [1, 5], [1]], name="post_nms2",
                params={"image_width": 800, "image_height": 600, "proposal_cnt": 5},
                outputs=["boxes", "scores", "count"], output_dtypes=[Dtype.FP32, Dtype.FP32, Dtype.INT32])
    return b.build(y)


# ------------------------------------------------------------------------------------------------ PyramidROIAlign
PYRAMID_SIDES = (16, 8, 4, 2)
"""Map sizes of the four levels of a 512 x 512 image (spatial scales 1/32 .. 1/256), kept tiny."""


def _pyramid_roi(sample: list, mode: str) -> PyGraph:
    b = GraphBuilder("pyramid_roi_align")
    ins = [b.input("boxes", [1, 6, 4])] + [b.input(f"p{i + 2}", [1, s, s, 2]) for i, s in enumerate(PYRAMID_SIDES)]
    y = b.layer("PyramidROIAlign", ins, [[6, 3, 3, 2]], name="pyramid_roi_align",
                params={"resize_height": 3, "resize_width": 3, "sample": sample,
                        "spatial_scale_value": [1.0 / 32, 1.0 / 64, 1.0 / 128, 1.0 / 256],
                        "coordinate_transformation_mode": mode, "image_height": 512, "image_width": 512})
    return b.build([y])


def _pyramid_roi_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    # box sides around the level thresholds (112, 224, 448 pixels)
    side = rng.uniform(40.0, 500.0, size=(SAMPLES, 6, 2))
    y0 = rng.uniform(0.0, 1.0, size=(SAMPLES, 6)) * (512.0 - side[..., 0])
    x0 = rng.uniform(0.0, 1.0, size=(SAMPLES, 6)) * (512.0 - side[..., 1])
    boxes = np.stack([y0, x0, y0 + side[..., 0], x0 + side[..., 1]], axis=-1)
    data = {"boxes": boxes.astype(np.float32)}
    for i, s in enumerate(PYRAMID_SIDES):
        data[f"p{i + 2}"] = rng.normal(0.0, 1.0, size=(SAMPLES, s, s, 2)).astype(np.float32)
    return data


# ------------------------------------------------------------------------------------------------ Proposal
def _anchor_centres() -> Dict[str, np.ndarray]:
    """24 anchors (a 4 x 2 grid of 3 shapes) of a 256 x 256 image, as centres and sizes (float32 [24])."""
    cy, cx = np.meshgrid(np.arange(4) * 64.0 + 32.0, np.arange(2) * 128.0 + 64.0, indexing="ij")
    sizes = np.array([[48.0, 48.0], [40.0, 80.0], [96.0, 64.0]])
    rows = [(y, x, h, w) for y, x in zip(cy.ravel(), cx.ravel()) for h, w in sizes]
    a = np.array(rows, dtype=np.float32)
    return {"xcenter": a[:, 1], "ycenter": a[:, 0], "ha": a[:, 2], "wa": a[:, 3]}


def _proposal() -> PyGraph:
    b = GraphBuilder("proposal")
    s = b.input("scores", [1, 24, 2])
    d = b.input("deltas", [1, 24, 4])
    y = b.layer("Proposal", [s, d], [[1, 8], [1, 8, 4], [1, 1], [1, 1]], name="proposal",
                params={"width": 256, "height": 256, "score_threshold": 0.5, "scale_anchor": [10.0, 10.0, 5.0, 5.0]},
                constants=_anchor_centres(), outputs=["scores_out", "boxes", "box_num_perclass", "total_class_num"],
                output_dtypes=[Dtype.FP32, Dtype.FP32, Dtype.INT32, Dtype.INT32])
    return b.build(y)


def _proposal_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    fg = rng.uniform(0.0, 1.0, size=(SAMPLES, 24))
    return {"scores": np.stack([1.0 - fg, fg], axis=-1).astype(np.float32),
            "deltas": rng.normal(0.0, 1.0, size=(SAMPLES, 24, 4)).astype(np.float32)}


CASES: Dict[str, IrCase] = {
    "op_getvalidcount": IrCase(_get_valid_count, _get_valid_count_data),
    "op_filterboxes": IrCase(_filter_boxes, _filter_boxes_data),
    "op_boundingbox": IrCase(_bounding_box, _bounding_box_data),
    "op_multiboxtransformloc": IrCase(_multibox, _multibox_data),
    "op_region": IrCase(_region, _region_data),
    "op_regionfuse": IrCase(_region_fuse, _region_fuse_data),
    "op_heatmapmaxkeypoint": IrCase(_heatmap, _heatmap_data),
    "op_postnms1": IrCase(_post_nms1, lambda rng: {"proposals": _pixel_boxes(rng, 12)}),
    "op_postnms2": IrCase(_post_nms2, lambda rng: {"detections": _pixel_boxes(rng, 10)}),
    "op_pyramidroialign": IrCase(lambda: _pyramid_roi([2, 2], "half_pixel"), _pyramid_roi_data),
    "op_pyramidroialign_adaptive": IrCase(lambda: _pyramid_roi([0, 0], "output_half_pixel"), _pyramid_roi_data),
    "op_proposal": IrCase(_proposal, _proposal_data),
}

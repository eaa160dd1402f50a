"""Built-in metric plugins beyond TopK/CosDistance basics: every expected value below is computed by hand."""
from __future__ import annotations

import math
import os
from typing import Any, List

import numpy as np
import pytest
import torch

from quantopt import DataError, PluginError
from quantopt.registry import METRICS, PluginType, builtin_plugin_dir, discover_plugins, get_plugin


@pytest.fixture(scope="module", autouse=True)
def _plugins() -> None:
    discover_plugins()


def metric(name: str, *args: str) -> Any:
    return get_plugin(PluginType.Metric, name)(*args)


@pytest.mark.parametrize("name, file", [
    ("FlattenCosDistanceMetric", "basic"), ("MaxAbsErrorMetric", "basic"), ("RMSEMetric", "basic"),
    ("PsnrMetric", "basic"), ("mIoUMetric", "segmentation"), ("mIoUNCHWMetric", "segmentation"),
    ("mIoUafterargmaxMetric", "segmentation"), ("F1scoreMetric", "segmentation"), ("mAPMetric", "detection"),
    ("WERMetric", "sequence"), ("CERMetric", "sequence")])
def test_registered_as_builtins(name: str, file: str) -> None:
    reg = METRICS.get(name.lower())
    assert reg is not None and reg.builtin and reg.obj.__name__ == name
    assert os.path.abspath(reg.source) == os.path.join(builtin_plugin_dir(), f"aipubt_opt_metric_{file}.py")
    assert get_plugin(PluginType.Metric, "PSNRMetric").__name__ == "PsnrMetric"  # cfg names are case-insensitive


# --------------------------------------------------------------------------------------- TopK with_argmax
def test_topk_with_argmax_takes_indices() -> None:
    m = metric("TopKMetric", "1", "true")
    m([torch.tensor([[2.0], [0.0], [1.0000001]])], torch.tensor([2, 1, 1]))  # rows 0 and 2 hit
    assert m.compute() == pytest.approx(2 / 3)
    m([torch.tensor([[float("nan")]])], torch.tensor([0]))  # a NaN index is a miss
    assert (m.correct, m.total) == (2, 4)
    assert m.report() == "top-1 accuracy is 0.5"


@pytest.mark.parametrize("k, expected", [("1", 0.0), ("2", 0.5), ("3", 1.0), ("7", 1.0)])
def test_topk_with_argmax_on_topk_indices(k: str, expected: float) -> None:
    m = metric("TopKMetric", k, "True")  # output: 3 indices per row, best first
    m([torch.tensor([[4, 2, 1], [0, 3, 5]])], torch.tensor([2, 5]))
    assert m.compute() == expected


def test_topk_with_argmax_argument_errors() -> None:
    with pytest.raises(PluginError, match="with_argmax must be true or false"):
        metric("TopKMetric", "1", "maybe")
    assert metric("TopKMetric", "5", "no").with_argmax is False


# ------------------------------------------------------------------------------------ per-output metrics
OUT_A = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
LAB_A = torch.tensor([[1.0, 0.0], [0.0, 4.0]])       # cos 1, 0
OUT_B = torch.tensor([[[1.0]], [[4.0]]])
LAB_B = torch.tensor([[1.0], [-1.0]])                 # cos 1, -1


def test_flatten_cos_distance_averages_outputs() -> None:
    m = metric("FlattenCosDistanceMetric")
    m([OUT_A[:1], OUT_B[:1]], [LAB_A[:1], LAB_B[:1]])
    m([OUT_A[1:], OUT_B[1:]], [LAB_A[1:], LAB_B[1:]])
    assert m.compute() == pytest.approx((0.5 + 0.0) / 2)
    assert m.report() == "cosine similarity is 0.25 (output 0: 0.5, output 1: 0)"
    single = metric("FlattenCosDistanceMetric")
    single([OUT_A], LAB_A)
    assert single.report() == "cosine similarity is 0.5"
    single.reset()
    assert single.compute() == 0.0


def test_max_abs_error_and_rmse() -> None:
    out = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    lab = torch.tensor([[1.0, 2.5], [3.0, 1.0]])       # errors 0, 0.5, 0, 3
    m = metric("MaxAbsErrorMetric")
    m([out], lab)
    m([out[:1]], lab[:1])                               # max 0.5 in this batch: the overall max stays 3
    assert m.compute() == 3.0
    # MSE 9.5 / 6; cosine (2 · 6/√36.25 + 13/√250) / 3
    assert m.report() == "maximum absolute error is 3.0 (output 0: max 3, MSE 1.58333, cosine 0.938428)"
    r = metric("RMSEMetric")
    r([out], lab)
    assert r.compute() == pytest.approx(math.sqrt(9.25 / 4))
    r([torch.ones(2, 1)], torch.zeros(2, 1))
    assert r.compute() == pytest.approx(math.sqrt(11.25 / 6))
    two = metric("RMSEMetric")
    two([out, torch.ones(2, 1)], [lab, torch.zeros(2, 1)])  # pooled over both outputs
    assert two.compute() == pytest.approx(math.sqrt(11.25 / 6))
    assert two.report() == f"RMSE is {two.compute()} (output 0: 1.52069, output 1: 1)"
    two.reset()
    assert two.compute() == 0.0 and two.report() == "RMSE is 0.0"


def test_per_output_metric_errors() -> None:
    m = metric("MaxAbsErrorMetric")
    with pytest.raises(DataError, match="label file"):
        m([torch.ones(2, 2)], torch.full((2,), float("-inf")))
    with pytest.raises(DataError, match="contain NaN"):
        m([torch.ones(2, 2)], torch.tensor([[1.0, float("nan")], [0.0, 0.0]]))
    with pytest.raises(DataError, match="2 output.* but the labels give 1"):
        m([torch.ones(2, 2), torch.ones(2, 1)], torch.ones(2, 2))
    with pytest.raises(DataError, match="output 0 has 2 values per sample but its label has 3"):
        m([torch.ones(2, 2)], torch.ones(2, 3))
    with pytest.raises(DataError, match="batch size 2 but its label has 3"):
        metric("RMSEMetric")([torch.ones(2, 2)], torch.ones(3, 2))


def test_psnr() -> None:
    lab = torch.zeros(2, 4)
    out = torch.tensor([[0.1] * 4, [0.01] * 4])          # MSE 1e-2 → 20 dB, 1e-4 → 40 dB at peak 1
    m = metric("PsnrMetric", "1")
    m([out], lab)
    assert m.compute() == pytest.approx(30.0)
    assert m.report() == "PSNR is 30.0000 dB (peak 1)"
    m([lab[:1]], lab[:1])                                # exact sample: counted as 100 dB
    assert m.compute() == pytest.approx((20 + 40 + 100) / 3)
    default = metric("PsnrMetric")                       # peak 255: error 25.5 → 20 dB
    default([torch.full((1, 3), 25.5)], torch.zeros(1, 3))
    assert default.compute() == pytest.approx(20.0)
    auto = metric("PsnrMetric", "auto")                  # peak = label range 4 - (-6) = 10: error 1 → 20 dB
    auto([torch.tensor([[5.0, -5.0]])], torch.tensor([[4.0, -6.0]]))
    assert auto.compute() == pytest.approx(20.0) and "peak 10" in auto.report()


def test_psnr_errors() -> None:
    for bad in ("0", "-1", "abc", "inf", "nan"):
        with pytest.raises(PluginError, match="peak must be a positive number or 'auto'"):
            metric("PsnrMetric", bad)
    auto = metric("PsnrMetric", "auto")
    auto([torch.ones(1, 4)], torch.full((1, 4), 3.0))
    with pytest.raises(DataError, match="every label value is the same"):
        auto.compute()
    with pytest.raises(DataError, match="label file"):
        auto([torch.ones(2, 4)], torch.full((2,), float("-inf")))
    assert metric("PsnrMetric").compute() == 0.0


# ------------------------------------------------------------------------------------------------ mIoU
# 3x3 map. class 0: label 3 px, predicted 2, both 2 → 2/3; class 1: label 4, predicted 6, both 4 → 2/3;
# class 2: label 2, predicted 1, both 1 → 1/2. mIoU = 11/18, pixel accuracy 7/9.
SEG_LABEL = torch.tensor([[0, 0, 1], [0, 1, 1], [2, 2, 1]])
SEG_PRED = torch.tensor([[0, 1, 1], [0, 1, 1], [2, 1, 1]])


def _scores_nhwc(pred: torch.Tensor, classes: int = 3) -> torch.Tensor:
    return torch.nn.functional.one_hot(pred, classes).float()[None] * 0.8 + 0.1  # [1,H,W,C]


def test_miou_hand_computed_nhwc_and_nchw() -> None:
    m = metric("mIoUMetric")
    m([_scores_nhwc(SEG_PRED)], SEG_LABEL[None, :, :, None])   # label [B,H,W,1]
    assert m.iou() == pytest.approx([2 / 3, 2 / 3, 1 / 2])
    assert m.compute() == pytest.approx(11 / 18)
    assert m.report() == f"mIoU is {m.compute()} over 3 classes (pixel accuracy 0.777778)"
    for nchw in (metric("mIoUMetric", "3", "nchw"), metric("mIoUNCHWMetric")):
        nchw([_scores_nhwc(SEG_PRED).permute(0, 3, 1, 2)], SEG_LABEL[None])
        assert nchw.compute() == pytest.approx(11 / 18)


def test_miou_accumulates_and_ignores() -> None:
    label = SEG_LABEL.clone()
    label[2, 2] = 255                     # class 1 loses a hit: 3 labelled, 5 predicted on scored pixels → 3/5
    m = metric("mIoUMetric", "3")
    m([_scores_nhwc(SEG_PRED)], label[None])
    assert m.compute() == pytest.approx((2 / 3 + 3 / 5 + 1 / 2) / 3)
    m.reset()
    m([_scores_nhwc(SEG_PRED)], SEG_LABEL[None])
    m([_scores_nhwc(SEG_LABEL)], SEG_LABEL[None])  # a perfect second image: class 0: 5/6, 1: 8/10, 2: 3/4
    assert m.compute() == pytest.approx((5 / 6 + 8 / 10 + 3 / 4) / 3)
    neg = metric("mIoUMetric", "0", "NHWC", "none")  # no ignore value, negative labels still skipped
    neg([_scores_nhwc(SEG_PRED)], torch.where(SEG_LABEL == 2, -1, SEG_LABEL)[None])
    assert np.isnan(neg.iou()[2])   # class 2 is only on unscored pixels: not averaged
    assert neg.compute() == pytest.approx((2 / 3 + 4 / 5) / 2)  # class 1 now predicted on 5 scored pixels


def test_miou_after_argmax() -> None:
    m = metric("mIoUafterargmaxMetric", "4")      # class 3 never appears: not averaged
    m([SEG_PRED[None].float()], SEG_LABEL[None, :, :, None])
    assert m.compute() == pytest.approx(11 / 18)
    assert np.isnan(m.iou()[3])
    wrong = SEG_PRED.clone()
    wrong[0, 0] = 7                                # outside 0..3: a miss for label class 0, no false positive
    m2 = metric("mIoUMetric", "3", "index")
    m2([wrong[None]], SEG_LABEL[None])
    assert m2.iou() == pytest.approx([1 / 3, 2 / 3, 1 / 2])


def test_miou_errors() -> None:
    for args, match in ((("x",), "class_num must be an integer >= 0"), (("3", "NCWH"), "layout must be one of"),
                        (("0", "INDEX"), "give class_num"),
                        (("3", "NHWC", "a"), "ignore_index must be an integer or none")):
        with pytest.raises(PluginError, match=match):
            metric("mIoUMetric", *args)
    with pytest.raises(PluginError, match="give class_num"):
        metric("mIoUafterargmaxMetric", "0")
    m = metric("mIoUMetric", "4")
    with pytest.raises(DataError, match="3 classes on its NHWC class axis but class_num is 4"):
        m([_scores_nhwc(SEG_PRED)], SEG_LABEL[None])
    m = metric("mIoUMetric")
    with pytest.raises(DataError, match="label value 3 is not a class index 0..2"):
        m([_scores_nhwc(SEG_PRED)], torch.full((1, 3, 3), 3))
    with pytest.raises(DataError, match="9 pixels in this batch but the label has 4"):
        m([_scores_nhwc(SEG_PRED)], torch.zeros(1, 2, 2))
    with pytest.raises(DataError, match="label file"):
        m([_scores_nhwc(SEG_PRED)], torch.tensor(float("-inf")))
    with pytest.raises(DataError, match="non-integer"):
        m([_scores_nhwc(SEG_PRED)], torch.full((1, 3, 3), 0.5))


# -------------------------------------------------------------------------------------------------- F1
# class 0: tp 2, fp 1, fn 1 → 2/3; class 1: tp 2, fp 2, fn 1 → 4/7; class 2: tp 0, fn 1 → 0
F1_LABEL = torch.tensor([1, 0, 1, 1, 0, 0, 2])
F1_PRED = torch.tensor([1, 1, 0, 1, 0, 0, 1])


def test_f1_binary_and_macro() -> None:
    binary = metric("F1scoreMetric", "INDEX")
    binary([F1_PRED], F1_LABEL)
    assert binary.compute() == pytest.approx(4 / 7)
    assert binary.report() == f"F1 score is {binary.compute()} (class 1: precision 0.5, recall 0.666667)"
    macro = metric("F1scoreMetric", "NHWC", "macro")
    scores = torch.nn.functional.one_hot(F1_PRED, 3).float()   # classification scores [B, C]
    macro([scores[:4]], F1_LABEL[:4])
    macro([scores[4:]], F1_LABEL[4:].reshape(3, 1))
    assert macro.compute() == pytest.approx((2 / 3 + 4 / 7 + 0) / 3)
    assert macro.report().endswith("(macro average over 3 classes)")
    positive0 = metric("F1scoreMetric", "index", "binary", "0")
    positive0([F1_PRED], F1_LABEL)
    assert positive0.compute() == pytest.approx(2 / 3)


def test_f1_matches_the_definition_on_random_maps() -> None:
    rng = np.random.default_rng(0)
    label = rng.integers(-1, 4, size=(3, 5, 5))       # -1: not scored
    logits = torch.from_numpy(rng.normal(size=(3, 4, 5, 5)))   # NCHW
    m = metric("F1scoreMetric", "NCHW", "macro")
    m([logits[:2]], torch.from_numpy(label[:2]))
    m([logits[2:]], torch.from_numpy(label[2:]))
    keep = label >= 0
    g, p = label[keep], logits.argmax(dim=1).numpy()[keep]
    f1 = []
    for c in range(4):   # precision and recall from their definitions, one class at a time
        precision = ((p == c) & (g == c)).sum() / (p == c).sum()
        recall = ((p == c) & (g == c)).sum() / (g == c).sum()
        f1.append(2 * precision * recall / (precision + recall))
    assert m.compute() == pytest.approx(np.mean(f1))
    b = metric("F1scoreMetric", "NCHW")
    b([logits], torch.from_numpy(label))
    assert b.compute() == pytest.approx(f1[1])


def test_f1_single_probability_channel_and_errors() -> None:
    m = metric("F1scoreMetric")                         # NHWC, one channel: P(class 1), positive at >= 0.5
    m([torch.tensor([[0.9], [0.5], [0.2], [0.1]])], torch.tensor([1, 0, 1, 0]))
    assert m.compute() == pytest.approx(0.5)            # tp 1, fp 1, fn 1
    assert metric("F1scoreMetric").compute() == 0.0
    for args, match in ((("NHCW",), "layout"), (("NHWC", "micro"), "average must be binary or macro"),
                        (("NHWC", "binary", "-1"), "positive")):
        with pytest.raises(PluginError, match=match):
            metric("F1scoreMetric", *args)
    with pytest.raises(DataError, match="label file"):
        m([torch.ones(2, 3)], torch.full((2,), float("-inf")))


# --------------------------------------------------------------------------------------------- detection
# Image A: GT cat [0,0,10,10], dog [20,20,30,30]; image B: GT cat [0,0,10,10], cat [50,50,60,60].
# Cat detections by score: 0.95 B FP, 0.9 A TP, 0.8 A FP (IoU 0.5 with a taken box), 0.6 B TP; 3 cat boxes:
# recall 0, 1/3, 1/3, 2/3, precision 0, 1/2, 1/3, 1/2, interpolated precision 1/2 everywhere up to recall 2/3.
# all-point cat AP = 2/3 · 1/2 = 1/3; 11-point: recall points 0..0.6 (7 of 11) at 1/2 → 3.5/11;
# COCO: recall points 0..0.66 (67 of 101) at 1/2. The dog detection (IoU 0.8) is a TP up to IoU 0.8: AP 1 for
# VOC, 7 of the 10 COCO thresholds → 0.7.
CAT, DOG = 0, 1
DETS = [  # per image: (class, score, box)
    [(CAT, 0.9, [0, 0, 10, 10]), (CAT, 0.8, [0, 0, 10, 5]), (DOG, 0.7, [20, 20, 30, 28])],
    [(CAT, 0.6, [50, 50, 60, 60]), (CAT, 0.95, [100, 100, 110, 110])],
]
GTS = [[(CAT, [0, 0, 10, 10]), (DOG, [20, 20, 30, 30])], [(CAT, [0, 0, 10, 10]), (CAT, [50, 50, 60, 60])]]
CAT_AP = {"voc": 1 / 3, "voc11": 3.5 / 11, "coco": 33.5 / 101}
DOG_AP = {"voc": 1.0, "voc11": 1.0, "coco": 0.7}


def flat_outputs(dets: List[list], n: int = 4, offset: int = 0, count: bool = False) -> List[torch.Tensor]:
    """boxes [B,n,4], scores [B,n], classes [B,n] (+ count [B]); padding rows: class -1, score 0."""
    boxes, scores, classes = torch.zeros(len(dets), n, 4), torch.zeros(len(dets), n), -torch.ones(len(dets), n)
    for b, image in enumerate(dets):
        for i, (c, s, box) in enumerate(image):
            boxes[b, i], scores[b, i], classes[b, i] = torch.tensor(box, dtype=torch.float32), s, c + offset
    if count:
        classes[classes < 0] = 0                      # with a count the padding rows may hold anything
        return [boxes, scores, classes, torch.tensor([len(d) for d in dets])]
    return [boxes, scores, classes]


def gt_table(gts: List[list], m: int = 3, difficult: bool = False) -> torch.Tensor:
    """[B,m,5] rows [class, y0, x0, y1, x1] padded with class -1 (a 6th column when `difficult`)."""
    table = torch.zeros(len(gts), m, 6 if difficult else 5)
    table[:, :, 0] = -1
    for b, image in enumerate(gts):
        for i, (c, box, *flag) in enumerate(image):
            table[b, i, :5] = torch.tensor([c] + box, dtype=torch.float32)
            if difficult:
                table[b, i, 5] = flag[0] if flag else 0
    return table


@pytest.mark.parametrize("method", ["voc", "voc11", "coco"])
def test_map_two_images_hand_computed(method: str) -> None:
    m = metric("mAPMetric", "2", "0", method)
    m(flat_outputs(DETS), gt_table(GTS))
    ap = m.class_ap()
    assert ap[CAT].mean() == pytest.approx(CAT_AP[method])
    assert ap[DOG].mean() == pytest.approx(DOG_AP[method])
    assert m.compute() == pytest.approx((CAT_AP[method] + DOG_AP[method]) / 2)
    split = metric("mAPMetric", "2", "0", method)       # one image per batch gives the same records
    split(flat_outputs(DETS[:1]), gt_table(GTS[:1]))
    split(flat_outputs(DETS[1:]), gt_table(GTS[1:]))
    assert split.compute() == pytest.approx(m.compute())


def test_map_reports() -> None:
    voc = metric("mAPMetric", "2")
    voc(flat_outputs(DETS), gt_table(GTS))
    assert voc.report() == (f"mAP is {voc.compute()} (VOC all-point, IoU > 0.5; 2 classes with ground truth, "
                            f"2 images, 5 detections)")
    coco = metric("mAPMetric", "2", "0", "coco")
    coco(flat_outputs(DETS), gt_table(GTS))
    ap50 = (33.5 / 101 + 1) / 2
    assert coco.report().startswith(f"mAP@[.5:.95] is {coco.compute()} (AP50 {ap50:.6g}, AP75 {ap50:.6g};")
    strict = metric("mAPMetric", "2", "0", "voc", "0.85")  # the dog box (IoU 0.8) is now a false positive
    strict(flat_outputs(DETS), gt_table(GTS))
    assert strict.compute() == pytest.approx(1 / 6)
    empty = metric("mAPMetric", "3")
    assert empty.compute() == 0.0 and "0 classes with ground truth" in empty.report()


def test_map_output_and_label_layouts_agree() -> None:
    expected = (1 / 3 + 1) / 2
    with_count = metric("mAPMetric", "2")
    with_count(flat_outputs(DETS, count=True), gt_table(GTS))
    assert with_count.compute() == pytest.approx(expected)
    # start_label 1: model class 0 is the background; its detection is dropped
    shifted = flat_outputs(DETS + [[]], offset=1)
    shifted[0][2, 0], shifted[1][2, 0], shifted[2][2, 0] = torch.tensor([0.0, 0, 10, 10]), 0.99, 0
    m = metric("mAPMetric", "2", "1")
    m(shifted, gt_table(GTS + [[(CAT, [0, 0, 10, 10])]]))
    assert m.npos.tolist() == [4, 1]
    assert m.class_ap()[CAT, 0] == pytest.approx(1 / 4 * 1 / 2 + 1 / 4 * 1 / 2)  # 2 hits of 4 boxes at 1/2
    # the label as a dict (the keys of upstream's detection datasets)
    table = gt_table(GTS)
    d = metric("mAPMetric", "2")
    d(flat_outputs(DETS), {"bbox": table[:, :, 1:5], "label_index": table[:, :, 0]})
    assert d.compute() == pytest.approx(expected)
    # the 6 grouped outputs: class count, label per class, boxes, box count per class, scores, keep
    grouped = [torch.tensor([[2.0], [1.0]]), torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.zeros(2, 4, 4),
               torch.tensor([[2.0, 1.0], [2.0, 0.0]]), torch.zeros(2, 4), torch.zeros(2, 4)]
    for b, image in enumerate(DETS):
        for i, (_, s, box) in enumerate(sorted(image, key=lambda r: r[0])):
            grouped[2][b, i], grouped[4][b, i] = torch.tensor(box, dtype=torch.float32), s
    g = metric("mAPMetric", "2")
    g(grouped, table)
    assert g.compute() == pytest.approx(expected)


def test_map_difficult_boxes_are_ignored() -> None:
    gts = [GTS[0], GTS[1] + [(CAT, [200, 200, 210, 210], 1)]]
    dets = [DETS[0], DETS[1] + [(CAT, 0.85, [200, 200, 210, 210])]]
    for method in ("voc", "coco"):
        m = metric("mAPMetric", "2", "0", method)
        m(flat_outputs(dets), gt_table(gts, m=3, difficult=True))
        assert m.npos.tolist() == [3, 1]
        assert m.class_ap()[CAT].mean() == pytest.approx(CAT_AP[method])


def test_map_swapped_corners_and_no_detections() -> None:
    m = metric("mAPMetric", "2")
    dets = [[(CAT, 0.9, [10, 10, 0, 0])], []]          # corners given max-first: the same box
    m(flat_outputs(dets), gt_table(GTS))
    assert m.class_ap()[CAT, 0] == pytest.approx(1 / 3) and m.class_ap()[DOG, 0] == 0.0


def test_map_errors() -> None:
    for args, match in ((("0",), "class_num must be a positive integer"), (("2", "a"), "start_label"),
                        (("2", "0", "voc13"), "method must be voc, voc11 or coco"),
                        (("2", "0", "coco", "0.5"), "takes no iou_threshold"),
                        (("2", "0", "voc", "1.5"), "iou_threshold must be a number between 0 and 1")):
        with pytest.raises(PluginError, match=match):
            metric("mAPMetric", *args)
    m = metric("mAPMetric", "2")
    with pytest.raises(DataError, match="label file"):
        m(flat_outputs(DETS), torch.full((2,), float("-inf")))
    with pytest.raises(DataError, match="NaN or inf"):
        m(flat_outputs(DETS), gt_table(GTS) * float("nan"))
    with pytest.raises(DataError, match="label class 1 is outside 0..0"):
        metric("mAPMetric", "1")(flat_outputs(DETS), gt_table(GTS))
    with pytest.raises(DataError, match="has 2 outputs; expected 3 or 4"):
        m(flat_outputs(DETS)[:2], gt_table(GTS))
    with pytest.raises(DataError, match=r"output 0 \(boxes\) has shape \[2, 4, 5\]"):
        m([torch.zeros(2, 4, 5), torch.zeros(2, 4), torch.zeros(2, 4)], gt_table(GTS))
    with pytest.raises(DataError, match=r"expected \[B,M,5\]"):
        m(flat_outputs(DETS), torch.zeros(2, 3, 4))
    with pytest.raises(DataError, match="2 images of detections but labels for 1"):
        m(flat_outputs(DETS), gt_table(GTS[:1]))
    with pytest.raises(DataError, match="no label_index"):
        m(flat_outputs(DETS), {"bbox": torch.zeros(2, 3, 4)})


# ----------------------------------------------------------------------------------------------- WER/CER
def codes(text: str) -> List[int]:
    return [ord(ch) for ch in text]


def padded(texts: List[str], pad: int = -1) -> torch.Tensor:
    width = max(len(t) for t in texts)
    return torch.tensor([codes(t) + [pad] * (width - len(t)) for t in texts])


def test_edit_distance() -> None:
    import aipubt_opt_metric_sequence as seq  # the plugin module, imported by discovery

    assert seq.edit_distance("kitten", "sitting") == 3
    assert seq.edit_distance("sitting", "kitten") == 3
    assert seq.edit_distance("", "abc") == 3 and seq.edit_distance("abc", "") == 3
    assert seq.edit_distance("flaw", "lawn") == 2 and seq.edit_distance("same", "same") == 0
    assert seq.edit_distance(["the", "cat"], ["the", "hat", "sat"]) == 2
    assert seq.ctc_collapse(np.array([0, 3, 3, 0, 3, 5, 5, 0]), 0).tolist() == [3, 3, 5]


def test_cer_kitten_sitting() -> None:
    m = metric("CERMetric")
    m([padded(["sitting"])], padded(["kitten"]))
    assert m.compute() == pytest.approx(3 / 6)
    assert m.report() == "CER is 0.5 (3 edits / 6 reference characters, 1 samples)"
    m([padded(["ab", "abcdefgh"], pad=-1).float()], [padded(["ab", "abcdefgh"], pad=99), torch.tensor([2, 8])])
    assert (m.edits, m.ref_len, m.samples) == (3, 16, 3)   # corpus level: 3 / 16, not the mean of the rates


def test_wer_words_from_characters_and_from_tokens() -> None:
    m = metric("WERMetric", "", "false", "32")           # characters; words split at ' ' (32)
    m([padded(["the  bat sat down"])], padded(["the cat sat"]))
    assert m.compute() == pytest.approx(2 / 3)            # 1 substitution + 1 insertion over 3 words
    assert m.report() == "WER is 0.6666666666666666 (2 edits / 3 reference words, 1 samples)"
    tokens = metric("WERMetric", "0")                     # each index a word; 0 pads both sides
    tokens([torch.tensor([[5, 6, 7, 0, 0]])], torch.tensor([[5, 7, 0, 0, 0]]))
    assert tokens.compute() == pytest.approx(1 / 2)


def test_wer_ctc_collapse() -> None:
    steps = torch.tensor([[0, 3, 3, 0, 3, 5, 5, 0], [4, 4, 4, 0, 0, 0, 0, 0]])
    m = metric("WERMetric", "0", "true")
    m([steps], torch.tensor([[3, 3, 5], [4, 2, 0]]))     # [3,3,5] exact; [4] vs [4,2]: 1 deletion
    assert (m.edits, m.ref_len) == (1, 5)
    scores = torch.nn.functional.one_hot(steps, 6).float()  # per-step scores [B,T,C]: argmax first
    s = metric("WERMetric", "0", "yes")
    s([scores], torch.tensor([[3, 3, 5], [4, 2, 0]]))
    assert (s.edits, s.ref_len) == (1, 5)
    plain = metric("WERMetric", "0")                      # without collapse the repeats count as insertions
    plain([steps], torch.tensor([[3, 3, 5], [4, 2, 0]]))
    assert plain.edits == 2 + 2                          # [3,3,3,5,5] vs [3,3,5]; [4,4,4] vs [4,2]


def test_wer_non_finite_prediction_counts_as_an_error() -> None:
    m = metric("CERMetric")
    m([torch.tensor([[1.0, float("nan"), 3.0]])], torch.tensor([[1, 2, 3]]))
    assert m.edits == 1


def test_wer_errors() -> None:
    for name, args, match in (("WERMetric", ("", "true"), "needs the blank id"),
                              ("WERMetric", ("0", "maybe"), "ctc must be true or false"),
                              ("CERMetric", ("x",), "EOF must be an integer"),
                              ("WERMetric", ("32", "false", "32"), "space and EOF must be different")):
        with pytest.raises(PluginError, match=match):
            metric(name, *args)
    m = metric("WERMetric")
    with pytest.raises(DataError, match="label file"):
        m([torch.zeros(2, 3)], torch.full((2,), float("-inf")))
    with pytest.raises(DataError, match="contain NaN"):
        m([torch.zeros(1, 3)], torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(DataError, match="lengths must be whole numbers in 0..2"):
        m([torch.zeros(1, 3)], [torch.tensor([[1, 2]]), torch.tensor([3])])
    with pytest.raises(DataError, match="2 predictions but labels for 1 samples"):
        m([torch.zeros(2, 3)], torch.tensor([[1, 2]]))
    assert metric("CERMetric").compute() == 0.0

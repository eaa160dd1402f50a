"""Writes the example of docs/plugins.md, "4.1 Writing an operator": a small float IR using the plugin operator
HardClip (plugin/aipubt_opt_op_hardclip.py) and its calibration data, all from a fixed seed.

    data [1,16] -> FullyConnected fc (16 outputs) -> HardClip clip1 (gain 1.5, limit 2) -> HardClip clip2 (gain -0.75,
    limit 1)

Run from anywhere: `python examples/plugin_op/make_model.py` rewrites model.txt, model.bin and calib.npy next to it.
Then `cd examples/plugin_op && quantopt --cfg opt.cfg` quantizes it (the plugin loads from ./plugin).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SEED = 20240611
FEATURES = 16
CALIBRATION_SAMPLES = 64


def dims(shape: list) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def layer(layer_id: int, name: str, optype: str, bottom: str, top: str, shape: list, **keys: object) -> str:
    """One layer section; every layer here keeps the shape of its input."""
    lines = [f"layer_id={layer_id}", f"layer_name={name}", f"layer_type={optype}",
             f"layer_bottom=[{bottom}]" if bottom else "layer_bottom=[]",
             f"layer_bottom_shape=[{dims(shape)}]" if bottom else "layer_bottom_shape=[]",
             "layer_bottom_type=[float32]" if bottom else "layer_bottom_type=[]",
             f"layer_top=[{top}]", f"layer_top_shape=[{dims(shape)}]", "layer_top_type=[float32]"]
    lines += [f"{k}={v}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


def main(folder: Path = HERE) -> None:
    """Write model.txt, model.bin and calib.npy into `folder`."""
    rng = np.random.default_rng(SEED)
    weights = (rng.standard_normal((FEATURES, FEATURES)) * 0.35).astype("<f4")  # [out, in]
    biases = (rng.standard_normal(FEATURES) * 0.1).astype("<f4")
    calib = rng.standard_normal((CALIBRATION_SAMPLES, FEATURES)).astype(np.float32)
    shape = [1, FEATURES]
    text = "\n".join([
        "model_name=hardclip_demo\nlayer_number=4\nprecision=float32\ninput_tensors=[data]\noutput_tensors=[clip2]\n",
        layer(0, "data", "Input", "", "data", shape),
        layer(1, "fc", "FullyConnected", "data", "fc", shape,
              weights_type="float32", weights_offset=0, weights_size=weights.nbytes,
              weights_shape=dims(weights.shape),
              biases_type="float32", biases_offset=weights.nbytes, biases_size=biases.nbytes,
              biases_shape=dims(biases.shape),
              num_output=FEATURES, with_activation="NONE"),
        layer(2, "clip1", "HardClip", "fc", "clip1", shape, gain=1.5, limit=2.0),
        layer(3, "clip2", "HardClip", "clip1", "clip2", shape, gain=-0.75, limit=1.0),
    ])
    (folder / "model.txt").write_text(text)
    (folder / "model.bin").write_bytes(weights.tobytes() + biases.tobytes())
    np.save(folder / "calib.npy", calib)


if __name__ == "__main__":
    main()

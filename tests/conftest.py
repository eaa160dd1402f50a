"""Shared test fixtures: paths to the reference models with upstream goldens (tests/data/shared_models)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_MODELS = Path(os.environ.get("QUANTOPT_SHARED_MODELS", REPO / "tests" / "data" / "shared_models"))
MODEL_NAMES = ["syn_resnet", "syn_mobilenet", "ppocr_cls", "mtcnn_onet"]


@pytest.fixture(scope="session", autouse=True)
def _load_plugins():
    from quantopt.registry import discover_plugins

    discover_plugins()


def shared_model_dir(name: str) -> Path:
    path = SHARED_MODELS / name
    if not path.is_dir():
        pytest.skip(f"reference model folder {path} is not present")
    return path

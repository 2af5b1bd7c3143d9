"""Shared fixtures: repo root on sys.path, tiny random models saved to disk, the embedded model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct (fp32, CPU), loaded once per test session."""
    from engine.decoding.models import load_model

    return load_model("embedded", device="cpu")

"""Fixtures shared by the expert-tier tests: the demo GGUF opened once per module, and one torch
thread per test (tiny shapes: extra threads only spin against each other)."""

from __future__ import annotations

import pytest
import torch

from moestream.cli import DEMO_MODEL
from moestream.weights.loader import open_model


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def source():
    return open_model(DEMO_MODEL)

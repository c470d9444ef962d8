"""torchcomms' window ring test, both window forms, numpy and torch, 2 and 4 ranks."""

import pytest

from conftest import launch, requires_torch


@pytest.mark.parametrize("ranks", [2, 4])
def test_window_ring_numpy(ranks: int) -> None:
    out = launch(ranks, "window_ring", "numpy")
    assert out.count("window_ring numpy ok") == ranks


@requires_torch
@pytest.mark.parametrize("ranks", [2, 4])
def test_window_ring_torch(ranks: int) -> None:
    out = launch(ranks, "window_ring", "torch")
    assert out.count("window_ring torch ok") == ranks

"""torchcomms' window ring test, both window forms, numpy and torch, 2 and 4 ranks;
SEPARATE (transport) windows with 2 and 3 ranks."""

import pytest

from conftest import launch, requires_torch


@pytest.mark.parametrize("ranks", [2, 4])
def test_window_ring_numpy(ranks: int) -> None:
    out = launch(ranks, "window_ring", "numpy")
    assert out.count("window_ring numpy ok") == ranks


@pytest.mark.parametrize("ranks", [2, 3])
def test_window_ring_numpy_separate(ranks: int) -> None:
    out = launch(ranks, "window_ring", "numpy:separate")
    assert out.count("window_ring numpy:separate ok") == ranks


@requires_torch
@pytest.mark.parametrize("ranks", [2, 4])
def test_window_ring_torch(ranks: int) -> None:
    out = launch(ranks, "window_ring", "torch")
    assert out.count("window_ring torch ok") == ranks

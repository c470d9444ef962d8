"""Every collective from Python (torchcomms' conventions), numpy and torch, 2 and 4 ranks."""

import pytest

from conftest import launch, requires_torch


@pytest.mark.parametrize("ranks", [2, 4])
def test_collectives_numpy(ranks: int) -> None:
    out = launch(ranks, "collectives", "numpy")
    assert out.count("collectives numpy ok") == ranks


@requires_torch
@pytest.mark.parametrize("ranks", [2, 4])
def test_collectives_torch(ranks: int) -> None:
    out = launch(ranks, "collectives", "torch")
    assert out.count("collectives torch ok") == ranks

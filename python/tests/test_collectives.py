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


@requires_torch
def test_list_forms_for_cuda_tensors_composed_on_cpu() -> None:
    """The composition CUDA tensors' list and _v forms use on an rdma
    communicator (rmacomm._cuda_lists), checked on CPU torch tensors on 3
    ranks (the GPU suite runs it on CUDA tensors)."""
    out = launch(3, "cuda_lists", "")
    assert out.count("cuda_lists ok") == 3, out

"""Bootstrap through an explicit store: plain Python objects (with and
without add/check/delete_key), rmacomm.TcpStore and torch.distributed.TCPStore."""

import pytest

from conftest import launch, requires_torch


@pytest.mark.parametrize("variant", ["full", "minimal"])
def test_plain_python_object_as_the_store(variant: str, tmp_path) -> None:
    out = launch(2, "python_store", variant, env={"RMACOMM_TEST_STORE_DIR": str(tmp_path)})
    assert out.count(f"python_store {variant} ok") == 2


def test_rmacomm_tcp_store() -> None:
    out = launch(2, "tcp_store", "rmacomm")
    assert out.count("tcp_store rmacomm ok") == 2


@requires_torch
def test_torch_distributed_tcp_store() -> None:
    out = launch(2, "tcp_store", "torch")
    assert out.count("tcp_store torch ok") == 2

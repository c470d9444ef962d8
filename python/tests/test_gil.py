"""The GIL is released while a call blocks: another Python thread runs."""

from conftest import launch


def test_gil_is_released_during_blocking_waits() -> None:
    out = launch(2, "gil")
    assert "gil ok" in out
    for what in ("wait_signal", "all_reduce", "Work.wait"):
        assert f"gil {what}:" in out

"""The GIL is released while a call blocks: another Python thread runs."""

import pytest

from conftest import launch


def test_gil_is_released_during_blocking_waits() -> None:
    out = launch(2, "gil")
    assert "gil ok" in out
    for what in ("wait_signal", "all_reduce", "Work.wait"):
        assert f"gil {what}:" in out



# "plain": the soft provider's TCP link; with the peer stopped, nothing
# completes until it runs again, so the put waits in the call however fast
# the machine is. "mapped": the default link, which maps same-host peers'
# signals (the TCP link does not).
@pytest.mark.parametrize("case,env", [("plain", {"RMACOMM_SOFT_LINK": "tcp"}), ("mapped", {})])
def test_gil_is_released_during_an_async_put_that_waits(case: str, env: dict) -> None:
    out = launch(2, "gil_put", case, env=env)
    assert f"gil_put {case} ok" in out, out

"""Failures: a rank that dies makes the others raise within the timeout;
Ctrl-C interrupts a blocking wait."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import launch, launch_direct


def test_a_rank_killed_makes_the_others_raise_within_the_timeout() -> None:
    r0, r1 = launch_direct(2, "rank_dies", "kill")
    assert r1.returncode == -signal.SIGKILL, r1.stdout
    assert r0.returncode == 0, r0.stdout
    assert "wait_signal: PeerError" in r0.stdout and "all_reduce: PeerError" in r0.stdout, r0.stdout
    assert "rank_dies kill ok" in r0.stdout


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_rank_gone_or_silent_under_the_launcher(how: str) -> None:
    out = launch(2, "rank_dies", how, timeout=90)
    assert f"rank_dies {how} ok" in out, out
    err = "TimeoutError" if how == "hang" else "PeerError"
    assert f"wait_signal: {err}" in out and f"all_reduce: {err}" in out, out



TARGET = Path(os.environ.get("CARGO_TARGET_DIR", Path(__file__).resolve().parents[2] / "target"))
STANDIN = TARGET / "release" / "librmacomm_cuda_standin.so"


@pytest.mark.parametrize("how", ["ok", "exit", "fail", "drop"])
def test_new_comm_nccl_names_a_rank_that_died_or_failed_in_init(how: str) -> None:
    """new_comm("nccl") on the NCCL and CUDA stand-ins (no GPU needed):
    two ranks that join work; a rank that dies in NCCL's init, after the
    unique id's exchange, leaves the other not in NCCL forever but raising
    TimeoutError naming it; a rank whose init fails makes both raise
    UnavailableError naming it; a communicator whose NCCL finalize never
    completes is dropped within its timeout with the GIL released (another
    thread runs meanwhile)."""
    lib = STANDIN
    if not lib.exists():
        pytest.skip(f"the CUDA stand-in is not built ({lib}: cargo build --release -p rmacomm-cuda-standin)")
    env = {"RMACOMM_CUDA_LIB": str(lib), "RMACOMM_NCCL_LIB": str(lib)}
    if how == "exit":
        env["RMACOMM_STANDIN_NCCL_EXIT_AT_INIT"] = "1"
    if how == "fail":
        env["RMACOMM_STANDIN_NCCL_FAIL_INIT"] = "1"
    if how == "drop":
        env["RMACOMM_STANDIN_NCCL_FINALIZE_HANGS"] = "1"
    r0, r1 = launch_direct(2, "nccl_init", how, timeout=60, env=env)
    assert r0.returncode == 0 and f"nccl_init {how} ok" in r0.stdout, r0.stdout + r1.stdout
    if how == "exit":
        assert r1.returncode == 17, r1.stdout
    else:
        assert r1.returncode == 0 and f"nccl_init {how} ok" in r1.stdout, r1.stdout


def test_a_value_signal_queued_behind_others_keeps_its_own_timeout() -> None:
    out = launch(2, "queued_signal_timeout", env={"RMACOMM_SOFT_LINK": "tcp"}, timeout=120)
    assert out.count("queued_signal_timeout ok") == 2, out


def test_window_allocate_of_a_size_one_rank_cannot_have_and_of_zero() -> None:
    out = launch(2, "window_allocate_sizes", timeout=120)
    assert out.count("window_allocate_sizes ok") == 2, out


def test_split_after_an_async_collective() -> None:
    out = launch(2, "split_after_async", timeout=120)
    assert out.count("split_after_async ok") == 2, out


def test_a_per_call_timeout_bounds_put_get_and_signal() -> None:
    # Rank 1 is stopped (TCP link: nothing to it completes), so each call
    # must raise its own TimeoutError, well before the window's 10 s.
    out = launch(2, "op_timeout", env={"RMACOMM_SOFT_LINK": "tcp"}, timeout=120)
    assert out.count("op_timeout ok") == 2, out
    for op in ("put", "get", "signal"):
        assert f"{op}: TimeoutError after" in out, out

def test_ctrl_c_interrupts_a_put_get_or_signal_to_a_peer_that_cannot_complete_it() -> None:
    out = launch(2, "op_interrupt", env={"RMACOMM_SOFT_LINK": "tcp"}, timeout=180)
    assert out.count("op_interrupt ok") == 2, out
    for op in ("put", "get", "signal"):
        assert f"{op}: interrupted after" in out, out


def test_ctrl_c_interrupts_a_blocking_wait() -> None:
    # One rank waits for a signal nobody sends (timeout 60 s); SIGINT after
    # 0.5 s must raise KeyboardInterrupt within a wait slice.
    code = textwrap.dedent(
        """
        import os, signal, threading, time
        import numpy as np, rmacomm
        store = rmacomm.TcpStore("127.0.0.1", 0, 1, True)
        comm = rmacomm.new_comm(store=store, rank=0, world_size=1, timeout=60)
        win = comm.new_window()
        win.tensor_register(comm.empty(4, np.float32))
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            win.wait_signal(0)
        except KeyboardInterrupt:
            print(f"interrupted after {time.monotonic() - t0:.2f} s", flush=True)
        """
    )
    p = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    out = p.stdout.decode()
    assert p.returncode == 0, out
    took = float(out.split("interrupted after ")[1].split()[0])
    assert 0.4 < took < 2.0, out

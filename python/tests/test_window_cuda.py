"""The window ring on CUDA tensors, two processes on one GPU (CUDA IPC), and
the NCCL backend's collectives on one rank:
runs where torch sees a CUDA device (the GPU suite, `scripts/gpu_suite.sh`,
with RMACOMM_EXPECT_GPU=1, where a missing GPU fails); skips elsewhere,
saying why."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Optional

import pytest

from conftest import HERE, launch, torch_available


def _no_cuda() -> Optional[str]:
    """Why CUDA tensors cannot be had here; None when they can."""
    if not torch_available():
        return "torch is not installed"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver (libcuda.so.1) on this machine"
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    if subprocess.run([sys.executable, "-c", probe], check=False).returncode != 0:
        return "torch sees no CUDA device"
    return None


def _require_cuda(what: str) -> None:
    """Skips (saying why) where CUDA tensors cannot be had; fails instead
    under RMACOMM_EXPECT_GPU=1 (the GPU suite)."""
    why = _no_cuda()
    if why is not None:
        if os.environ.get("RMACOMM_EXPECT_GPU") == "1":
            pytest.fail(f"RMACOMM_EXPECT_GPU=1 but {why}")
        pytest.skip(f"{why}: {what} runs on a GPU machine (scripts/gpu_suite.sh)")


def test_window_ring_on_cuda_tensors() -> None:
    _require_cuda("the CUDA window ring")
    out = launch(2, "window_ring_cuda", "", timeout=600, script=HERE / "cuda_scenarios.py")
    assert out.count("window_ring_cuda ok") == 2


def test_window_ring_on_cuda_tensors_staged() -> None:
    _require_cuda("the staged CUDA window ring")
    out = launch(2, "window_ring_cuda_staged", "", timeout=600, script=HERE / "cuda_scenarios.py")
    assert out.count("window_ring_cuda_staged ok") == 2


def test_agent_on_cuda_tensors() -> None:
    _require_cuda("the transfer agent on CUDA tensors")
    out = launch(2, "agent_cuda", "", timeout=600, script=HERE / "cuda_scenarios.py")
    assert out.count("agent_cuda ok") == 2


def test_nccl_backend_collectives_on_one_gpu() -> None:
    _require_cuda("the NCCL backend")
    # One rank: NCCL refuses two ranks on one GPU ("Duplicate GPU detected").
    out = launch(1, "nccl_collectives", "", timeout=600, script=HERE / "cuda_scenarios.py")
    assert "nccl_collectives ok" in out


def test_native_collectives_on_cuda_tensors() -> None:
    _require_cuda("the native GPU collectives")
    out = launch(2, "native_collectives", "", timeout=600, script=HERE / "cuda_scenarios.py")
    assert out.count("native_collectives ok") == 2

"""Shared helpers: run a scenario of scenarios.py under the launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest

HERE = Path(__file__).resolve().parent
SCENARIOS = HERE / "scenarios.py"


def torch_available() -> bool:
    """Whether torch is installed (without importing it: that takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


requires_torch = pytest.mark.skipif(
    not torch_available(), reason="torch is not installed (pip install torch): the torch variant is skipped"
)


def launch(
    n: int,
    scenario: str,
    arg: str = "numpy",
    timeout: float = 240,
    env: Optional[dict] = None,
    expect_rc: int = 0,
    script: Path = SCENARIOS,
) -> str:
    """Runs `scenario` of `script` (scenarios.py) on `n` ranks; returns their
    output (stdout + stderr, each line prefixed with [rank]); fails the test
    on another exit code."""
    cmd: List[str] = [sys.executable, "-m", "rmacomm.run", "--nproc-per-node", str(n), str(script), scenario, arg]
    e = dict(os.environ)
    e.pop("MASTER_PORT", None)
    e.update(env or {})
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, env=e)
    except subprocess.TimeoutExpired as t:
        out = (t.stdout or b"").decode(errors="replace")
        pytest.fail(f"{scenario} {arg} on {n} ranks did not finish within {timeout} s:\n{out}")
    out = p.stdout.decode(errors="replace")
    if p.returncode != expect_rc:
        pytest.fail(f"{scenario} {arg} on {n} ranks exited with {p.returncode}:\n{out}")
    return out


def launch_direct(
    n: int, scenario: str, arg: str, timeout: float = 120, env: Optional[dict] = None
) -> List[subprocess.CompletedProcess]:
    """Runs `scenario` on `n` ranks started here with torchrun's variables
    (no launcher: a rank's death does not stop the others), `env` added to
    theirs."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(n):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        e.update(env or {})
        procs.append(subprocess.Popen([sys.executable, str(SCENARIOS), scenario, arg], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    done = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out.decode(errors="replace"), ""))
    return done

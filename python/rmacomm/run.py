"""One-host launcher with torchrun's variables: ``python -m rmacomm.run``.

::

    python -m rmacomm.run --nproc-per-node 4 prog.py ARGS...
    python -m rmacomm.run --nproc-per-node 2 -m pytest tests/
    rmacomm-run --nproc_per_node 2 --no-python ./native_prog ARGS...

Starts N ranks of the program on this host, each with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set (a free port unless given or already set), prefixes
every line each rank prints with ``[rank] `` on the same stream, and, when
a rank fails, stops the others (SIGTERM, then SIGKILL after
``--grace-period`` seconds) and exits with that rank's code (128 + signal
for a rank killed by a signal). SIGINT and SIGTERM are forwarded to the
ranks, and SIGKILL follows ``--grace-period`` seconds later to those still
running; a job so stopped whose ranks all exit with 0 exits with 128 + the
signal (as ``rmacomm-run``). Multi-host jobs use torchrun, mpirun or srun, whose variables
``rmacomm.new_comm`` reads too.

The Rust binary ``rmacomm-run`` (window/src/bin/rmacomm-run) does the same
for native programs; this module is its Python twin, so that
``pip install rmacomm`` brings a launcher.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, List, Optional, Sequence


def _free_port() -> int:
    """A port that binds now, below Linux's ephemeral range (32768-60999):
    a port from that range, once released here, may be handed to another
    process's outgoing connection before rank 0 binds it again."""
    import random

    for _ in range(200):
        port = random.randint(20000, 32767)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pump(src: IO[bytes], dst: IO[bytes], prefix: bytes, lock: threading.Lock) -> None:
    """Copies lines from a rank's pipe to our stream, each with its prefix."""
    partial = b""
    while True:
        chunk = src.read1(65536) if hasattr(src, "read1") else src.read(65536)  # type: ignore[attr-defined]
        if not chunk:
            break
        lines = (partial + chunk).split(b"\n")
        partial = lines.pop()
        if lines:
            out = b"".join(prefix + line + b"\n" for line in lines)
            with lock:
                dst.write(out)
                dst.flush()
    if partial:
        with lock:
            dst.write(prefix + partial + b"\n")
            dst.flush()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rmacomm.run",
        description="Run N ranks of a program on this host with torchrun's environment variables.",
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, required=True,
                   help="number of ranks to start")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   help="store address (default: $MASTER_ADDR, else 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   help="store port (default: $MASTER_PORT, else a free port)")
    p.add_argument("--grace-period", dest="grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the program as a module (python -m PROG)")
    p.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                   help="run the program directly instead of with this Python")
    p.add_argument("prog", help="the script (or module, or executable with --no-python)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def run(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the launcher with command-line `argv`; returns the exit code."""
    a = _parser().parse_args(argv)
    if a.nproc < 1:
        print("rmacomm.run: --nproc-per-node must be at least 1", file=sys.stderr)
        return 2
    addr = a.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    if a.master_port is not None:
        port = a.master_port
    elif os.environ.get("MASTER_PORT"):
        try:
            port = int(os.environ["MASTER_PORT"].strip())
        except ValueError:
            port = -1
        if not 1 <= port <= 65535:
            print(f"rmacomm.run: MASTER_PORT={os.environ['MASTER_PORT']!r} is not a port number (1-65535)",
                  file=sys.stderr)
            return 2
    else:
        port = _free_port()
    if not 1 <= port <= 65535:
        print(f"rmacomm.run: --master-port {port}: give a port number (1-65535), or none for a free one",
              file=sys.stderr)
        return 2
    if a.no_python:
        cmd: List[str] = [a.prog]
    elif a.module:
        cmd = [sys.executable, "-u", "-m", a.prog]
    else:
        cmd = [sys.executable, "-u", a.prog]
    cmd += a.args

    # Signals are only noted here; the loop below forwards them (a handler
    # that signalled or waited itself could run in the middle of the loop's
    # own kill and wait). Installed before the ranks start, so that one
    # while they start is forwarded too. SIGHUP and SIGQUIT (which the
    # ranks' own process groups do not get from the terminal) go on as
    # SIGTERM.
    received: List[int] = []

    def note(signum: int, _frame: object) -> None:
        received.append(signum)

    old = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    try:
        return _run(a, cmd, addr, port, received)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _run(a: argparse.Namespace, cmd: List[str], addr: str, port: int, received: List[int]) -> int:
    procs: List[subprocess.Popen] = []
    pumps: List[threading.Thread] = []
    locks = (threading.Lock(), threading.Lock())
    for r in range(a.nproc):
        env = dict(os.environ)
        # Inherited, these would move the ranks' store off the port given
        # (rmacomm's own port; torchrun's agent store on MASTER_PORT).
        env.pop("RMACOMM_MASTER_PORT", None)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        env.update(
            RANK=str(r), WORLD_SIZE=str(a.nproc), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(a.nproc),
            MASTER_ADDR=addr, MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
        )
        try:
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True)
        except OSError as e:
            print(f"rmacomm.run: cannot start {cmd[0]!r}: {e}", file=sys.stderr)
            _stop(procs, a.grace)
            return 127
        procs.append(p)
        prefix = f"[{r}] ".encode()
        for src, dst, lock in ((p.stdout, sys.stdout.buffer, locks[0]), (p.stderr, sys.stderr.buffer, locks[1])):
            t = threading.Thread(target=_pump, args=(src, dst, prefix, lock), daemon=True)
            t.start()
            pumps.append(t)

    failure: Optional[int] = None
    interrupted: Optional[int] = None
    kill_at: Optional[float] = None  # when the ranks still running get SIGKILL
    try:
        live = set(range(a.nproc))
        while live:
            while received:
                sig = received.pop(0)
                if interrupted is None:
                    interrupted = sig
                    print(f"rmacomm.run: stopped by signal {sig}, forwarded to the ranks", file=sys.stderr,
                          flush=True)
                fwd = sig if sig in (signal.SIGINT, signal.SIGTERM) else signal.SIGTERM
                _signal([procs[r] for r in sorted(live)], fwd)
                if kill_at is None:
                    kill_at = time.monotonic() + a.grace
            for r in sorted(live):
                rc = procs[r].poll()
                if rc is None:
                    continue
                live.discard(r)
                # What the rank started and left running stops with it.
                try:
                    os.killpg(procs[r].pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
                if rc != 0 and failure is None:
                    failure = _exit_code(rc)
                    how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
                    if live:
                        print(f"rmacomm.run: rank {r} {how}; stopping the other ranks", file=sys.stderr,
                              flush=True)
                        _signal([procs[i] for i in sorted(live)], signal.SIGTERM)
                        if kill_at is None:
                            kill_at = time.monotonic() + a.grace
                    else:
                        print(f"rmacomm.run: rank {r} {how}", file=sys.stderr, flush=True)
            if live and kill_at is not None and time.monotonic() >= kill_at:
                kill_at = None
                _signal([procs[r] for r in sorted(live)], signal.SIGKILL)
            time.sleep(0.01)
    finally:
        for t in pumps:
            t.join(timeout=5)
    if failure is not None:
        return failure
    return 128 + interrupted if interrupted is not None else 0


def _signal(procs: Sequence[subprocess.Popen], sig: int) -> None:
    """`sig` to the process group of each process still running."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def _stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM to each process group, SIGKILL to those left after `grace`."""
    _signal(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def main() -> None:
    """Console entry point (`rmacomm-run`)."""
    sys.exit(run())


if __name__ == "__main__":
    main()

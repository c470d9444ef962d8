"""python -m rmacomm.run: variables, prefixes, failure handling."""

import subprocess
import sys
import time


def run(n: int, code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`code` on `n` ranks (torchrun's underscore spelling of the option)."""
    cmd = [sys.executable, "-m", "rmacomm.run", "--nproc_per_node", str(n), *args,
           "--no-python", sys.executable, "-c", code]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)


def test_sets_torchrun_variables_and_prefixes_lines() -> None:
    p = run(3, "import os; print(*(os.environ[k] for k in ('RANK','WORLD_SIZE','LOCAL_RANK','LOCAL_WORLD_SIZE',"
               "'MASTER_ADDR','MASTER_PORT')))")
    assert p.returncode == 0, p.stderr
    lines = sorted(p.stdout.decode().splitlines())
    assert len(lines) == 3
    ports = set()
    for r, line in enumerate(lines):
        prefix, rank, size, lrank, lsize, addr, port = line.split()
        assert (prefix, rank, size, lrank, lsize, addr) == (f"[{r}]", str(r), "3", str(r), "3", "127.0.0.1")
        ports.add(port)
    assert len(ports) == 1 and int(ports.pop()) > 0


def test_a_failing_rank_stops_the_others_and_sets_the_exit_code() -> None:
    t0 = time.monotonic()
    p = run(3, "import os, sys, time; r = int(os.environ['RANK'])\n"
               "if r == 1: print('bye', file=sys.stderr); sys.exit(3)\n"
               "time.sleep(60)", "--grace-period", "1")
    took = time.monotonic() - t0
    assert p.returncode == 3, p.stderr
    assert b"[1] bye" in p.stderr
    assert b"rank 1 exited with code 3; stopping the other ranks" in p.stderr
    assert took < 20, took


def test_a_rank_killed_by_a_signal_gives_128_plus_signal() -> None:
    p = run(2, "import os, signal, time\nif os.environ['RANK'] == '0': os.kill(os.getpid(), signal.SIGKILL)\n"
               "time.sleep(60)", "--grace-period", "1")
    assert p.returncode == 128 + 9, p.stderr


def test_module_mode_and_script_arguments() -> None:
    p = subprocess.run([sys.executable, "-m", "rmacomm.run", "--nproc-per-node", "2", "-m", "json.tool", "--help"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode().count("usage:") == 2


def test_under_torchrun_beside_its_agent_store() -> None:
    """torchrun itself (its default static rendezvous): its agent serves
    torch's own TCPStore on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True),
    so rmacomm's store takes the next port; rank 0 used to fail binding
    MASTER_PORT (EADDRINUSE)."""
    import importlib.util
    import os
    import socket
    import tempfile

    import pytest

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: torchrun is torch's")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import numpy as np, rmacomm\n"
        "comm = rmacomm.new_comm('rdma', timeout=60)\n"
        "x = np.ones(4, np.float32)\n"
        "comm.all_reduce(x, rmacomm.ReduceOp.SUM)\n"
        "assert (x == comm.get_size()).all(), x\n"
        "import sys; sys.stdout.write(f'ok{comm.get_rank()}\\n'); sys.stdout.flush()\n"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port), f.name]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120, env=env)
    finally:
        os.unlink(f.name)
    out = p.stdout.decode()
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    assert sorted(out.split()) == ["ok0", "ok1"], out


def _interrupt(code: str, sig: int, grace: str) -> "tuple[int, float, bytes]":
    """Starts `code` on 2 ranks, sends `sig` to the launcher once both ranks
    printed 'ready', and returns its exit code, how long it took from the
    signal, and its stderr."""
    cmd = [sys.executable, "-m", "rmacomm.run", "--nproc-per-node", "2", "--grace-period", grace,
           "--no-python", sys.executable, "-c", code]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = 0
        assert p.stdout is not None
        while seen < 2:
            line = p.stdout.readline()
            assert line, "the launcher ended before both ranks were ready"
            seen += line.endswith(b"ready\n")
        t0 = time.monotonic()
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
        return p.returncode, time.monotonic() - t0, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_rank_that_ignores_a_forwarded_signal_is_killed_after_the_grace_period() -> None:
    """The launcher's SIGTERM reaches ranks that ignore it: SIGKILL follows
    after --grace-period (it used to wait for them forever)."""
    import signal

    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)")
    rc, took, err = _interrupt(code, signal.SIGTERM, "1")
    assert rc == 128 + 9, err
    assert b"stopped by signal 15" in err, err
    assert took < 30, took


def test_an_interrupted_job_whose_ranks_exit_cleanly_gives_128_plus_signal() -> None:
    import signal

    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGINT, lambda *_: sys.exit(0))\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)")
    rc, took, err = _interrupt(code, signal.SIGINT, "30")
    assert rc == 128 + 2, err
    assert took < 20, took


def test_sighup_to_the_launcher_stops_the_ranks_as_sigterm() -> None:
    import signal

    rc, took, err = _interrupt("import time; print('ready', flush=True); time.sleep(120)", signal.SIGHUP, "5")
    assert rc == 128 + 15, err  # the ranks die of the SIGTERM it is forwarded as
    assert took < 20, took


def test_what_a_finished_rank_left_running_is_stopped_with_it() -> None:
    import os

    code = ("import subprocess, sys\n"
            "p = subprocess.Popen(['sleep', '60'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            "print('helper', p.pid, flush=True)")
    p = run(2, code)
    assert p.returncode == 0, p.stderr
    pids = [int(line.split()[-1]) for line in p.stdout.decode().splitlines() if "helper" in line]
    assert len(pids) == 2, p.stdout
    end = time.monotonic() + 5
    while time.monotonic() < end and any(_alive(pid) for pid in pids):
        time.sleep(0.02)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"helpers {left} outlived their ranks"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def test_inherited_port_variables_do_not_move_the_ranks_store_and_port_0_is_refused() -> None:
    import os

    env = dict(os.environ, RMACOMM_MASTER_PORT="1", TORCHELASTIC_USE_AGENT_STORE="True")
    code = ("import os; print('[%s|%s|%s]' % (os.environ.get('RMACOMM_MASTER_PORT', ''), "
            "os.environ.get('TORCHELASTIC_USE_AGENT_STORE', ''), os.environ['MASTER_PORT']))")
    cmd = [sys.executable, "-m", "rmacomm.run", "--nproc-per-node", "1", "--master-port", "4567",
           "--no-python", sys.executable, "-c", code]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60, env=env)
    assert p.stdout.decode() == "[0] [||4567]\n", p.stderr
    for extra, menv in ((["--master-port", "0"], {}), ([], {"MASTER_PORT": "0"})):
        cmd = [sys.executable, "-m", "rmacomm.run", "--nproc-per-node", "1", *extra, "--no-python", "true"]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60,
                           env=dict(os.environ, **menv))
        assert p.returncode == 2 and b"port number" in p.stderr, (extra, menv, p.stderr)

"""The hand-written stubs match the module (mypy.stubtest), and help() reads well."""

import inspect
import subprocess
import sys
from pathlib import Path

import rmacomm


def test_stubtest() -> None:
    allow = Path(__file__).with_name("stubtest_allowlist.txt")
    p = subprocess.run([sys.executable, "-m", "mypy.stubtest", "rmacomm", "--allowlist", str(allow)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    assert p.returncode == 0, p.stdout.decode()


def test_everything_public_has_a_docstring() -> None:
    missing = []
    for name in rmacomm.__all__:
        obj = getattr(rmacomm, name)
        if name.startswith("__"):
            continue
        if not (obj.__doc__ or "").strip():
            missing.append(name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for m, v in vars(obj).items():
                if not m.startswith("_") and callable(v) and not (getattr(v, "__doc__", "") or "").strip():
                    missing.append(f"{name}.{m}")
    assert not missing, missing
    text = __import__("pydoc").render_doc(rmacomm)
    for word in ("new_comm", "all_reduce", "map_remote_tensor", "window_allocate", "RdmaTransport"):
        assert word in text

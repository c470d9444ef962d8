#!/usr/bin/env bash
# Runs one command of the GPU suite and, if it is still running after
# DUMP_AT seconds, takes every thread's stack of the processes named NAME
# (gdb, carried in the suite's gdb/ folder by `gpu_suite.sh build`; without
# it, each thread's kernel wait from /proc), then stops it. What hangs on a
# GPU (a stream waiting for a host thread that waits inside the driver:
# docs/gpu.md) shows where; the device machines have no gdb.
#
#   bash target/gpu-suite/gpu_stacks.sh DUMP_AT LIMIT NAME command...
#
# e.g., the native collectives in transport mode, stacks after 25 s:
#   RMACOMM_GPU_TRANSPORT=1 bash target/gpu-suite/gpu_stacks.sh 25 90 python3 \
#     python3 -m rmacomm.run --nproc-per-node 2 target/gpu-suite/python/cuda_scenarios.py native_collectives
#
# The command runs with the suite's environment (NVRTC and NCCL from the
# machine's PyTorch wheels, RMACOMM_EXPECT_GPU=1, the carried wheel first on
# PYTHONPATH). Output: $OUT (or /tmp/gpu-stacks)/NAME.log and stacks.txt.
set -uo pipefail
suite=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 4 ] || { sed -n 2,17p "$0"; exit 2; }
at=$1 lim=$2 name=$3
shift 3
out=${OUT:-/tmp/gpu-stacks}
mkdir -p "$out"
if [ -z "${RMACOMM_CUDA_LIB_DIRS:-}" ]; then
  RMACOMM_CUDA_LIB_DIRS=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
print(":".join(d for r in roots for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib")))))
PY
)
fi
export RMACOMM_CUDA_LIB_DIRS RMACOMM_EXPECT_GPU=1 RMACOMM_EXPECT_NVRTC=1
if compgen -G "$suite/wheels/*.whl" >/dev/null; then
  pydir=$(mktemp -d)/site
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-deps --no-index --target "$pydir" "$suite"/wheels/*.whl
  export PYTHONPATH="$pydir${PYTHONPATH:+:$PYTHONPATH}"
fi
stacks() {
  local pid t
  for pid in $(pgrep -x "$name"); do
    echo "=== pid $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline" | cut -c1-200)"
    if [ -x "$suite/gdb/gdb" ]; then
      timeout 60 env LD_LIBRARY_PATH="$suite/gdb" "$suite/gdb/gdb" -p "$pid" -batch \
        -ex "set pagination off" -ex "thread apply all bt 30" 2>&1 | grep -v '^\[New LWP' | cut -c1-240
    else
      for t in /proc/"$pid"/task/*; do
        echo "-- $(cat "$t/comm") wchan=$(cat "$t/wchan") syscall=$(cat "$t/syscall")"
        head -8 "$t/stack" 2>/dev/null
      done
    fi
  done
}
timeout "$lim" "$@" >"$out/$name.log" 2>&1 &
pid=$!
t=0
while kill -0 "$pid" 2>/dev/null && [ "$t" -lt "$at" ]; do
  sleep 1
  t=$((t + 1))
done
if kill -0 "$pid" 2>/dev/null; then
  stacks >"$out/stacks.txt" 2>&1
  echo "# still running after ${at}s: stacks in $out/stacks.txt; stopping it"
  pkill -x "$name"
fi
wait "$pid"
rc=$?
echo "# rc $rc (output in $out/$name.log)"
exit $rc

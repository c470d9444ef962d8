#!/usr/bin/env bash
# The GPU suite (issue 13): the CUDA kernels against the CPU kernels on a
# real device, the GPU libraries' probes, the copy-engine ceiling,
# windows on device memory between two processes (CUDA IPC: the ring with
# host- and stream-ordered signals, a graph replay, put bandwidth), and the
# transport on device memory (rdma_bench --use-cuda, data verified).
#
#   bash scripts/gpu_suite.sh          build, then run (a machine with Rust and a GPU)
#   bash scripts/gpu_suite.sh build    build into target/gpu-suite (no GPU needed)
#   bash scripts/gpu_suite.sh run      run what target/gpu-suite holds (no Rust needed:
#                                      carry target/gpu-suite to the GPU machine)
#   bash scripts/gpu_suite.sh run rust     every stage but the Python ones
#   bash scripts/gpu_suite.sh run python   the Python stages alone (torch, the wheel)
#
# RMACOMM_SUITE_STAGE_SCALE (a number, fractions too) multiplies every
# stage's time limit.
#
# Running, a missing GPU, NVRTC or NCCL fails the suite instead of skipping
# (RMACOMM_EXPECT_GPU / _NVRTC / _NCCL). NVRTC and NCCL are found where
# PyTorch's CUDA wheels put them (the python3 on PATH is asked), or through
# RMACOMM_NVRTC_LIB / RMACOMM_NCCL_LIB / RMACOMM_CUDA_LIB_DIRS. Results go to
# $OUT when it is set (the device tool's output folder), else to
# target/gpu-suite/results.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ -d "$here/bin" ]; then
  suite=$here # a carried suite: the script sits beside its bin/
else
  cd "$here/.."
  suite=target/gpu-suite
fi
what=${1:-all}

build() {
  rm -rf "$suite" && mkdir -p "$suite/bin"
  cargo build --release -q -p rmacomm-cuda --example copy_ceiling
  cargo build --release -q -p rmacomm-window --bin rmacomm-run --bin gpu-window-scenario
  cargo build --release -q -p rmacomm-bench --bin rdma_bench
  cargo build --release -q -p rmacomm-collectives --bin coll-scenario
  cp target/release/examples/copy_ceiling target/release/rmacomm-run target/release/gpu-window-scenario \
    target/release/rdma_bench target/release/coll-scenario "$suite/bin/"
  cargo test --release --no-run -q -p rmacomm-cuda -p rmacomm-kernels --message-format=json 2>/dev/null |
    python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    exe = m.get("executable")
    if m.get("reason") == "compiler-artifact" and exe and m["target"]["name"] in ("probes", "cuda_kernels", "vmm", "devices"):
        shutil.copy(exe, sys.argv[1] + "/bin/" + m["target"]["name"])
' "$suite"
  for b in "$suite"/bin/*; do strip --strip-debug "$b" 2>/dev/null || true; done
  # The Python package (an abi3 wheel: any Python >= 3.9) and the CUDA
  # scenarios, which need only rmacomm and torch.
  local maturin
  maturin=$(command -v maturin || echo target/python-venv/bin/maturin)
  if [ -x "$maturin" ]; then
    "$maturin" build --release -q -m python/Cargo.toml -o "$suite/wheels" >/dev/null
    mkdir -p "$suite/python" && cp python/tests/cuda_scenarios.py "$suite/python/"
  else
    echo "# no maturin (pip install maturin): the suite carries no Python wheel"
  fi
  cp scripts/gpu_suite.sh scripts/gpu_stacks.sh scripts/gpu_summary.py "$suite/"
  # A gdb for gpu_stacks.sh (the device machines have none): Debian's
  # gdb-minimal with the libraries it links directly beyond the C and C++
  # runtimes (theirs in turn are common; 2026-11-27's H200 had them).
  local tmp
  tmp=$(mktemp -d)
  if (cd "$tmp" && apt-get download -q gdb-minimal >/dev/null 2>&1) && dpkg-deb -x "$tmp"/gdb-minimal_*.deb "$tmp/x"; then
    mkdir -p "$suite/gdb" && cp "$tmp/x/usr/bin/gdb" "$suite/gdb/"
    local needed
    needed=$(readelf -d "$tmp/x/usr/bin/gdb" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' |
      grep -vE '^lib(c|m|pthread|dl|rt|gcc_s|stdc\+\+)\.so')
    ldd "$tmp/x/usr/bin/gdb" | awk '$3 ~ /^\// {print $1, $3}' | while read -r lib path; do
      if grep -qx "$lib" <<<"$needed"; then cp -L "$path" "$suite/gdb/"; fi
    done
  else
    echo "# no gdb-minimal package to carry: gpu_stacks.sh falls back to /proc's kernel stacks"
  fi
  rm -rf "$tmp"
  ls -la "$suite/bin" "$suite/wheels" 2>/dev/null
}

run() {
  # all, or one part: rust (every stage but Python's), python (the Python
  # stages alone: run them as a command of their own where a device
  # session allows a few minutes per command).
  local part=${1:-all}
  case $part in all | rust | python) ;; *) echo "usage: $0 run [rust|python]" >&2; return 2 ;; esac
  local bin=$suite/bin
  local out=${OUT:-$suite/results}
  mkdir -p "$out"
  if [ -z "${RMACOMM_CUDA_LIB_DIRS:-}" ] && command -v python3 >/dev/null; then
    RMACOMM_CUDA_LIB_DIRS=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()]
print(":".join(d for r in roots for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib")))))
PY
)
    export RMACOMM_CUDA_LIB_DIRS
  fi
  export RMACOMM_EXPECT_GPU=1 RMACOMM_EXPECT_NVRTC=1 RMACOMM_EXPECT_NCCL=1
  # Every stage has a time limit (RMACOMM_SUITE_STAGE_SCALE multiplies
  # them), so one hang costs that stage, not the device session.
  local scale=${RMACOMM_SUITE_STAGE_SCALE:-1}
  if ! awk -v s="$scale" 'BEGIN { exit !(s + 0 > 0) }'; then
    echo "RMACOMM_SUITE_STAGE_SCALE must be a positive number, not '$scale'" >&2
    return 2
  fi
  lim() { awk -v a="$1" -v s="$scale" 'BEGIN { v = int(a * s); print (v < 1 ? 1 : v) }'; }
  # A stage's command under its limit; a failure says so in the stage's log
  # (a command that timeout kills prints nothing of its own), for
  # scripts/gpu_summary.py to find.
  stage() {
    local r=0
    timeout "$@" || r=$?
    if [ "$r" -ne 0 ]; then
      if [ "$r" -eq 124 ]; then echo "# FAILED: exit $r (timed out)"; else echo "# FAILED: exit $r"; fi
    fi
    return "$r"
  }
  { nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
    echo "cores: $(nproc)"
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' 2>&1 | tail -1 || true
    echo "RMACOMM_CUDA_LIB_DIRS=$RMACOMM_CUDA_LIB_DIRS"; } | tee "$out/machine.txt"
  local rc=0
  if [ "$part" != python ]; then
    # vmm: cuMem/VMM memory exported as descriptors and mapped again (the
    # real driver's side of what the stand-in tests in CI); devices: several
    # GPUs (the current device kept, UUIDs, streams of another GPU refused,
    # peer access; skipped, saying so, with one GPU).
    for t in probes cuda_kernels vmm devices; do
      echo "# $t (at ${SECONDS}s)"
      stage "$(lim 150)" "$bin/$t" --nocapture --test-threads 1 2>&1 | tee "$out/$t.log" || rc=1
    done
    echo "# copy_ceiling (at ${SECONDS}s)"
    stage "$(lim 60)" "$bin/copy_ceiling" --json 2>&1 | tee "$out/copy_ceiling.jsonl" || rc=1
    # The per-call cost of the staged copies the soft provider's engine makes
    # for device memory (the transport moved 1 MiB fragments at ~50 us each
    # on 2026-11-27: how much of that is the copies?).
    echo "# copy_ceiling --staging (at ${SECONDS}s)"
    stage "$(lim 60)" "$bin/copy_ceiling" --staging --json 2>&1 | tee "$out/staging_copies.jsonl" || rc=1
    # Windows on device memory: two processes on one GPU through CUDA IPC.
    for sc in ring bw lat proxy; do
      echo "# window on device memory: $sc (at ${SECONDS}s)"
      stage "$(lim 90)" "$bin/rmacomm-run" --nproc-per-node 2 "$bin/gpu-window-scenario" $sc 2>&1 |
        tee "$out/window_device_$sc.log" || rc=1
    done
    # The same ring on cuMem/VMM memory in 2 MiB mappings (as PyTorch's
    # expandable segments): peers map it through its mappings' descriptors.
    echo "# window on VMM device memory: ring (at ${SECONDS}s)"
    GPU_WINDOW_ALLOC=vmm stage "$(lim 90)" "$bin/rmacomm-run" --nproc-per-node 2 "$bin/gpu-window-scenario" ring 2>&1 |
      tee "$out/window_device_ring_vmm.log" || rc=1
    # The native collectives (IPC mode) with a rank that dies while its
    # peer's all_reduce waits for it on the stream: the watchdog releases the
    # stream and the next call fails naming the rank. On a GPU this also
    # shows what the released kernels meet in a dead process's IPC memory
    # (still mapped, or a fault: CUDA does not document it).
    echo "# native collectives: a rank that dies (coll-scenario gpu_killed, at ${SECONDS}s)"
    stage "$(lim 60)" "$bin/rmacomm-run" --nproc-per-node 2 "$bin/coll-scenario" gpu_killed 2>&1 |
      tee "$out/native_gpu_killed.log" || rc=1
    # The same while the others replay a captured all_reduce (kernel waits
    # no host call issued, watched through their want words), and ranks
    # that leave normally while others replay (no release may follow).
    stage "$(lim 60)" "$bin/rmacomm-run" --nproc-per-node 3 "$bin/coll-scenario" gpu_killed_replay 2>&1 |
      tee "$out/native_gpu_killed_replay.log" || rc=1
    stage "$(lim 60)" "$bin/rmacomm-run" --nproc-per-node 3 "$bin/coll-scenario" gpu_replay_teardown 2>&1 |
      tee "$out/native_gpu_replay_teardown.log" || rc=1
    # A device window's replayed wait for a rank that stops replaying
    # (released after the 2 s timeout) and for one that dies.
    stage "$(lim 60)" "$bin/rmacomm-run" --nproc-per-node 2 "$bin/gpu-window-scenario" dead_replay 2>&1 |
      tee "$out/window_dead_replay.log" || rc=1
    # NCCL's own window API (2.29+: ncclPutSignal, ncclSignal,
    # ncclWaitSignal) through NcclRma, one rank (NCCL refuses two on one GPU):
    # the ring on the rank itself; a library older than 2.29 is refused,
    # naming its version (the rank prints "refused: ...").
    echo "# NCCL windows: gpu-window-scenario nccl, one rank (at ${SECONDS}s)"
    stage "$(lim 60)" "$bin/rmacomm-run" --nproc-per-node 1 "$bin/gpu-window-scenario" nccl 2>&1 |
      tee "$out/window_nccl.log" || rc=1
    grep -h '"window_device_put"' "$out/window_device_bw.log" | sed 's/^\[[0-9]*\] //' > "$out/window_device_bw.jsonl" || true
    grep -h '"window_device_signal_rtt"' "$out/window_device_lat.log" | sed 's/^\[[0-9]*\] //' > "$out/window_device_lat.jsonl" || true
    grep -h '"window_proxy_' "$out/window_device_proxy.log" | sed 's/^\[[0-9]*\] //' > "$out/window_proxy.jsonl" || true
    # The transport on device memory (soft provider: staged through pinned
    # chunks), two processes, data verified after every size; beside it the
    # same runs on host memory over the same link (tcp: the staged path's
    # host counterpart).
    # Same host over shared memory: the client opens the server's device
    # memory through CUDA IPC and copies device to device.
    for op in write read; do
      echo "# transport on device memory, same host (CUDA IPC): rdma_bench $op --use-cuda 0 (at ${SECONDS}s)"
      stage "$(lim 120)" "$bin/rdma_bench" $op -a --min 4K --max 64M --use-cuda 0 --provider soft --link auto \
        --out-json "$out/transport_cuda_ipc_$op.jsonl" 2>&1 | tee "$out/transport_cuda_ipc_$op.log" || rc=1
    done
    # The same with 16 MiB fragments. On 2026-11-27's H200 the soft provider
    # synchronized a stream per fragment (~50 us each: 1 MiB fragments held
    # device to device at ~20 GB/s); since then the engine queues the copies
    # of consecutive WRs, merges contiguous ones and waits once per run
    # (ibverbx soft requester, device_batch): compare both with
    # copy_ceiling.jsonl's cuMemcpyDtoD.
    echo "# transport on device memory, same host (CUDA IPC), 16 MiB fragments (at ${SECONDS}s)"
    stage "$(lim 120)" "$bin/rdma_bench" write -a --min 1M --max 64M --use-cuda 0 --provider soft --link auto --frag-size 16M \
      --out-json "$out/transport_cuda_ipc_write_frag16M.jsonl" 2>&1 | tee "$out/transport_cuda_ipc_write_frag16M.log" || rc=1
    for op in write read; do
      echo "# transport on device memory: rdma_bench $op --use-cuda 0 (at ${SECONDS}s)"
      stage "$(lim 120)" "$bin/rdma_bench" $op -a --min 4K --max 64M --use-cuda 0 --provider soft --link tcp \
        --out-json "$out/transport_cuda_$op.jsonl" 2>&1 | tee "$out/transport_cuda_$op.log" || rc=1
      stage "$(lim 120)" "$bin/rdma_bench" $op -a --min 4K --max 64M --provider soft --link tcp \
        --out-json "$out/transport_host_$op.jsonl" 2>&1 | tee "$out/transport_host_$op.log" || rc=1
    done
  fi
  if [ "$part" != rust ]; then
    # Python: the window ring on CUDA torch tensors, two processes.
    if [ -d "$suite/wheels" ] && python3 -c 'import torch' 2>/dev/null; then
      # The wheel into a directory of its own (no venv module or network
      # needed), first on PYTHONPATH; torch is the machine's.
      local pydir py
      pydir=$(mktemp -d)/site
      python3 -m pip install -q --no-deps --no-index --target "$pydir" "$suite"/wheels/*.whl
      export PYTHONPATH="$pydir${PYTHONPATH:+:$PYTHONPATH}"
      py=python3
      echo "# python: window ring on CUDA tensors (at ${SECONDS}s)"
      stage "$(lim 90)" "$py" -m rmacomm.run --nproc-per-node 2 "$suite/python/cuda_scenarios.py" window_ring_cuda 2>&1 |
        tee "$out/python_window_ring_cuda.log" || rc=1
      # The same ring with PyTorch's expandable segments (cuMem/VMM memory:
      # no CUDA IPC handle; peers map it through descriptors).
      echo "# python: window ring on CUDA tensors from expandable segments (at ${SECONDS}s)"
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True stage "$(lim 90)" "$py" -m rmacomm.run --nproc-per-node 2 \
        "$suite/python/cuda_scenarios.py" window_ring_cuda 2>&1 | tee "$out/python_window_ring_cuda_expandable.log" || rc=1
      # The same ring through the transport (unified=False: what a peer on
      # another host gets), staged through pinned chunks.
      echo "# python: window ring on CUDA tensors, staged through the transport (at ${SECONDS}s)"
      stage "$(lim 90)" "$py" -m rmacomm.run --nproc-per-node 2 "$suite/python/cuda_scenarios.py" window_ring_cuda_staged 2>&1 |
        tee "$out/python_window_ring_cuda_staged.log" || rc=1
      # The transfer agent on CUDA tensors (KV blocks, two processes, IPC).
      echo "# python: transfer agent on CUDA tensors (at ${SECONDS}s)"
      stage "$(lim 90)" "$py" -m rmacomm.run --nproc-per-node 2 "$suite/python/cuda_scenarios.py" agent_cuda 2>&1 |
        tee "$out/python_agent_cuda.log" || rc=1
      # The native backend's collectives on CUDA tensors (two processes, IPC),
      # checked, then all_reduce's bandwidth.
      echo "# python: native collectives on CUDA tensors (at ${SECONDS}s)"
      stage "$(lim 150)" "$py" -m rmacomm.run --nproc-per-node 2 "$suite/python/cuda_scenarios.py" native_collectives bench 2>&1 |
        tee "$out/python_native_collectives.log" || rc=1
      grep -h '"native_all_reduce"' "$out/python_native_collectives.log" | sed 's/^\[[0-9]*\] //' > "$out/native_all_reduce.jsonl" || true
      # The same with the signals in device memory (the flag area after the
      # slots; no watchdog release) instead of registered host memory.
      echo "# python: native collectives, RMACOMM_GPU_FLAGS=device (at ${SECONDS}s)"
      RMACOMM_GPU_FLAGS=device stage "$(lim 150)" "$py" -m rmacomm.run --nproc-per-node 2 "$suite/python/cuda_scenarios.py" native_collectives bench 2>&1 |
        tee "$out/python_native_collectives_deviceflags.log" || rc=1
      grep -h '"native_all_reduce"' "$out/python_native_collectives_deviceflags.log" | sed 's/^\[[0-9]*\] //' > "$out/native_all_reduce_deviceflags.jsonl" || true
      # The same in transport mode (what ranks on different hosts get: data
      # put through the windows' stream proxies), between the two processes:
      # on the soft provider the slots are host memory the device maps, so the
      # engines make no CUDA call (docs/gpu.md, "Known problem"), and CUDA's
      # default (lazy) module loading must not hang it...
      echo "# python: native collectives, RMACOMM_GPU_TRANSPORT=1 (host slots), CUDA's default module loading (at ${SECONDS}s)"
      RMACOMM_GPU_TRANSPORT=1 stage "$(lim 150)" "$py" -m rmacomm.run --nproc-per-node 2 "$suite/python/cuda_scenarios.py" native_collectives bench 2>&1 |
        tee "$out/python_native_collectives_transport.log" || rc=1
      grep -h '"native_all_reduce"' "$out/python_native_collectives_transport.log" | sed 's/^\[[0-9]*\] //' > "$out/native_all_reduce_transport.jsonl" || true
      # ... and with device slots (what a verbs HCA gets; on the soft provider
      # its engine copies them through the driver, which hung on 2026-11-27
      # under lazy loading), with CUDA's modules loaded eagerly (the
      # workaround; a shorter limit: a hang lasts until the window's timeout).
      echo "# python: native collectives, RMACOMM_GPU_TRANSPORT=1 RMACOMM_GPU_SLOTS=device, CUDA_MODULE_LOADING=EAGER (at ${SECONDS}s)"
      CUDA_MODULE_LOADING=EAGER RMACOMM_GPU_SLOTS=device RMACOMM_GPU_TRANSPORT=1 stage "$(lim 90)" "$py" -m rmacomm.run --nproc-per-node 2 "$suite/python/cuda_scenarios.py" native_collectives 2>&1 |
        tee "$out/python_native_collectives_transport_device_slots.log" || rc=1
      # The NCCL backend: one rank (NCCL refuses two ranks on one GPU).
      echo "# python: the nccl backend's collectives, then all_reduce's bandwidth (at ${SECONDS}s)"
      stage "$(lim 90)" "$py" -m rmacomm.run --nproc-per-node 1 "$suite/python/cuda_scenarios.py" nccl_collectives bench 2>&1 |
        tee "$out/python_nccl_collectives.log" || rc=1
      grep -h '"nccl_all_reduce"' "$out/python_nccl_collectives.log" | sed 's/^\[[0-9]*\] //' > "$out/nccl_all_reduce.jsonl" || true
    else
      echo "# python: FAILED: no wheel in the suite or no torch on this machine (at ${SECONDS}s)" | tee "$out/python_window_ring_cuda.log"
      rc=1
    fi
  fi
  echo "# done at ${SECONDS}s, rc $rc"
  # The figures beside the same run's copy ceiling, and the failed stages.
  PYTHONIOENCODING=utf-8 python3 "$suite/gpu_summary.py" "$out" > "$out/summary.md" 2>&1 || true
  return $rc
}

case $what in
  build) build ;;
  run) run "${2:-all}" ;;
  all) build && run ;;
  *) echo "usage: $0 [build | run [rust|python]]" >&2; exit 2 ;;
esac

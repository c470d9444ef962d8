#!/usr/bin/env bash
# Installs what the tests need (Debian packages when run as root) and runs
# every test, the feature builds and the benchmark builds. `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  pkgs=(iproute2 libibverbs-dev librdmacm-dev libhwloc-dev libudev-dev libclang-dev pkg-config)
  missing=()
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "# installing ${missing[*]}"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}") >/dev/null
  fi
else
  echo "# not root (or no apt-get): not installing system packages; feature builds that need them may be skipped"
fi

if ! command -v cargo-nextest >/dev/null 2>&1; then
  cargo install --locked cargo-nextest
fi

# --- feature builds (verbs bindings, hwloc): added by the verbs provider work ---
# The verbs provider's FFI layouts against rdma-sys (bindgen) and the hwloc
# topology code: both need the -dev packages above, so they run only where
# those are installed (always, when this script runs as root on Debian).
if pkg-config --exists libibverbs librdmacm hwloc 2>/dev/null; then
  cargo test -p ibverbx --release --features rdma-sys,hwloc --test verbs_layout --test verbs_provider
  cargo test -p ibverbx --release --features rdma-sys,hwloc --lib verbs::
else
  echo "# skipped the rdma-sys/hwloc feature builds: libibverbs-dev, librdmacm-dev or libhwloc-dev is missing"
fi

# Lints: clippy with warnings as errors (the workspace's
# undocumented_unsafe_blocks and the clippy.toml disallowed methods included).
if cargo clippy --version >/dev/null 2>&1; then
  cargo clippy --workspace --all-targets --release -- -D warnings
else
  echo "# skipped clippy: the toolchain has no clippy component (rustup component add clippy)"
fi

# A minute of coverage-guided fuzzing of the soft provider's frame and hello
# decoders (cargo-fuzz; libFuzzer without a sanitizer, so that the stable
# toolchain builds it: RUSTC_BOOTSTRAP lets cargo-fuzz pass its -Z flags).
# Set RMACOMM_FUZZ_SECONDS=0 to skip it.
fuzz_s=${RMACOMM_FUZZ_SECONDS:-60}
if [ "$fuzz_s" != 0 ]; then
  if ! command -v cargo-fuzz >/dev/null 2>&1; then
    cargo install --locked cargo-fuzz
  fi
  (cd ibverbx && RUSTC_BOOTSTRAP=1 cargo fuzz run frame_decode --sanitizer none -- \
    -max_total_time="$fuzz_s" -print_final_stats=1 2>&1 | tail -30)
fi

# Release build: the 64 MiB conformance cases and the multi-process tests run
# against optimised code, as users run it.
# The CUDA stand-in (a cdylib nextest does not build) for the device-window
# tests on this GPU-less machine; they fail rather than skip without it.
cargo build --release -q -p rmacomm-cuda-standin
RMACOMM_EXPECT_STANDIN=1 cargo nextest run --workspace --release --no-fail-fast
cargo test --workspace --release --doc

# The API docs build without broken links.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

# The Python package (python/): a virtual environment under target/ (kept
# between runs), `pip install ./python` (maturin builds the extension in
# release mode into target/), numpy, pytest and mypy, torch when PyPI gives
# it (else the torch tests skip, saying why), then the pytest suite, which
# runs its scenarios under the launcher with 2, 3 and 4 ranks.
# RMACOMM_PYTHON=0 skips it; RMACOMM_PYTHON_VENV puts the environment
# elsewhere.
if [ "${RMACOMM_PYTHON:-1}" != 0 ]; then
  py_venv=${RMACOMM_PYTHON_VENV:-target/python-venv}
  if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "# installing python3-venv"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv python3-dev) >/dev/null
  fi
  if ! command -v python3 >/dev/null || ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    echo "# skipped the python stage: no python3 with venv (apt-get install python3-venv)"
  else
    [ -x "$py_venv/bin/python" ] || python3 -m venv "$py_venv"
    "$py_venv/bin/python" -m pip install -q --disable-pip-version-check maturin numpy pytest mypy
    if ! "$py_venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
      echo "# installing torch into $py_venv (once; about a minute and 5 GB)"
      "$py_venv/bin/python" -m pip install -q --disable-pip-version-check torch \
        || echo "# torch could not be installed from PyPI: the torch tests skip"
    fi
    "$py_venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps ./python
    # From the repository root, so that `import rmacomm` is the installed
    # package, not the source directory.
    "$py_venv/bin/python" -m pytest -q -rs -p no:cacheprovider python/tests
    # The GPU libraries' probes and the CUDA kernels' compilation, for real:
    # torch's CUDA wheels bring NVRTC and NCCL (no GPU is needed for either).
    # Where they were installed, a missing library fails these tests.
    expect=()
    for lib in nvrtc:cu13/lib/libnvrtc.so.13 nccl:nccl/lib/libnccl.so.2; do
      if compgen -G "$py_venv/lib/python3*/site-packages/nvidia/${lib#*:}" >/dev/null; then
        expect+=("RMACOMM_EXPECT_$(echo "${lib%%:*}" | tr a-z A-Z)=1")
      fi
    done
    echo "# GPU library probes and NVRTC compilation against $py_venv (${expect[*]:-no CUDA wheels found: they skip})"
    # With NVRTC there, the native GPU all_reduce compiles the real kernels
    # and runs against the CUDA stand-in (gpu_standin: through IPC and in
    # transport mode; and across two network namespaces), and so do the
    # device windows' signals captured into CUDA graphs (kernels).
    env VIRTUAL_ENV="$(cd "$py_venv" && pwd)" RMACOMM_EXPECT_STANDIN=1 "${expect[@]}" \
      cargo nextest run --release -p rmacomm-cuda -p rmacomm-kernels -p rmacomm-collectives -p rmacomm-window \
      -p rmacomm-tests \
      -E 'binary(probes) | binary(cuda_kernels) | binary(gpu_standin) | test(device_memory_ring_against_the_cuda_standin) | test(gpu_collectives_between_two_network_namespaces) | test(a_gpu_rank_that_dies_releases_the_others_streams) | test(_on_two_gpus_with_and_without_peer_access) | test(gpu_ranks_that_leave_normally_do_not_release_the_others_replays) | test(device_replays_waiting_for_an_absent_or_dead_peer_are_released) | test(keeps_its_slots_until_slower_peers_read_them)' \
      --no-capture
  fi
fi

# The GPU suite's summary (scripts/gpu_summary.py) on a recorded run, the
# H200's of 2026-11-27: its tables, and its one failed stage found.
if command -v python3 >/dev/null; then
  summary=$(PYTHONIOENCODING=utf-8 python3 scripts/gpu_summary.py docs/gpu-results/2026-11-27-h200)
  grep -q '| 16 MiB | 2,535.3 | 2,459.8 | 2,541.1 | 1.00 ✓ |' <<<"$summary"
  grep -q '^- python: native collectives, RMACOMM_GPU_TRANSPORT=1$' <<<"$summary"
  # A device-to-device transport record with the engine's waits (rdma_bench
  # writes them since the recorded run): MiB per wait in its row.
  synth=$(mktemp -d)
  cp docs/gpu-results/2026-11-27-h200/copy_ceiling.jsonl "$synth/"
  echo '{"op":"write","bytes":1048576,"iterations":100,"bw_avg_MBps":2000.0,"device_copies":110,"device_copy_waits":4,"peer_device_bytes":115343360}' \
    > "$synth/transport_cuda_ipc_write.jsonl"
  # Captured first, never piped: grep -q stops reading at its match, and the
  # summary's writer then dies of a broken pipe (pipefail fails the run).
  synth_summary=$(PYTHONIOENCODING=utf-8 python3 scripts/gpu_summary.py "$synth")
  grep -q '| same host (CUDA IPC), write | 1 MiB | 2.10 | 193.1 | 0.011 | 27.50 |' <<<"$synth_summary"
  rm -rf "$synth"
  echo "# gpu_summary.py: the recorded H200 run summarized"
fi

# The criterion benches always build (they run with `cargo bench`).
cargo bench --workspace --no-run

# The runnable examples verify what they move and exit non-zero otherwise.
cargo run --release -q -p rmacomm-transport --example kv_transfer
cargo run --release -q -p rmacomm-agent --example agent_kv -- --rounds 3

# The README's main command, as written there: a full rdma_bench sweep
# (2 B … 256 MiB) between two processes; it exits non-zero if the data it
# moved does not verify.
cargo run --release -q -p rmacomm-bench --bin rdma_bench -- write -a --local

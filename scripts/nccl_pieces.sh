#!/usr/bin/env bash
# Carries a newer libnccl.so.2 to the lent GPU machine, whose PyTorch wheel
# has NCCL 2.28.9 (no window API), in pieces small enough for the device
# tool's 64 MiB carry: NCCL 2.30.7 from CI's virtual environment is 252 MB,
# ~200 MB compressed, so four pieces, one per call on a warm machine.
#
#   scripts/nccl_pieces.sh pack [LIBNCCL]   here: target/nccl-pieces/part.NN
#                                           (+ SHA256SUMS), 60 MiB each
#   scripts/nccl_pieces.sh stash PART       there, one call per piece: keeps
#                                           the carried piece in /tmp/nccl-pieces
#   scripts/nccl_pieces.sh join [OUT]       there, after the last: checks the
#                                           sum, writes OUT (/tmp/nccl/libnccl.so.2)
#
# Then, one rank (NCCL refuses two on one GPU):
#   RMACOMM_NCCL_LIB=/tmp/nccl/libnccl.so.2 target/gpu-suite/bin/rmacomm-run \
#     --nproc-per-node 1 target/gpu-suite/bin/gpu-window-scenario nccl
# (docs/gpu.md, "NCCL windows"). The library is NVIDIA's binary from PyPI
# (nvidia-nccl-cu13), moved as it is.
set -euo pipefail
cmd=${1:-}
case "$cmd" in
  pack)
    lib=${2:-target/python-venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2}
    [ -f "$lib" ] || { echo "no $lib (the CI venv brings it: scripts/test.sh)" >&2; exit 1; }
    out=target/nccl-pieces
    rm -rf "$out" && mkdir -p "$out"
    sha256sum "$lib" | awk '{print $1 "  libnccl.so.2"}' > "$out/SHA256SUMS"
    xz -6 -T0 -c "$lib" | split -b 60M -d -a 2 - "$out/part."
    ls -la "$out"
    ;;
  stash)
    part=${2:?which part}
    mkdir -p /tmp/nccl-pieces
    cp "$part" /tmp/nccl-pieces/
    [ -f target/nccl-pieces/SHA256SUMS ] && cp target/nccl-pieces/SHA256SUMS /tmp/nccl-pieces/
    ls -la /tmp/nccl-pieces
    ;;
  join)
    out=${2:-/tmp/nccl/libnccl.so.2}
    mkdir -p "$(dirname "$out")"
    cat /tmp/nccl-pieces/part.* | xz -d > "$out"
    want=$(awk '{print $1}' /tmp/nccl-pieces/SHA256SUMS)
    got=$(sha256sum "$out" | awk '{print $1}')
    [ "$want" = "$got" ] || { echo "checksum mismatch: $got, want $want" >&2; exit 1; }
    echo "$out: $(stat -c %s "$out") bytes, sha256 ok"
    ;;
  *)
    sed -n '2,20p' "$0"
    exit 2
    ;;
esac

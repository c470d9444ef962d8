#!/usr/bin/env bash
# Virtual-QP scaling over the soft provider's tcp link (issue 15's "4 QPs
# >= 1.2x one QP at 16 MiB with 1 MiB fragments"): rdma_bench write, 16 MiB,
# 1 MiB fragments, for every (progress threads, QPs) pair, interleaved and
# repeated, then the medians and the ratio of the best 4-QP setting to one
# QP on one thread. Needs only the rdma_bench binary, so it runs on a machine
# without Rust (carry target/release/rdma_bench):
#
#   bash benches/qp_scaling.sh [RDMA_BENCH] [REPS]
#
# On a 2-core machine one stream already keeps both cores busy (see
# docs/rdma_bench.md, "Progress engine threads"): the interesting figures
# come from machines with spare cores.
set -euo pipefail
bench=${1:-$(dirname "$0")/../target/release/rdma_bench}
reps=${2:-5}
[ -x "$bench" ] || { echo "no rdma_bench at $bench (cargo build --release -p rmacomm-bench)" >&2; exit 1; }
echo "# $(nproc) cores; rdma_bench write -s 16M --link tcp --frag-size 1M -D 2; GB/s"
declare -A runs
for _ in $(seq 1 "$reps"); do
  for t in 1 2 4; do
    for q in 1 4; do
      # A failed run is a "nan" with its error shown, not the end of the
      # script (set -e); column 4 is MB/s with MB = 2^20 (perftest's).
      log=$(mktemp)
      r=$(RMACOMM_SOFT_PROGRESS_THREADS=$t "$bench" write -s 16M --link tcp -q $q --frag-size 1M -D 2 2>"$log" |
        awk '$1==16777216 {printf "%.2f", $4*1048576/1e9}') || true
      if [ -z "$r" ]; then
        echo "threads $t qps $q: failed:" >&2
        sed 's/^/  /' "$log" >&2
      fi
      rm -f "$log"
      runs[$t,$q]="${runs[$t,$q]:-} ${r:-nan}"
      echo "threads $t qps $q: ${r:-nan}"
    done
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
echo "# medians (GB/s)"
base=$(echo "${runs[1,1]}" | median)
best=0
for t in 1 2 4; do
  for q in 1 4; do
    m=$(echo "${runs[$t,$q]}" | median)
    echo "threads $t qps $q: $m   (runs:${runs[$t,$q]})"
    if [ "$q" = 4 ]; then best=$(awk -v a="$best" -v b="$m" 'BEGIN {print (b > a) ? b : a}'); fi
  done
done
awk -v b="$best" -v o="$base" 'BEGIN {printf "best 4-QP setting / one QP on one thread: %.2f (target >= 1.2)\n", b / o}'

#!/usr/bin/env bash
# The Python benchmark beside the Rust figures of the same run: 8-byte put
# latency (put + signal -> wait_signal ping-pong, half round trip) and
# all_reduce of 4 KiB and 1 MiB, 2 ranks, from Python (tests/scenarios.py
# bench) and from Rust (py-reference pingpong, coll-scenario time); and the
# same calls on one rank alone (bench_self, py-reference self), where no
# other process's scheduling shows, so the difference is what the bindings
# add per call. Each is run ROUNDS times (default 5) alternately; prints
# the medians and the best
# runs as a table (short runs on a shared machine are often bimodal).
#
#   PYTHON=target/python-venv/bin/python bash python/bench.sh
#
# PYTHON must have the rmacomm package installed (pip install ./python).
# Each rank is pinned to its own core (taskset -c LOCAL_RANK) when the
# machine has two or more: unpinned, the spinning ranks of short runs on a
# 2-core machine fall into bimodal timings (0.2 or 9 us per half round
# trip from one run to the next). PIN=0 turns it off.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
rounds=${ROUNDS:-5}
cargo build --release -q -p rmacomm-python --bin py-reference -p rmacomm-window --bin rmacomm-run \
  -p rmacomm-collectives --bin coll-scenario
bin=${CARGO_TARGET_DIR:-target}/release
pin() {
  if [ "${PIN:-1}" != 0 ] && [ "$(nproc)" -ge 2 ] && command -v taskset >/dev/null; then
    echo "exec taskset -c \$LOCAL_RANK $*"
  else
    echo "exec $*"
  fi
}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for _ in $(seq "$rounds"); do
  "$bin/rmacomm-run" --nproc-per-node 1 "$bin/py-reference" self 100000 | sed -n 's/^\[0\] /rust /p' >>"$out"
  "$py" -m rmacomm.run --nproc-per-node 1 python/tests/scenarios.py bench_self 100000 \
    | sed -n 's/^\[0\] /python /p' >>"$out"
  "$bin/rmacomm-run" --nproc-per-node 2 sh -c "$(pin "$bin/py-reference" pingpong 20000)" \
    | sed -n 's/^\[0\] put8/rust put8/p' >>"$out"
  for algo in oneshot direct; do
    "$py" -m rmacomm.run --nproc-per-node 2 --no-python sh -c "$(pin "$py" python/tests/scenarios.py bench "$algo")" \
      | sed -n 's/^\[0\] /python /p' >>"$out"
    "$bin/rmacomm-run" --nproc-per-node 2 sh -c "$(pin "$bin/coll-scenario" time all_reduce "$algo" 4096 1048576)" \
      | sed -n "s/^\[0\] all_reduce $algo 2 ranks \([0-9]*\) B: \(.*\)$/rust all_reduce_${algo}_\1_us \2/p" >>"$out"
  done
done
"$py" - "$out" <<'EOF'
import re, statistics, sys
vals = {}
for line in open(sys.argv[1]):
    who, key, v = line.split(maxsplit=2)
    v = v.strip()
    m = re.match(r"([0-9.]+)\s*(µs|us|ms|ns|s)?$", v)
    x = float(m.group(1)) * {"ms": 1e3, "ns": 1e-3, "s": 1e6}.get(m.group(2) or "us", 1.0)
    vals.setdefault((key, who), []).append(x)
rows = [
    ("1 rank: put + signal + wait_signal (3 calls)", "self_put_signal_wait_us"),
    ("1 rank: all_reduce 4 KiB", "self_all_reduce_4096_us"),
    ("1 rank: all_reduce 1 MiB", "self_all_reduce_1048576_us"),
    ("2 ranks: 8-byte put + signal -> wait_signal, half round trip", "put8_half_rtt_us"),
]
for algo in ("oneshot", "direct"):
    for size, name in ((4096, "4 KiB"), (1048576, "1 MiB")):
        rows.append((f"2 ranks: all_reduce {name} ({algo})", f"all_reduce_{algo}_{size}_us"))
print("| one host | Rust median (best) | Python median (best) | Python - Rust, medians (bests) |")
print("|---|---|---|---|")
for label, key in rows:
    r, p = vals.get((key, "rust")), vals.get((key, "python"))
    if not r or not p:
        continue
    mr, mp, br, bp = statistics.median(r), statistics.median(p), min(r), min(p)
    print(f"| {label} | {mr:.2f} ({br:.2f}) µs | {mp:.2f} ({bp:.2f}) µs | {mp - mr:+.2f} ({bp - br:+.2f}) µs |")
print(f"\n(per-run means; medians and bests of {min(len(v) for v in vals.values())} or more alternating runs)")
EOF

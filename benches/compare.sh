#!/usr/bin/env bash
# rdma_bench beside the peers installed on this host, in one run, as ratios
# (rmacomm / peer; for latency peer / rmacomm, so > 1 always means rmacomm
# is better):
#   single-thread memcpy, iperf3 on loopback, UCX ucx_perftest (ucp_put_bw /
#   ucp_put_lat / ucp_get over shared memory with UCX_TLS=posix,cma; uct
#   put_bw over tcp), Open MPI MPI_Put / MPI_Get + MPI_Win_flush
#   (benches/peers/mpi_put.c; osc sm and osc ucx over tcp), perftest
#   ib_write_bw / ib_write_lat when an HCA exists.
# rmacomm rows: the transport (write, write_lat), the raw virtual QP
# (verbs_write, verbs_write_lat) and the window (put, put_lat, get).
# Collectives (rdma_bench all_reduce, all_gather, reduce_scatter, all_to_all,
# broadcast; 2 ranks, f32, sum, one host) beside Open MPI's MPI_Allreduce /
# MPI_Allgather / MPI_Reduce_scatter_block / MPI_Alltoall / MPI_Bcast
# (benches/peers/mpi_coll.c) and torch.distributed's gloo backend
# (benches/peers/torch_coll.py), all timed the same way (nccl-tests': calls
# back to back after a warm-up, averaged over the ranks), interleaved per
# operation and repeated --reps times; the table gives medians and time
# ratios rmacomm / peer (< 1: rmacomm is faster).
# KV-cache transfer (rdma_bench kv: the transfer agent, a prefill process
# writing one request of N blocks into shuffled, never adjacent slots of a
# decode process's cache with one notification; time: the request's call to
# the notification seen at decode) beside NIXL (nixl-cu12, UCX backend,
# DRAM) and Mooncake's Transfer Engine (P2PHANDSHAKE, tcp) running the same
# workload through their Python APIs (benches/peers/nixl_kv.py,
# mooncake_kv.py over kv_peer.py) for 256 x 16 KiB, 64 x 1 MiB and
# 1024 x 4 KiB: on one host (rmacomm over shm, NIXL with UCX_TLS=all, with
# NIXL's default peer error handling and without it, see below) and
# over tcp (rmacomm --link tcp, NIXL UCX_TLS=tcp, Mooncake tcp), interleaved
# per shape, --reps times; ratios are rmacomm GB/s / peer GB/s (> 1:
# rmacomm is faster). The peers go into a virtual environment
# ($RMACOMM_KV_VENV when set, else one under the work directory; pip
# install nixl-cu12 pulls torch, a few GB); a peer that will not install is
# skipped with a message.
# Usage: benches/compare.sh [--quick] [--json FILE] [--only p2p|coll|kv]
#                           [--reps N] [--nranks N] [--plot FILE.svg]
#                           [--bind-to none|core]
#   --reps N      interleaved repetitions of the collective and kv rows
#                 (default 1)
#   --nranks N    ranks of the collective rows (default 2)
#   --plot F.svg  all_reduce time against size: rmacomm, Open MPI, gloo
#                 (medians over the repetitions)
#   --bind-to core  bind rmacomm's ranks one per core, as Open MPI binds its
#                 2 ranks by default (default: none, as torchrun does)
# gloo needs PyTorch: the python of the virtual environment $RMACOMM_TORCH_VENV
# when set (RMACOMM_TORCH_VENV=none: no gloo rows), else a fresh one under the
# work directory (`pip install torch`: about a minute and 5.4 GB).
# As root it installs the missing peers from Debian's packages; otherwise it
# skips each missing peer and names it.
set -u
cd "$(dirname "$0")/.."
root=$(pwd)
quick=0
json_out=""
only=""
reps=1
nranks=2
plot_out=""
bind=none
usage="usage: $0 [--quick] [--json FILE] [--only p2p|coll|kv] [--reps N] [--nranks N] [--plot FILE.svg] [--bind-to none|core]"
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --json) json_out=$2; shift ;;
    --only) only=$2; shift ;;
    --reps) reps=$2; shift ;;
    --nranks) nranks=$2; shift ;;
    --plot) plot_out=$2; shift ;;
    --bind-to) bind=$2; shift ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done
case "$only" in ""|p2p|coll|kv) ;; *) echo "$usage" >&2; exit 2 ;; esac
case "$bind" in none|core) ;; *) echo "$usage" >&2; exit 2 ;; esac
case "$reps$nranks" in *[!0-9]*) echo "$usage" >&2; exit 2 ;; esac
[ -n "$plot_out" ] && plot_out=$(realpath -m "$plot_out")
[ -n "$json_out" ] && json_out=$(realpath -m "$json_out")
work=$(mktemp -d "${TMPDIR:-/tmp}/rmacomm-compare.XXXXXX")
trap 'rm -rf "$work"' EXIT
res="$work/results.jsonl"
coll_res="$work/collectives.jsonl"
: >"$res"
: >"$coll_res"
log() { echo "# $*" >&2; }
p2p() { [ -z "$only" ] || [ "$only" = p2p ]; }
coll() { [ -z "$only" ] || [ "$only" = coll ]; }
kv() { [ -z "$only" ] || [ "$only" = kv ]; }
kv_res="$work/kv.jsonl"
: >"$kv_res"

# --- peers ---------------------------------------------------------------
need=()
# python3 prints every table and picks free ports: without it the runs went
# ahead with empty ports and sizes and the script died at the first table.
command -v python3 >/dev/null || need+=(python3 python3-venv)
if p2p || coll; then
command -v cc >/dev/null || need+=(gcc)
command -v iperf3 >/dev/null || need+=(iperf3)
command -v ucx_perftest >/dev/null || need+=(ucx-utils)
command -v mpicc >/dev/null || need+=(openmpi-bin libopenmpi-dev)
command -v ib_write_bw >/dev/null || need+=(perftest)
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing ${need[*]}"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}") \
      >"$work/apt.log" 2>&1 || log "apt-get failed (see below); running without what it could not install"
  else
    log "not root: skipping the missing peers: ${need[*]}"
  fi
fi

command -v python3 >/dev/null || { echo "compare.sh needs python3 (it prints the tables): install it" >&2; exit 1; }

# --- rmacomm -------------------------------------------------------------
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
cargo build --release -q -p rmacomm-bench --bin rdma_bench || exit 1
rb="$CARGO_TARGET_DIR/release/rdma_bench"
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

# --- collectives: rmacomm, Open MPI, gloo, interleaved ----------------------
if coll; then
  coll_ops="all_reduce all_gather reduce_scatter all_to_all broadcast"
  coll_max=$([ $quick = 1 ] && echo 1048576 || echo 67108864)
  coll_sizes=$(python3 -c "print(' '.join(str(1 << i) for i in range(12, ($coll_max).bit_length())))")
  mpi_coll=""
  if command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
    if mpicc -O2 -o "$work/mpi_coll" benches/peers/mpi_coll.c 2>"$work/mpicc_coll.log"; then
      mpi_coll="$work/mpi_coll"
      mpi_label="Open MPI $(ompi_info --version 2>/dev/null | awk '/v[0-9]/ {sub(/^v/, "", $NF); print $NF; exit}')"
    else log "skipped Open MPI collectives: mpicc failed"; cat "$work/mpicc_coll.log" >&2; fi
  else log "skipped Open MPI collectives: mpicc/mpirun not installed"; fi
  torch_py=""
  if [ "${RMACOMM_TORCH_VENV:-}" = none ]; then
    log "skipped gloo: RMACOMM_TORCH_VENV=none"
  else
    venv=${RMACOMM_TORCH_VENV:-$work/torch-venv}
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
      log "installing torch into $venv (pip install torch: about a minute, 5.4 GB)"
      { python3 -m venv "$venv" && "$venv/bin/pip" install -q torch; } >"$work/pip.log" 2>&1 \
        || { log "skipped gloo: pip install torch failed:"; tail -3 "$work/pip.log" >&2; }
    fi
    if "$venv/bin/python" -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null; then
      torch_py="$venv/bin/python"
      torch_label="torch $("$torch_py" -c 'import torch; print(torch.__version__.split("+")[0])') gloo"
    else log "skipped gloo: no torch with gloo in $venv"; fi
  fi
  tag() { sed "s/^{/{\"rep\":$1,/" | grep '^{'; }
  for rep in $(seq 1 "$reps"); do
    for op in $coll_ops; do
      log "collectives, repetition $rep/$reps: $op (rmacomm, Open MPI, gloo; $nranks ranks)"
      "$rb" $op --nproc "$nranks" --bind-to "$bind" -a --min 4K --max "$coll_max" --json >"$work/coll.out" 2>>"$work/coll.err" \
        || { log "rdma_bench $op failed:"; tail -5 "$work/coll.err" >&2; exit 1; }
      tag "$rep" <"$work/coll.out" >>"$coll_res"
      if [ -n "$mpi_coll" ]; then
        timeout 600 mpirun --allow-run-as-root --oversubscribe -np "$nranks" "$mpi_coll" "$mpi_label" $op $coll_sizes \
          >"$work/peer.out" 2>"$work/peer.err" || { log "mpi_coll $op failed:"; tail -5 "$work/peer.err" >&2; }
        tag "$rep" <"$work/peer.out" >>"$coll_res"
      fi
      if [ -n "$torch_py" ]; then
        OMP_NUM_THREADS=1 timeout 900 "$torch_py" -m torch.distributed.run --nproc-per-node "$nranks" \
          --master-port "$(port)" benches/peers/torch_coll.py "$torch_label" $op $coll_sizes \
          >"$work/peer.out" 2>"$work/peer.err" || { log "gloo $op failed:"; tail -5 "$work/peer.err" >&2; }
        tag "$rep" <"$work/peer.out" >>"$coll_res"
      fi
    done
  done
fi

# --- KV-cache transfer: rmacomm's agent, NIXL, Mooncake, interleaved ------
if kv; then
  kv_shapes="256:16384 64:1048576 1024:4096"
  kvenv=${RMACOMM_KV_VENV:-$work/kv-venv}
  kvpy="$kvenv/bin/python"
  if [ ! -x "$kvpy" ]; then
    python3 -m venv "$kvenv" >"$work/kv-pip.log" 2>&1 || log "cannot make a virtual environment in $kvenv"
  fi
  nixl_ok=0; mooncake_ok=0
  if [ -x "$kvpy" ]; then
    if ! "$kvpy" -c 'import nixl_cu12, numpy' 2>/dev/null; then
      log "installing nixl-cu12 into $kvenv (it pulls torch: minutes, a few GB)"
      "$kvenv/bin/pip" install -q nixl-cu12 numpy >>"$work/kv-pip.log" 2>&1 \
        || { log "pip install nixl-cu12 failed:"; tail -3 "$work/kv-pip.log" >&2; }
    fi
    "$kvpy" -c 'import nixl_cu12._api, numpy' 2>/dev/null && nixl_ok=1 || log "skipped NIXL: nixl-cu12 does not import"
    if ! "$kvpy" -c 'import mooncake.engine, numpy' 2>/dev/null; then
      log "installing mooncake-transfer-engine-non-cuda into $kvenv"
      "$kvenv/bin/pip" install -q mooncake-transfer-engine-non-cuda numpy >>"$work/kv-pip.log" 2>&1 \
        || { log "pip install mooncake-transfer-engine-non-cuda failed:"; tail -3 "$work/kv-pip.log" >&2; }
    fi
    "$kvpy" -c 'import mooncake.engine, numpy' 2>/dev/null && mooncake_ok=1 \
      || log "skipped Mooncake: mooncake-transfer-engine-non-cuda does not import"
  fi
  ktag() { sed "s/^{/{\"rep\":$1,/" | grep '^{'; }
  peer_kv() { # rep label-for-errors env driver link shape
    local rep=$1 what=$2 envv=$3 drv=$4 link=$5 shape=$6
    env $envv timeout 600 "$kvpy" "benches/peers/$drv" --link "$link" "$shape" >"$work/kvpeer.out" 2>"$work/kvpeer.err" \
      || { log "$what $shape over $link failed:"; grep -v ' INFO ' "$work/kvpeer.err" | tail -5 >&2; }
    ktag "$rep" <"$work/kvpeer.out" >>"$kv_res"
  }
  for rep in $(seq 1 "$reps"); do
    for link in shm tcp; do
      for shape in $kv_shapes; do
        log "kv, repetition $rep/$reps: $shape over $link (rmacomm, NIXL$([ $link = tcp ] && echo ', Mooncake'))"
        "$rb" kv --blocks "${shape%%:*}" --block-size "${shape##*:}" --link $link --json >"$work/kv.out" 2>>"$work/kv.err" \
          || { log "rdma_bench kv failed:"; tail -5 "$work/kv.err" >&2; exit 1; }
        ktag "$rep" <"$work/kv.out" >>"$kv_res"
        if [ $nixl_ok = 1 ] && [ $link = shm ]; then
          peer_kv "$rep" NIXL "UCX_TLS=all" nixl_kv.py shm "$shape"
          # NIXL asks UCX for peer failure handling, which its shared-memory
          # transports lack (so the row above runs over loopback tcp); this
          # one turns it off, letting UCX use shared memory.
          peer_kv "$rep" NIXL "UCX_TLS=all NIXL_KV_ERR_MODE=none" nixl_kv.py shm "$shape"
        elif [ $nixl_ok = 1 ]; then
          peer_kv "$rep" NIXL "UCX_TLS=tcp" nixl_kv.py tcp "$shape"
        fi
        if [ $link = tcp ] && [ $mooncake_ok = 1 ]; then
          peer_kv "$rep" Mooncake "" mooncake_kv.py tcp "$shape"
        fi
      done
    done
  done
fi

bw_sizes="65536 1048576 16777216 268435456"
[ $quick = 1 ] && bw_sizes="65536 1048576 16777216"
lat_n=$([ $quick = 1 ] && echo 2000 || echo 20000)
max=$(echo $bw_sizes | tr ' ' '\n' | tail -1)
p2p && for link in shm tcp; do
  for op in write verbs_write put get; do
    log "rdma_bench $op over $link"
    # Same host, the transport against the raw virtual QP from 8 KiB (where
    # per-operation costs show).
    min=64K
    case $link/$op in shm/write | shm/verbs_write) min=8K ;; esac
    "$rb" $op -a --min $min --max "$max" --link $link --json >>"$res" || { log "rdma_bench $op failed"; exit 1; }
  done
  "$rb" write_lat -s 8 -n "$lat_n" --link $link --json >>"$res" || exit 1
  "$rb" verbs_write_lat -s 8 -n "$lat_n" --link $link --json >>"$res" || exit 1
  "$rb" put_lat -s 8 -n "$lat_n" --link $link --json >>"$res" || exit 1
done
hca=0
if p2p && "$rb" write --provider verbs -s 8 -n 2 >/dev/null 2>&1; then hca=1; fi

if ! p2p; then :
elif command -v cc >/dev/null; then
  log "memcpy"
  cc -O2 -o "$work/memcpy_bw" benches/peers/memcpy_bw.c && "$work/memcpy_bw" $bw_sizes >>"$res"
else log "skipped memcpy: no C compiler"; fi

if ! p2p; then :
elif command -v iperf3 >/dev/null; then
  log "iperf3"
  p=$(port)
  iperf3 -s -1 -p "$p" >/dev/null 2>&1 & spid=$!
  sleep 0.5
  timeout 30 iperf3 -c 127.0.0.1 -p "$p" -l 1M -t $([ $quick = 1 ] && echo 2 || echo 5) -J 2>/dev/null >"$work/iperf.json"
  kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null
  python3 - "$work/iperf.json" >>"$res" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    bps = d["end"]["sum_received"]["bits_per_second"]
    print(json.dumps({"peer": "iperf3", "test": "bw", "link": "tcp", "bytes": 1048576, "GBps": bps / 8 / 1e9}))
except Exception as e:
    print("# iperf3 output unreadable: %s" % e, file=sys.stderr)
PY
else log "skipped iperf3: not installed"; fi

ucx() { # peer-label link env test size iters [args]
  local label=$1 link=$2 envv=$3 test=$4 size=$5 iters=$6 p spid
  shift 6
  p=$(port)
  env $envv ucx_perftest -p "$p" >"$work/ucx_srv.log" 2>&1 & spid=$!
  sleep 0.7
  env $envv timeout 120 ucx_perftest 127.0.0.1 -p "$p" -t "$test" -s "$size" -n "$iters" -w $((iters / 10 + 1)) "$@" \
    >"$work/ucx_cli.log" 2>&1
  kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null
  # Final: iters typical_lat avg_lat overall_lat bw_avg(MB/s=2^20) bw_overall msgrate...
  awk -v l="$label" -v t="$test" -v s="$size" -v k="$link" '/Final:/ {
      printf "{\"peer\":\"%s\",\"test\":\"%s\",\"link\":\"%s\",\"bytes\":%s,\"lat_us\":%s,\"GBps\":%.4f}\n", l, t, k, s, $3, $6*1048576/1e9 }' \
    "$work/ucx_cli.log"
}
if ! p2p; then :
elif command -v ucx_perftest >/dev/null; then
  log "UCX"
  ucx "ucx ucp_put_lat (posix,cma)" shm "UCX_TLS=posix,cma" ucp_put_lat 8 "$lat_n" >>"$res"
  for s in $bw_sizes; do
    ucx "ucx ucp_put_bw (posix,cma)" shm "UCX_TLS=posix,cma" ucp_put_bw "$s" $(( 2000000000 / s / 2 + 10 )) >>"$res"
    ucx "ucx ucp_get (posix,cma)" shm "UCX_TLS=posix,cma" ucp_get "$s" $(( 2000000000 / s / 2 + 10 )) >>"$res"
  done
  for s in 65536 1048576 16777216; do
    ucx "ucx uct put_bw (tcp, zcopy)" tcp "" put_bw "$s" $(( 500000000 / s + 10 )) -x tcp -d lo -D zcopy >>"$res"
  done
else log "skipped UCX: ucx_perftest not installed"; fi

if ! p2p; then :
elif command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
  log "Open MPI"
  if mpicc -O2 -o "$work/mpi_put" benches/peers/mpi_put.c 2>"$work/mpicc.log"; then
    run="mpirun --allow-run-as-root --oversubscribe -np 2"
    timeout 300 $run --mca osc sm "$work/mpi_put" "mpi put+flush (osc sm)" 8 $bw_sizes 2>>"$work/mpi.err" \
      | sed 's/"test"/"link":"shm","test"/' >>"$res"
    timeout 300 $run --mca osc ucx --mca pml ucx --mca opal_common_ucx_tls any --mca opal_common_ucx_devices any \
      -x UCX_TLS=tcp "$work/mpi_put" "mpi put+flush (osc ucx, tcp)" \
      8 65536 1048576 16777216 2>>"$work/mpi.err" | sed 's/"test"/"link":"tcp","test"/' >>"$res"
  else log "skipped Open MPI: mpicc failed"; cat "$work/mpicc.log" >&2; fi
else log "skipped Open MPI: mpicc/mpirun not installed"; fi

if ! p2p; then :
elif [ $hca = 1 ] && command -v ib_write_bw >/dev/null; then
  log "perftest (HCA)"
  "$rb" write --provider verbs -a --min 64K --max "$max" --json | sed 's/"link":"hca"/"link":"hca"/' >>"$res"
  "$rb" write_lat --provider verbs -s 8 --json >>"$res"
  for t in bw lat; do
    p=$(port)
    # The server takes the client's flags: perftest compares them at
    # connect (a server without -a refuses an -a client, or stops after
    # its first size), and its complaint goes to the work directory.
    if [ $t = bw ]; then sflags=(-a); else sflags=(-s 8); fi
    ib_write_$t -p "$p" "${sflags[@]}" >"$work/perftest_server_$t.log" 2>&1 & spid=$!
    sleep 0.7
    if [ $t = bw ]; then
      timeout 120 ib_write_bw -p "$p" -a 127.0.0.1 2>/dev/null | awk '$1 ~ /^[0-9]+$/ && NF >= 5 {
        printf "{\"peer\":\"perftest ib_write_bw\",\"test\":\"bw\",\"link\":\"hca\",\"bytes\":%s,\"GBps\":%.4f}\n", $1, $4*1048576/1e9 }' >>"$res"
    else
      timeout 120 ib_write_lat -p "$p" -s 8 127.0.0.1 2>/dev/null | awk '$1 == "8" && NF >= 6 {
        printf "{\"peer\":\"perftest ib_write_lat\",\"test\":\"lat\",\"link\":\"hca\",\"bytes\":8,\"lat_us\":%s}\n", $5 }' >>"$res"
    fi
    kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null
  done
else
  log "skipped perftest ib_write_bw/ib_write_lat: no RDMA device here"
fi

[ -n "$json_out" ] && cat "$res" "$coll_res" "$kv_res" >"$json_out"

# --- one table of ratios ---------------------------------------------------
p2p && python3 - "$res" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
ours = [r for r in rows if "op" in r]
peers = [r for r in rows if "peer" in r]
GB = 1048576 / 1e9  # rdma_bench MB/s (2^20) -> GB/s (10^9)

def mine(op, link, size, key):
    for r in ours:
        if r["op"] == op and r["link"] == link and r["bytes"] == size and r.get(key) is not None:
            return r[key]
    return None

def size_name(n):
    for u, s in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= u:
            return "%d %s" % (n // u, s)
    return "%d B" % n

# Which rmacomm ops each peer figure is set beside: reads (gets) beside
# reads and the memcpy ceiling, writes (puts) beside everything else.
GETS = ("ucp_get", "get_flush", "get")
def bw_ops(p):
    if p.get("test") in GETS:
        return ("get",)
    if p["peer"] == "memcpy":
        return ("write", "verbs_write", "put", "get")
    return ("write", "verbs_write", "put")

out = []
for p in peers:
    link, size = p.get("link"), p["bytes"]
    if p.get("GBps") and p.get("test") != "lat" and size >= 65536:
        for op in bw_ops(p):
            v = mine(op, link, size, "bw_avg_MBps")
            if v is None and link == "tcp" and p["peer"] == "iperf3":
                v = mine(op, "tcp", size, "bw_avg_MBps")
            if v is not None:
                out.append((size, "bw GB/s", link, op, v * GB, p["peer"], p["GBps"], v * GB / p["GBps"]))
    if p.get("lat_us") and size == 8 and p.get("test") not in GETS:
        for op in ("write_lat", "verbs_write_lat", "put_lat"):
            v = mine(op, link, 8, "t_typical_us")
            if v is not None:
                out.append((8, "lat us", link, op, v, p["peer"], p["lat_us"], p["lat_us"] / v))
out.sort(key=lambda r: (r[1], r[0], r[2], r[3], r[5]))
hdr = ("size", "figure", "link", "rmacomm op", "rmacomm", "peer", "peer fig.", "ratio")
print("| " + " | ".join(hdr) + " |")
print("|" + "---|" * len(hdr))
for s, fig, link, op, v, peer, pv, ratio in out:
    print("| %s | %s | %s | %s | %.3g | %s | %.3g | %.3g |" % (size_name(s), fig, link, op, v, peer, pv, ratio))
print()
print("ratio = rmacomm / peer for bandwidth, peer / rmacomm for latency (> 1: rmacomm is better).")
print("rmacomm latency: median half round trip of a notifying write ping-pong (put_lat: put + signal,")
print("answered by wait_signal + put + signal); MPI put+flush latency: one put completed by a flush (a full")
print("round trip); UCX put_lat: half round trip. put bandwidth includes a signal the peer answers at the")
print("end of each batch; get and MPI get+flush read the peer's buffer; UCX ucp_get likewise.")
# The transport against the raw virtual QP it drives, same run.
layers = sorted({(r["link"], r["bytes"]) for r in ours if r["op"] == "write" and r.get("bw_avg_MBps")})
if layers:
    print()
    print("| link | size | `write` (transport) GB/s | `verbs_write` (raw virtual QP) GB/s | write / verbs_write |")
    print("|---|---|---|---|---|")
    for link, size in layers:
        w, v = mine("write", link, size, "bw_avg_MBps"), mine("verbs_write", link, size, "bw_avg_MBps")
        if w and v:
            print("| %s | %s | %.3g | %.3g | %.2f |" % (link, size_name(size), w * GB, v * GB, w / v))
PY

# --- collectives: medians over the repetitions, time ratios ---------------
p2p && coll && echo
coll && python3 - "$coll_res" "$work/coll_medians.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def who(r):
    return r.get("peer") or "rmacomm"
# (op, size, who) -> {rep: record}
by = {}
for r in rows:
    by.setdefault((r["op"], r["bytes"], who(r)), {})[r.get("rep", 1)] = r
med = lambda xs: statistics.median(xs) if xs else None
# Medians per series, for the plot.
with open(sys.argv[2], "w") as f:
    for (op, size, w), reps in sorted(by.items()):
        rs = list(reps.values())
        m = dict(rs[0])
        m.pop("rep", None)
        m["time_us"] = med([r["time_us"] for r in rs])
        m["algbw_GBps"] = size / m["time_us"] / 1e3
        m["busbw_GBps"] = med([r["busbw_GBps"] for r in rs])
        print(json.dumps(m), file=f)
def size_name(n):
    for u, s in ((1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= u:
            return "%d %s" % (n // u, s)
    return "%d B" % n
def num(x):
    # Three significant digits, never an exponent.
    for lim, f in ((100, "%.0f"), (10, "%.1f"), (1, "%.2f"), (0, "%.3f")):
        if abs(x) >= lim:
            return f % x
    return "%.3g" % x
def rng(xs):
    return num(med(xs)) + ("" if len(xs) < 2 else " (%s–%s)" % (num(min(xs)), num(max(xs))))
peers = sorted({w for (_, _, w) in by if w != "rmacomm"})
show = {4096, 1048576, 16777216, 67108864}
ops = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]
print("| op | size | rmacomm µs | peer | peer µs | ratio rmacomm/peer |")
print("|---|---|---|---|---|---|")
for op in ops:
    for size in sorted({s for (o, s, _) in by if o == op and s in show}):
        mine = by.get((op, size, "rmacomm"), {})
        if not mine:
            continue
        for p in peers:
            theirs = by.get((op, size, p), {})
            common = sorted(set(mine) & set(theirs))
            if not common:
                continue
            ratios = [mine[k]["time_us"] / theirs[k]["time_us"] for k in common]
            print("| %s | %s | %s | %s | %s | %s |" % (
                op, size_name(size), rng([mine[k]["time_us"] for k in common]), p,
                rng([theirs[k]["time_us"] for k in common]), rng(ratios)))
bad = [r for r in rows if r.get("wrong")]
print()
print("time per call (µs): calls back to back after a warm-up, averaged over the ranks; median of %d"
      " interleaved repetition(s), (min–max) when more than one." % max([r.get("rep", 1) for r in rows] or [1]))
print("ratio = rmacomm time / peer time, the median of the per-repetition ratios: < 1 means rmacomm is faster.")
print("every result was checked element by element" + ("" if not bad else "; WRONG RESULTS: %d rows" % len(bad)))
PY
if coll && [ -n "$plot_out" ]; then
  grep '"op": *"all_reduce"' "$work/coll_medians.jsonl" >"$work/all_reduce.jsonl" \
    && "$rb" plot -o "$plot_out" "$work/all_reduce.jsonl"
fi

# --- KV-cache transfer: medians over the repetitions, GB/s ratios ---------
kv && { p2p || coll; } && echo
if kv; then
python3 - "$kv_res" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def who(r):
    return r.get("peer") or "rmacomm (agent, qps 1)"
def size_name(n):
    for u, s in ((1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= u:
            return "%d %s" % (n // u, s)
    return "%d B" % n
def num(x):
    for lim, f in ((100, "%.0f"), (10, "%.1f"), (1, "%.2f"), (0, "%.3f")):
        if abs(x) >= lim:
            return f % x
    return "%.3g" % x
# (link, blocks, block_bytes, who) -> {rep: record}
by = {}
for r in rows:
    by.setdefault((r["link"], r["blocks"], r["block_bytes"], who(r)), {})[r.get("rep", 1)] = r
med = statistics.median
def fig(recs, n, b):
    # median ms (GB/s; the repetitions' GB/s min–max when more than one)
    ms = med([r["t_median_us"] for r in recs]) / 1e3
    g = [r["GBps"] for r in recs]
    spread = "" if len(g) < 2 else ", %s–%s" % (num(min(g)), num(max(g)))
    return "%s (%s%s)" % (num(ms), num(n * b / ms / 1e6), spread)
print("| link | request | rmacomm median ms (GB/s) | peer | peer median ms (GB/s) | ratio (rmacomm GB/s / peer GB/s) |")
print("|---|---|---|---|---|---|")
for link in ("shm", "tcp"):
    for (n, b) in [(256, 16384), (64, 1 << 20), (1024, 4096)]:
        mine = by.get((link, n, b, "rmacomm (agent, qps 1)"), {})
        if not mine:
            continue
        peers = sorted(w for (l, nn, bb, w) in by if (l, nn, bb) == (link, n, b) and w.startswith(("nixl", "mooncake")))
        if not peers:
            print("| %s | %d x %s | %s | — | — | — |" % (link, n, size_name(b), fig(list(mine.values()), n, b)))
        for p in peers:
            theirs = by[(link, n, b, p)]
            common = sorted(set(mine) & set(theirs))
            if not common:
                continue
            ratios = [theirs[k]["t_median_us"] / mine[k]["t_median_us"] for k in common]
            print("| %s | %d x %s | %s | %s | %s | %s |" % (
                link, n, size_name(b), fig([mine[k] for k in common], n, b), p, fig([theirs[k] for k in common], n, b),
                num(med(ratios)) + ("" if len(ratios) < 2 else " (%s–%s)" % (num(min(ratios)), num(max(ratios))))))
print()
print("time: one request of N blocks into shuffled slots, from the call that makes it to decode seeing its")
print("notification (CLOCK_MONOTONIC of this host in both processes); median over the requests of a run, then")
print("the median over %d repetition(s) (GB/s: of that median; min–max: the repetitions'); GB = 10^9 B." % max([r.get("rep", 1) for r in rows] or [1]))
print("ratio: the median of the repetitions' ratios (min–max); > 1: rmacomm is faster.")
PY
fi

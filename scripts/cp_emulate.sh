#!/usr/bin/env bash
# The CP layer's per-rank work on ONE GPU (gdncp_bench --cp --emulate P: each rank on stand-in
# peers, bench/loopback_comm.h), as an A/B against base sources in the same call, and per-kernel
# device times under ncu. For a machine with one GPU, where the 2-GPU run cannot be made.
#   OUT=/tmp/out [BASE_SRC=".carry/base .carry/prev"] [NCU_ROWS="1 2 3" [NCU_BASE=1]] [SWEEP_DETAIL=1] \
#     scripts/cp_emulate.sh
# BASE_SRC: folders (each named by its last component) mirroring the repository's paths with the
# base versions of the library files that differ; the library is rebuilt with each (the same
# gdncp_bench binary loads any of them: it links libgdncp.so), and the runs alternate.
# NCU_ROWS: rows of the emulated benchmark to run under ncu (kernel durations; 0-based, as
# printed; ours, and with NCU_BASE=1 the bases too). SWEEP_DETAIL=1: ncu sections for the first
# two sweep_kernel launches (one forward, one backward) of row SWEEP_ROW (default 3: rank 0).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/cp_emulate_out}
B=${BUILD_DIR:-build-gpu}
P=${EMULATE:-2}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PATH="$PATH:/usr/local/cuda/bin"
echo "== $(date -u '+%F %T UTC') $(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader)"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
t0=$(date +%s)
{ cmake -S . -B "$B" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DGDNCP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real &&
  cmake --build "$B" -j "$(nproc)" --target gdncp_bench; } >"$OUT/build.log" 2>&1 ||
  { echo "build FAILED"; tail -30 "$OUT/build.log"; exit 1; }
echo "build: $(($(date +%s) - t0)) s"
lib=$(readlink -f "$B/libgdncp.so.0")
mkdir -p "$B/libs/ours"
cp "$lib" "$B/libs/ours/libgdncp.so.0"
who_list="ours"
bases=""
for base in ${BASE_SRC:-}; do  # each: overlay, rebuild the library, keep it as libs/<name>, restore ours
  name=$(basename "$base")
  rm -rf "$B/libs/saved"
  mkdir -p "$B/libs/saved"
  : >"$B/libs/added"
  (cd "$base" && find . -type f) | while read -r f; do
    mkdir -p "$B/libs/saved/$(dirname "$f")"
    if [ -e "$f" ]; then cp "$f" "$B/libs/saved/$f"; else echo "$f" >>"$B/libs/added"; fi
    mkdir -p "$(dirname "$f")"
    cp "$base/$f" "$f"
  done
  if cmake --build "$B" -j "$(nproc)" --target gdncp >>"$OUT/build.log" 2>&1; then
    mkdir -p "$B/libs/$name"
    cp "$(readlink -f "$B/libgdncp.so.0")" "$B/libs/$name/libgdncp.so.0"
    bases="$bases $name"
  else
    echo "$name build FAILED"
    tail -20 "$OUT/build.log"
  fi
  (cd "$B/libs/saved" && find . -type f) | while read -r f; do cp "$B/libs/saved/$f" "$f"; done
  xargs -r rm -f <"$B/libs/added"  # files only the base had
done
[ -n "$bases" ] && who_list="ours$bases ours$bases"
status=0
for who in $who_list; do
  echo "### $who"
  json=()
  [ "$who" = ours ] && json=(--json "$OUT/emulate_ours.json")
  LD_LIBRARY_PATH="$B/libs/$who" timeout 180 "$B/bench/gdncp_bench" --cp --emulate "$P" "${json[@]}" \
    >"$B/run.log" 2>&1 || status=1
  cat "$B/run.log" >>"$OUT/emulate_$who.log"
  grep -E "bigdn|slowest|stack of  8" "$B/run.log"
done
# Per-kernel device times (ncu serialises kernels: these are each kernel alone).
ncu_rows() {  # who rows...
  local who=$1
  shift
  for row in "$@"; do
    LD_LIBRARY_PATH="$B/libs/$who" timeout 240 "$NCU" --clock-control none --profile-from-start off \
      --metrics gpu__time_duration.sum --csv --print-units base \
      "$B/bench/gdncp_bench" --cp --emulate "$P" --profile-row "$row" --warmup 2 --iters 2 \
      >"$B/ncu_raw.csv" 2>"$B/ncu_err.log" || { echo "ncu row $row FAILED"; tail -5 "$B/ncu_err.log"; continue; }
    echo "--- ncu $who row $row: kernels of 2 steps, device ns per step"
    awk -F'","' '/^"/ && !kn { for (i = 1; i <= NF; i++) { h = $i; gsub(/"/, "", h); if (h == "Kernel Name") kn = i;
        if (h == "Metric Value") mv = i }; next }
      /^"/ && /gpu__time_duration/ { n=$kn; gsub(/\(.*$/,"",n); v=$mv; gsub(/[",]/,"",v); t[n]+=v/2; c[n]+=0.5; s+=v/2 }
      END { for (k in t) printf "  %10.0f ns %5.1f x  %s\n", t[k], c[k], k; printf "  %10.0f ns total\n", s }' \
      "$B/ncu_raw.csv" | sort -rn
  done
}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/nsight-compute*/ncu 2>/dev/null | head -1)
if [ -n "${NCU_ROWS:-}" ] && [ -n "$NCU" ]; then
  for who in ours $([ -n "${NCU_BASE:-}" ] && echo "$bases"); do ncu_rows $who $NCU_ROWS; done
  if [ -n "${SWEEP_DETAIL:-}" ]; then
    first=${SWEEP_ROW:-3}
    LD_LIBRARY_PATH="$B/libs/ours" timeout 240 "$NCU" --clock-control none --profile-from-start off \
      --kernel-name regex:sweep_kernel --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section MemoryWorkloadAnalysis --section LaunchStats \
      "$B/bench/gdncp_bench" --cp --emulate "$P" --profile-row "$first" --warmup 1 --iters 1 \
      >"$OUT/ncu_sweep.txt" 2>&1 || echo "ncu sweep detail FAILED"
    grep -E "sweep_kernel|Duration|Warp Cycles Per Issued|Issued Warp|Achieved Occupancy|No Eligible|Stall|L2 Hit|Registers|Block Size|Grid Size|Memory Throughput|Compute \(SM\)" \
      "$OUT/ncu_sweep.txt" | head -60
  fi
fi
echo "cp_emulate: $([ $status -eq 0 ] && echo OK || echo FAILURES)"
exit $status

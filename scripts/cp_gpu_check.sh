#!/usr/bin/env bash
# On a machine with NVIDIA GPUs: build gdncp with CUDA, time the CP scan kernels
# (bench/scan_bench.cpp, one GPU), run the CP GPU tests (tests/mpi_test_cp_gpu.cpp)
# on 1 and on NP GPUs, and the CP layer benchmark (bench/cp_bench.cpp, built
# standalone) on NP GPUs. Logs and JSON go to $OUT (at most 8 files).
#
#   scripts/cp_gpu_check.sh                      # NP = number of GPUs (at most 2)
#   NP=2 BENCH_ARGS="--iters 20 --warmup 3" OUT=/tmp/cp scripts/cp_gpu_check.sh
#   LEGACY_DIR=old/src/cp scripts/cp_gpu_check.sh
#       also: swap in scan.cu and cp_cuda.cuh from LEGACY_DIR, rebuild the library
#       and time the scan kernels again with the same scan_bench binary (before/after
#       in one run); the sources are restored afterwards.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/cp_gpu_out}
BUILD_DIR=${BUILD_DIR:-build-cp-gpu}
JOBS=${JOBS:-$(nproc)}
BENCH_ARGS=${BENCH_ARGS:-}
LEGACY_DIR=${LEGACY_DIR:-}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PATH="$PATH:/usr/local/cuda/bin"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
NP=${NP:-$((NGPU < 2 ? NGPU : 2))}
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
: >"$OUT/summary.txt"
say "== $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $NGPU GPUs, NP=$NP"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader 2>/dev/null | head -2 |
  tee -a "$OUT/summary.txt"
[ "$NP" -ge 1 ] || { say "no GPU"; exit 1; }

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
standalone() {  # name: bench/<name>.cpp linked against the library
  mpicxx -O2 -std=c++17 -DOMPI_SKIP_MPICXX -DGDNCP_CP_BENCH_MAIN -Iinclude -Isrc -I/usr/local/cuda/include \
    "bench/$1.cpp" -o "$BUILD_DIR/$1" -L"$BUILD_DIR" -lgdncp -L/usr/local/cuda/lib64 -lcudart \
    -Wl,-rpath,"$PWD/$BUILD_DIR" >>"$OUT/build.log" 2>&1 || say "$1 build failed"
}
t0=$(date +%s)
{
  cmake -S . -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DGDNCP_CUDA=ON -DGDNCP_BUILD_EXAMPLES=OFF \
    -DGDNCP_BUILD_BENCH=OFF -DCMAKE_CUDA_ARCHITECTURES=90-real &&
    cmake --build "$BUILD_DIR" -j "$JOBS" --target gdncp mpi_test_cp_gpu
} >"$OUT/build.log" 2>&1
rc=$?
say "build: rc=$rc in $(($(date +%s) - t0)) s"
[ $rc -eq 0 ] || { tail -30 "$OUT/build.log"; exit 1; }
standalone cp_bench
standalone scan_bench

status=0
scan_ok=0
if [ -x "$BUILD_DIR/scan_bench" ]; then  # first: a quick smoke test of the scan kernels (no NCCL)
  t0=$(date +%s)
  timeout 40 "$BUILD_DIR/scan_bench" >"$OUT/scan_bench.log" 2>&1
  rc=$?
  say "scan_bench: rc=$rc in $(($(date +%s) - t0)) s"
  cat "$OUT/scan_bench.log" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] && scan_ok=1 || status=1
fi

for np in 1 $NP; do
  [ "$np" -le "$NP" ] || continue
  t0=$(date +%s)
  timeout 90 mpirun -np "$np" --bind-to none "$BUILD_DIR/tests/mpi_test_cp_gpu" >"$OUT/test_np$np.log" 2>&1
  rc=$?
  say "mpi_test_cp_gpu np=$np: rc=$rc in $(($(date +%s) - t0)) s; $(grep -E 'PASSED|FAILED  \]' "$OUT/test_np$np.log" | head -3 | tr '\n' ' ')"
  grep -E "rel_l2|rel L2|Failure|FAILED|rank [0-9]\]" "$OUT/test_np$np.log" | head -20 >>"$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
  [ "$NP" -eq 1 ] && break
done

if [ -x "$BUILD_DIR/cp_bench" ] && [ $scan_ok -eq 1 ]; then
  t0=$(date +%s)
  timeout 120 mpirun -np "$NP" --bind-to none "$BUILD_DIR/cp_bench" $BENCH_ARGS --json "$OUT/cp_bench.json" \
    >"$OUT/bench.log" 2>&1
  rc=$?
  say "cp_bench np=$NP: rc=$rc in $(($(date +%s) - t0)) s"
  cat "$OUT/bench.log" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
fi

if [ -n "$LEGACY_DIR" ] && [ -f "$LEGACY_DIR/scan.cu" ] && [ -x "$BUILD_DIR/scan_bench" ]; then
  t0=$(date +%s)
  mkdir -p "$BUILD_DIR/current"
  cp src/cp/scan.cu src/cp/cp_cuda.cuh "$BUILD_DIR/current/"
  cp "$LEGACY_DIR/scan.cu" "$LEGACY_DIR/cp_cuda.cuh" src/cp/
  {
    timeout 90 cmake --build "$BUILD_DIR" -j "$JOBS" --target gdncp >>"$OUT/build.log" 2>&1 &&
      timeout 40 "$BUILD_DIR/scan_bench"
  } >"$OUT/legacy.log" 2>&1
  rc=$?
  cp "$BUILD_DIR/current/scan.cu" "$BUILD_DIR/current/cp_cuda.cuh" src/cp/
  say "legacy scan kernels ($LEGACY_DIR): rc=$rc in $(($(date +%s) - t0)) s"
  cat "$OUT/legacy.log" | tee -a "$OUT/summary.txt"
fi
exit $status

#!/usr/bin/env bash
# On a machine with NVIDIA GPUs: build gdncp with CUDA, run the CP GPU tests
# (tests/mpi_test_cp_gpu.cpp) on 1 and on NP GPUs, and the CP benchmark
# (bench/cp_bench.cpp, built standalone) on NP GPUs. Logs and JSON go to $OUT.
#
#   scripts/cp_gpu_check.sh                      # NP = number of GPUs (at most 2)
#   NP=2 BENCH_ARGS="--iters 20 --warmup 3" OUT=/tmp/cp scripts/cp_gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/cp_gpu_out}
BUILD_DIR=${BUILD_DIR:-build-cp-gpu}
JOBS=${JOBS:-$(nproc)}
BENCH_ARGS=${BENCH_ARGS:-}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PATH="$PATH:/usr/local/cuda/bin"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
NP=${NP:-$((NGPU < 2 ? NGPU : 2))}
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
: >"$OUT/summary.txt"
say "== $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $NGPU GPUs, NP=$NP"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -2 | tee -a "$OUT/summary.txt"
[ "$NP" -ge 1 ] || { say "no GPU"; exit 1; }

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
t0=$(date +%s)
{
  cmake -S . -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DGDNCP_CUDA=ON -DGDNCP_BUILD_EXAMPLES=OFF \
    -DGDNCP_BUILD_BENCH=OFF -DCMAKE_CUDA_ARCHITECTURES=90-real &&
    cmake --build "$BUILD_DIR" -j "$JOBS" --target gdncp mpi_test_cp_gpu
} >"$OUT/build.log" 2>&1
rc=$?
say "build: rc=$rc in $(($(date +%s) - t0)) s"
[ $rc -eq 0 ] || { tail -30 "$OUT/build.log"; exit 1; }
NCCL_INC=$(sed -n 's/^NCCL_INCLUDE_DIR:PATH=//p' "$BUILD_DIR/CMakeCache.txt")
NCCL_LIB=$(sed -n 's/^NCCL_LIBRARY:FILEPATH=//p' "$BUILD_DIR/CMakeCache.txt")
mpicxx -O3 -std=c++17 -DOMPI_SKIP_MPICXX -DGDNCP_CP_BENCH_MAIN -Iinclude -I/usr/local/cuda/include -I"$NCCL_INC" \
  bench/cp_bench.cpp -o "$BUILD_DIR/cp_bench" -L"$BUILD_DIR" -lgdncp -L/usr/local/cuda/lib64 -lcudart "$NCCL_LIB" \
  -Wl,-rpath,"$PWD/$BUILD_DIR" >>"$OUT/build.log" 2>&1 || { say "cp_bench build failed"; tail -20 "$OUT/build.log"; }

status=0
for np in 1 $NP; do
  [ "$np" -le "$NP" ] || continue
  t0=$(date +%s)
  timeout 240 mpirun -np "$np" --bind-to none "$BUILD_DIR/tests/mpi_test_cp_gpu" >"$OUT/test_np$np.log" 2>&1
  rc=$?
  say "mpi_test_cp_gpu np=$np: rc=$rc in $(($(date +%s) - t0)) s; $(grep -E 'PASSED|FAILED  \]' "$OUT/test_np$np.log" | head -3 | tr '\n' ' ')"
  grep -E "rel_l2|Failure|FAILED|rank [0-9]\]" "$OUT/test_np$np.log" | head -20 >>"$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
  [ "$NP" -eq 1 ] && break
done

if [ -x "$BUILD_DIR/cp_bench" ]; then
  t0=$(date +%s)
  timeout 240 mpirun -np "$NP" --bind-to none "$BUILD_DIR/cp_bench" $BENCH_ARGS --json "$OUT/cp_bench.json" \
    >"$OUT/bench.log" 2>&1
  rc=$?
  say "cp_bench np=$NP: rc=$rc in $(($(date +%s) - t0)) s"
  cat "$OUT/bench.log" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
fi
exit $status

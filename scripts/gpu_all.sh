#!/usr/bin/env bash
# The whole GPU check in one go, for a machine with 1-2 NVIDIA GPUs (one device
# lease): build everything with CUDA, run every test (CPU, GPU, MPI with NCCL on
# 1 and 2 GPUs), the single-GPU benchmark, the CP benchmark on 2 GPUs, and the
# trainer at a production-like shape on 1 and 2 GPUs. Logs go to $OUT (at most
# 8 files). Steps run in order of value and each has a time limit, so a short
# lease still brings back the most important results.
#   OUT=/tmp/out scripts/gpu_all.sh
# Knobs: BUILD_DIR, JOBS, BENCH_ARGS, TRAIN_STEPS, SKIP_SANITIZER. An A/B of the CP benchmark
# against another tree in one call: scripts/cp_quick.sh with BASE_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_all_out}
BUILD_DIR=${BUILD_DIR:-build-gpu}
JOBS=${JOBS:-$(nproc)}
TRAIN_STEPS=${TRAIN_STEPS:-12}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PATH="$PATH:/usr/local/cuda/bin"
S="$OUT/summary.txt"
: >"$S"
say() { echo "$*" | tee -a "$S"; }
status=0
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NP=$((NGPU < 2 ? NGPU : 2))
say "== $(date -u '+%Y-%m-%d %H:%M:%S UTC') $(uname -r) $(nproc) cores, $NGPU GPUs; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader 2>&1 | tee -a "$S"
[ "$NGPU" -ge 1 ] || { say "no GPU"; exit 1; }

# --- build -----------------------------------------------------------------------------
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
t0=$(date +%s)
{ cmake -S . -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DGDNCP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real &&
  cmake --build "$BUILD_DIR" -j "$JOBS"; } >"$OUT/build.log" 2>&1 || { say "build FAILED"; tail -40 "$OUT/build.log"; exit 1; }
say "build: ok in $(($(date +%s) - t0)) s"

# --- every test (GPU ones no longer skip) ------------------------------------------------
t0=$(date +%s)
timeout 420 ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 300 -j 4 >"$OUT/ctest.log" 2>&1 || status=1
say "ctest: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1) in $(($(date +%s) - t0)) s"
grep -E "\*\*\*Failed|Timeout|Not Run" "$OUT/ctest.log" | head -20 | tee -a "$S"
say "skipped: $(grep -c 'Skipped' "$OUT/ctest.log")"

# --- single-GPU benchmark -----------------------------------------------------------------
t0=$(date +%s)
timeout 180 "$BUILD_DIR/bench/gdncp_bench" --json "$OUT/bench.json" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1 || status=1
say "gdncp_bench: rc=$? in $(($(date +%s) - t0)) s"
grep -E "^B=|forward|validate|floor|ceiling|copy|GEMM" "$OUT/bench.log" | head -40 | tee -a "$S"

# --- CP benchmark on 2 GPUs -------------------------------------------------------------
if [ "$NP" -ge 2 ]; then
  t0=$(date +%s)
  timeout 180 mpirun -np 2 --bind-to none "$BUILD_DIR/bench/gdncp_bench" --cp --json "$OUT/cp_bench.json" \
    >"$OUT/cp_bench.log" 2>&1 || status=1
  say "gdncp_bench --cp (2 GPUs): in $(($(date +%s) - t0)) s"
  tail -30 "$OUT/cp_bench.log" | tee -a "$S"
fi

# --- the trainer at a production-like shape: CP=1 on 1 GPU vs CP=2 on 2 GPUs --------------
# lr 1e-3: the trainer's default 0.02 suits its small default model and makes
# AdamW diverge at C = H·D = 2240 channels.
train() {  # ranks, cp, frames
  timeout 150 mpirun -np "$1" --bind-to none "$BUILD_DIR/examples/gdncp_train" --device cuda --dtype bf16 \
    --heads 20 --head-dim 112 --tokens 920 --frames "$3" --cp "$2" --layers 2 --batch 1 --pool 2 \
    --lr 1e-3 --steps "$TRAIN_STEPS" --warmup 2 --print-every 2 --log "$OUT/train_np$1.jsonl" --plot ''
}
{
  echo "### 1 GPU, CP=1, 11 frames"; train 1 1 11
  if [ "$NP" -ge 2 ]; then
    echo "### 2 GPUs, CP=2, 22 frames (11 per rank)"; train 2 2 22
    echo "### 2 GPUs, CP=1 x DP=2, 11 frames each"; train 2 1 11
  fi
} >"$OUT/train.log" 2>&1 || status=1
say "train:"
grep -E "^###|step +$TRAIN_STEPS/|done:|rror" "$OUT/train.log" | tee -a "$S"
rm -f "$OUT"/train_np*.jsonl

# --- compute-sanitizer over the kernel twins (small shapes) ------------------------------
if [ "${SKIP_SANITIZER:-0}" != 1 ] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    t0=$(date +%s)
    GDNCP_TEST_SMALL=1 timeout 150 compute-sanitizer --tool $tool --error-exitcode 7 \
      "$BUILD_DIR/tests/test_cuda_kernels" --gtest_brief=1 >>"$OUT/sanitizer.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || status=1
    say "compute-sanitizer $tool: rc=$rc in $(($(date +%s) - t0)) s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer.log" | tail -1)"
  done
fi
say "gpu_all: $([ $status -eq 0 ] && echo OK || echo FAILURES)"
exit $status

#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: configure and build gdncp with CUDA (ninja when
# present), run the GPU tests (ctest), run gdncp_bench, optionally profile one
# forward+backward with Nsight Compute (NCU=1), and run the tests again under
# compute-sanitizer (memcheck and racecheck must report 0 errors; small shapes,
# GDNCP_TEST_SMALL=1). Logs and the bench JSON go to $OUT (default ./gpu_check_out),
# at most 8 files:
#   summary.txt (machine + results) build.log ctest.log bench.log bench.json ncu.log memcheck.log racecheck.log
#
#   scripts/gpu_check.sh                 # everything but ncu
#   NCU=1 SKIP_SANITIZER=1 BENCH_ARGS="--quick" CTEST_REGEX="Cuda" scripts/gpu_check.sh
# Knobs: BUILD_DIR, JOBS, CTEST_REGEX, BENCH_ARGS, SKIP_BENCH, NCU, SKIP_SANITIZER,
#        SANITIZER_FILTER (gtest filter), SANITIZER_TIMEOUT (s per tool).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
BUILD_DIR=${BUILD_DIR:-build-gpu}
JOBS=${JOBS:-$(nproc)}
CTEST_REGEX=${CTEST_REGEX:-Cuda}
BENCH_ARGS=${BENCH_ARGS:-}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PATH="$PATH:/usr/local/cuda/bin"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
status=0

# --- what this machine has ------------------------------------------------------
{
  echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC')  $(uname -srm)  $(nproc) cores"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv
    nvidia-smi topo -m 2>/dev/null | head -5
  else echo "nvidia-smi: not found"; fi
  for t in nvcc cmake ninja g++ mpirun compute-sanitizer ncu; do
    if command -v $t >/dev/null; then echo "$t: $(command -v $t): $($t --version 2>&1 | grep -m1 -iE 'release|version|[0-9]+\.[0-9]+')"
    else echo "$t: not found"; fi
  done
  ls -d /usr/src/googletest 2>/dev/null || echo "no /usr/src/googletest"
} >>"$SUMMARY" 2>&1
cat "$SUMMARY"
command -v nvcc >/dev/null || { say "FAIL: nvcc not found"; exit 1; }

# --- build ------------------------------------------------------------------------
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
t0=$(date +%s)
{
  cmake -S . -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DGDNCP_CUDA=ON ${CMAKE_ARGS:-} &&
    cmake --build "$BUILD_DIR" -j "$JOBS" --target gdncp test_cuda_kernels test_tensor gdncp_bench
} >"$OUT/build.log" 2>&1
rc=$?
say "build: rc=$rc in $(($(date +%s) - t0)) s"
if [ $rc -ne 0 ]; then tail -40 "$OUT/build.log"; exit 1; fi

# --- GPU tests ----------------------------------------------------------------------
t0=$(date +%s)
ctest --test-dir "$BUILD_DIR" -R "$CTEST_REGEX" --output-on-failure --timeout 900 >"$OUT/ctest.log" 2>&1
rc=$?
say "ctest -R '$CTEST_REGEX': rc=$rc in $(($(date +%s) - t0)) s; $(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1)"
grep -E "rel L2 error|Failure|FAILED|Skipped" "$OUT/ctest.log" | head -20 | tee -a "$SUMMARY"
[ $rc -eq 0 ] || status=1

# --- benchmark ----------------------------------------------------------------------
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  t0=$(date +%s)
  "$BUILD_DIR/bench/gdncp_bench" --json "$OUT/bench.json" $BENCH_ARGS >"$OUT/bench.log" 2>&1
  rc=$?
  say "gdncp_bench $BENCH_ARGS: rc=$rc in $(($(date +%s) - t0)) s"
  [ $rc -eq 0 ] || status=1
  cat "$OUT/bench.log"
fi
# --- Nsight Compute: one forward+backward at B=1, D=112 ----------------------------
if [ "${NCU:-0}" = 1 ]; then
  if command -v ncu >/dev/null; then
    t0=$(date +%s)
    timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none -k regex:'phase_|scan_|rms_' --section SpeedOfLight \
      --section Occupancy --section LaunchStats --section WarpStateStats \
      "$BUILD_DIR/bench/gdncp_bench" --profile --batches 1 --dims 112 >"$OUT/ncu.log" 2>&1
    say "ncu: rc=$? in $(($(date +%s) - t0)) s"
  else
    say "ncu: not found"
  fi
fi

# --- compute-sanitizer: memcheck and racecheck ------------------------------------
if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
      t0=$(date +%s)
      GDNCP_TEST_SMALL=1 timeout "${SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool $tool --error-exitcode 3 \
        "$BUILD_DIR/tests/test_cuda_kernels" --gtest_filter="${SANITIZER_FILTER:-Cuda*}" >"$OUT/$tool.log" 2>&1
      rc=$?
      say "compute-sanitizer $tool: rc=$rc in $(($(date +%s) - t0)) s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -1)"
      [ $rc -eq 0 ] || status=1
    done
  else
    say "compute-sanitizer: not found, sanitizer runs skipped"
  fi
fi

say "gpu_check: $([ $status -eq 0 ] && echo OK || echo FAILED)"
exit $status

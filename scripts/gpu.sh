#!/usr/bin/env bash
# The GPU entry point: build gdncp with CUDA and run one or more suites on the
# NVIDIA GPUs of this machine. Logs (and JSON) go to $OUT, a summary to $OUT/summary.txt.
#
#   scripts/gpu.sh <suite>...        suites:
#     tests     every ctest entry (ctest -j 4)
#     kernels   the single-GPU tests (ctest -R "$CTEST_REGEX", default Cuda: the CUDA twins
#               against the CPU twins, the layer against the f64 CPU layer); NCU=1 adds an
#               Nsight Compute profile of one forward+backward of the layer; NCU_SOURCE=<kernel
#               regex> adds the source view of the first matching kernel, summed by CUDA line
#               (bench/ncu_lines.py: where its instructions and stalls go; builds with -lineinfo)
#     cp        the CP GPU tests (mpi_test_cp_gpu) on 1 and $NP GPUs; the CP layer benchmark
#               (gdncp_bench --cp) on $NP GPUs, or with one GPU the emulated rank of a group
#               of $EMULATE (gdncp_bench --cp --emulate, stand-in peers), NCU_ROWS adding
#               per-kernel device times of those rows under ncu, with the CP_BENCH_ARGS
#               of the timed rows (SWEEP_DETAIL=1: ncu sections of the scan's sweep kernel)
#     train     gdncp_train at a production-like shape (bf16, H=20, D=112, 920 tokens a
#               frame) on 1 GPU, and with 2 GPUs as CP=2 and as DP=2
#     sanitize  compute-sanitizer memcheck, racecheck and initcheck over the CUDA twin
#               tests (small shapes, GDNCP_TEST_SMALL=1); each must report 0 errors
#     bench     gdncp_bench (the layer on one GPU) and scan_bench (the CP scan kernels)
#     door      the Python door: its CPU and CUDA tests under faulthandler, then its overhead
#               over the C++ entry (python/examples/bench_door.py, bar 5 %)
#     scaling   the measured inputs of scripts/scaling_model.py (docs/scaling.md): emulated
#               ranks of P = 2, 4, 8 over 11 frames each, and of 8 over 84 frames with modeled
#               NVLink, all-gather and log-depth exchanges (gdncp_bench --cp --emulate); and
#               the log exchange's device work alone (no link time) at P = 4, 8, 16 over 11
#               frames a rank: 2, 3 and 4 rounds, so that a round's work and a call's fixed
#               part can be told apart
#     all       every test (ctest), then bench, door, cp, train, sanitize
#
# A/B against a base commit: BASE=<commit> checks BASE out with `git worktree add`
# (in $BASE_DIR/tree, default build-gpu-base/tree), builds it in its own build dir
# ($BASE_DIR/build) and runs each benchmark alternating ours and base (ours, base, ours,
# base) in the same call. The working tree's sources are never touched.
#
#   OUT=/tmp/out scripts/gpu.sh all
#   BASE=HEAD~3 OUT=/tmp/out scripts/gpu.sh bench cp
#   NCU_ROWS="1 3" EMULATE=2 scripts/gpu.sh cp        # one GPU: rows 1 and 3 of the emulated table
#   NCU_ROWS="2 3 4" EMULATE=4 CP_BENCH_ARGS="--frames 44" scripts/gpu.sh cp   # one GPU at 1, an end, a middle
# Knobs: OUT, BUILD_DIR, JOBS, NP (GPUs for cp/train, default min(#GPUs, 2)), CTEST_REGEX,
#        BENCH_ARGS (gdncp_bench), CP_BENCH_ARGS (gdncp_bench --cp), EMULATE, NCU, NCU_SOURCE, NCU_ROWS,
#        NCU_BASE, SWEEP_DETAIL, SWEEP_ROW, TRAIN_STEPS, SANITIZER_FILTER, SANITIZER_TIMEOUT,
#        BASE, BASE_DIR.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
[ $# -ge 1 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
suites=()
for s in "$@"; do
  case $s in
    tests | kernels | cp | train | sanitize | bench | door | scaling) suites+=("$s") ;;
    all) suites+=(tests bench door cp train sanitize) ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu.sh: unknown suite '$s' (tests, kernels, cp, train, sanitize, bench, door, scaling, all)"; exit 2 ;;
  esac
done

OUT=${OUT:-$ROOT/gpu_out}
BUILD_DIR=${BUILD_DIR:-build-gpu}
BASE_DIR=${BASE_DIR:-build-gpu-base}
JOBS=${JOBS:-$(nproc)}
TRAIN_STEPS=${TRAIN_STEPS:-12}
mkdir -p "$OUT"
# NVLink SHARP (NVLS) multicast stays off: its buffers fail on the lent machines.
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PATH="$PATH:/usr/local/cuda/bin"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
status=0
fail() { status=1; }

NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NP=${NP:-$((NGPU < 2 ? NGPU : 2))}
P=${EMULATE:-2}
say "== $(date -u '+%Y-%m-%d %H:%M:%S UTC') $(uname -r) $(nproc) cores, $NGPU GPUs; git $(git rev-parse --short HEAD 2>/dev/null || echo '?'); suites: ${suites[*]}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$SUMMARY"
[ "$NGPU" -ge 1 ] || { say "no GPU"; exit 1; }
has() { local s; for s in "${suites[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

# --- build: ours, and BASE's tree when given ----------------------------------------------------
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
targets=()
has tests && targets=(all)
if [ ${#targets[@]} -eq 0 ]; then
  has kernels && targets+=(test_cuda_kernels test_cp_cuda_kernels test_nn_cuda gdncp_bench)
  has cp && targets+=(mpi_test_cp_gpu gdncp_bench scan_bench)
  has train && targets+=(gdncp_train)
  has sanitize && targets+=(test_cuda_kernels test_cp_cuda_kernels test_nn_cuda)
  has bench && targets+=(gdncp_bench scan_bench)
  has door && targets+=(gdncp door_reference)
  has scaling && targets+=(gdncp_bench)
fi
build() {  # source-dir build-dir targets...
  local src=$1 dir=$2
  shift 2
  cmake -S "$src" -B "$dir" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DGDNCP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
    -DCMAKE_CUDA_FLAGS="${NCU_SOURCE:+-lineinfo}" &&
    cmake --build "$dir" -j "$JOBS" --target "$@"
}
t0=$(date +%s)
mapfile -t targets < <(printf '%s\n' "${targets[@]}" | sort -u)
build . "$BUILD_DIR" "${targets[@]}" >"$OUT/build.log" 2>&1 ||
  { say "build FAILED"; tail -40 "$OUT/build.log"; exit 1; }
say "build: ok in $(($(date +%s) - t0)) s"

case $BASE_DIR in /*) ;; *) BASE_DIR=$ROOT/$BASE_DIR ;; esac
BASE_TREE=$BASE_DIR/tree
BASE_BUILD=$BASE_DIR/build
who_list="ours"
if [ -n "${BASE:-}" ] && { has bench || has cp; }; then
  t0=$(date +%s)
  {
    git worktree remove --force "$BASE_TREE" 2>/dev/null
    rm -rf "$BASE_TREE"
    git worktree prune
    mkdir -p "$BASE_DIR"
    git worktree add --detach "$BASE_TREE" "$BASE" &&
      # Each target on its own: an older base may lack one (scan_bench).
      for t in gdncp_bench scan_bench; do build "$BASE_TREE" "$BASE_BUILD" "$t" || echo "base: no $t"; done
  } >"$OUT/base_build.log" 2>&1
  if [ -x "$BASE_BUILD/bench/gdncp_bench" ]; then
    who_list="ours base ours base"
    say "base $BASE ($(git rev-parse --short "$BASE")): built in $(($(date +%s) - t0)) s"
  else
    say "base $BASE: build FAILED (see base_build.log)"
    fail
  fi
fi
bin() {  # who name: the benchmark binary of ours or base
  if [ "$1" = base ]; then echo "$BASE_BUILD/bench/$2"; else echo "$ROOT/$BUILD_DIR/bench/$2"; fi
}

# --- tests ----------------------------------------------------------------------------------
run_ctest() {  # log regex...
  local log=$1 t0
  shift
  t0=$(date +%s)
  timeout 900 ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 300 "$@" >"$OUT/$log" 2>&1 || fail
  say "ctest $*: $(grep -E 'tests passed|tests failed' "$OUT/$log" | tail -1) in $(($(date +%s) - t0)) s"
  grep -E "\*\*\*Failed|Timeout|rel L2 error" "$OUT/$log" | head -20 | tee -a "$SUMMARY"
  say "skipped: $(grep -cE 'Skipped|Not Run' "$OUT/$log")"
}
has tests && run_ctest ctest.log -j 4
has kernels && run_ctest ctest_kernels.log -R "${CTEST_REGEX:-Cuda}"
if has kernels && [ "${NCU:-0}" = 1 ]; then
  t0=$(date +%s)
  timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none -k regex:'phase_|scan_|rms_' --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats \
    "$(bin ours gdncp_bench)" --profile --batches 1 --dims 112 >"$OUT/ncu.log" 2>&1 || fail
  say "ncu gdncp_bench --profile: in $(($(date +%s) - t0)) s (ncu.log)"
fi
if has kernels && [ -n "${NCU_SOURCE:-}" ]; then
  t0=$(date +%s)
  timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none -k "regex:$NCU_SOURCE" -c 1 --section SourceCounters \
    --page source --print-source sass,cuda --csv "$(bin ours gdncp_bench)" --profile --batches 1 --dims 112 \
    >"$OUT/ncu_source.csv" 2>"$OUT/ncu_source.err" || fail
  say "ncu source view of $NCU_SOURCE: in $(($(date +%s) - t0)) s (ncu_source.csv)"
  python3 bench/ncu_lines.py "$OUT/ncu_source.csv" --top 25 | tee -a "$SUMMARY"
fi

# --- bench: the layer on one GPU, the CP scan kernels ----------------------------------------
if has bench; then
  for who in $who_list; do
    t0=$(date +%s)
    timeout 180 "$(bin $who gdncp_bench)" --json "$OUT/bench_$who.json" ${BENCH_ARGS:-} >>"$OUT/bench_$who.log" 2>&1 || fail
    say "### $who gdncp_bench ${BENCH_ARGS:-}: $(($(date +%s) - t0)) s"
    grep -E "^B=|forward|validate|floor|ceiling" "$OUT/bench_$who.log" | tail -20 | tee -a "$SUMMARY"
    if [ -x "$(bin $who scan_bench)" ]; then
      timeout 60 "$(bin $who scan_bench)" >>"$OUT/scan_bench_$who.log" 2>&1 || fail
      say "### $who scan_bench"
      tail -25 "$OUT/scan_bench_$who.log" | tee -a "$SUMMARY"
    fi
  done
fi

# --- door: the Python door's tests and its overhead over the C++ entry -------------------------
if has door; then
  PY=$(sed -n 's/^Python3_EXECUTABLE:[A-Z]*=//p' "$BUILD_DIR/CMakeCache.txt")
  export PYTHONPATH="$ROOT/$BUILD_DIR/python" GDNCP_DOOR_REFERENCE="$ROOT/$BUILD_DIR/tests/door_reference"
  t0=$(date +%s)
  timeout 300 "${PY:-python3}" -X faulthandler -m pytest -q -p no:cacheprovider python/tests/test_python_cpu.py \
    python/tests/test_python_cuda.py >"$OUT/door_pytest.log" 2>&1 || fail
  say "door pytest (cpu, cuda; ${PY:-python3}): $(tail -1 "$OUT/door_pytest.log") in $(($(date +%s) - t0)) s"
  grep -E "Fatal Python error|Segmentation|File \"" "$OUT/door_pytest.log" | head -12 | tee -a "$SUMMARY"
  timeout 300 "${PY:-python3}" python/examples/bench_door.py --json "$OUT/door.json" >"$OUT/door_bench.log" 2>&1 || fail
  say "### bench_door"
  tail -8 "$OUT/door_bench.log" | tee -a "$SUMMARY"
fi

# --- cp: the CP GPU tests and the CP layer benchmark -----------------------------------------
ncu_rows() {  # who rows...: per-kernel device times (ncu serialises kernels: each kernel alone)
  local who=$1 row
  shift
  for row in "$@"; do
    timeout 240 "$NCU" --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
      --print-units base "$(bin $who gdncp_bench)" --cp --emulate "$P" ${CP_BENCH_ARGS:-} --profile-row "$row" \
      --warmup 2 --iters 2 \
      >"$OUT/ncu_raw.csv" 2>"$OUT/ncu_err.log" || { say "ncu row $row FAILED"; tail -5 "$OUT/ncu_err.log"; continue; }
    say "--- ncu $who row $row: kernels of 2 steps, device ns per step"
    awk -F'","' '/^"/ && !kn { for (i = 1; i <= NF; i++) { h = $i; gsub(/"/, "", h); if (h == "Kernel Name") kn = i;
        if (h == "Metric Value") mv = i }; next }
      /^"/ && /gpu__time_duration/ { n=$kn; gsub(/\(.*$/,"",n); v=$mv; gsub(/[",]/,"",v); t[n]+=v/2; c[n]+=0.5; s+=v/2 }
      END { for (k in t) printf "  %10.0f ns %5.1f x  %s\n", t[k], c[k], k; printf "  %10.0f ns total\n", s }' \
      "$OUT/ncu_raw.csv" | sort -rn | tee -a "$SUMMARY"
  done
  rm -f "$OUT/ncu_raw.csv"
}
if has cp; then
  for np in 1 $NP; do
    t0=$(date +%s)
    timeout 300 mpirun -np "$np" --bind-to none "$BUILD_DIR/tests/mpi_test_cp_gpu" --gtest_color=no \
      >"$OUT/cp_test_np$np.log" 2>&1 || fail
    say "mpi_test_cp_gpu np=$np: $(($(date +%s) - t0)) s; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/cp_test_np$np.log" | tr '\n' ' ')"
    grep -E "rel L2|Failure|rank [0-9]\]" "$OUT/cp_test_np$np.log" | head -20 | tee -a "$SUMMARY"
    [ "$NP" -le 1 ] && break
  done
  for who in $who_list; do
    t0=$(date +%s)
    if [ "$NP" -ge 2 ]; then
      timeout 180 mpirun -np "$NP" --bind-to none "$(bin $who gdncp_bench)" --cp --json "$OUT/cp_bench_$who.json" \
        ${CP_BENCH_ARGS:-} >>"$OUT/cp_bench_$who.log" 2>&1 || fail
      say "### $who gdncp_bench --cp on $NP GPUs: $(($(date +%s) - t0)) s"
      grep -E "bigdn_cp P=1  |P=$NP strong|scaling|stack of  8|checkpointing bigdn_cp" "$OUT/cp_bench_$who.log" |
        tail -12 | tee -a "$SUMMARY"
    else
      timeout 180 "$(bin $who gdncp_bench)" --cp --emulate "$P" --json "$OUT/cp_emulate_$who.json" ${CP_BENCH_ARGS:-} \
        >>"$OUT/cp_emulate_$who.log" 2>&1 || fail
      say "### $who gdncp_bench --cp --emulate $P: $(($(date +%s) - t0)) s"
      grep -E "bigdn|slowest|stack of  8" "$OUT/cp_emulate_$who.log" | tail -12 | tee -a "$SUMMARY"
    fi
  done
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/nsight-compute*/ncu 2>/dev/null | head -1)
  if [ -n "${NCU_ROWS:-}" ] && [ -n "$NCU" ]; then
    whos=ours
    [ -n "${NCU_BASE:-}" ] && [ "$who_list" != "ours" ] && whos="ours base"
    for who in $whos; do ncu_rows $who $NCU_ROWS; done
    if [ -n "${SWEEP_DETAIL:-}" ]; then
      timeout 240 "$NCU" --clock-control none --profile-from-start off --kernel-name regex:sweep_kernel --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section LaunchStats \
        "$(bin ours gdncp_bench)" --cp --emulate "$P" ${CP_BENCH_ARGS:-} --profile-row "${SWEEP_ROW:-3}" \
        --warmup 1 --iters 1 \
        >"$OUT/ncu_sweep.txt" 2>&1 || say "ncu sweep detail FAILED"
      grep -E "sweep_kernel|Duration|Warp Cycles Per Issued|Issued Warp|Achieved Occupancy|No Eligible|Stall|L2 Hit|Registers|Block Size|Grid Size|Memory Throughput|Compute \(SM\)" \
        "$OUT/ncu_sweep.txt" | head -60 | tee -a "$SUMMARY"
    fi
  fi
fi

# --- scaling: the emulated ranks the scaling model takes as inputs ------------------------------
if has scaling; then
  for run in "2 22" "4 44" "8 88" "8 84 --link nvlink --exchange allgather" "8 84 --link nvlink --exchange log" \
    "4 44 --exchange log" "8 88 --exchange log" "16 176 --exchange log"; do
    set -- $run
    t0=$(date +%s)
    log="$OUT/scaling_$(echo "$run" | tr -s ' -' '_').log"
    timeout 300 "$(bin ours gdncp_bench)" --cp --emulate "$1" --frames "$2" --iters 20 "${@:3}" >"$log" 2>&1 || fail
    say "### gdncp_bench --cp --emulate $* ($(($(date +%s) - t0)) s)"
    grep -E "^  bigdn[^c]|^  bigdn_cp (P=1 F_0|rank)|^  off" "$log" | grep -v ckpt | tee -a "$SUMMARY"
  done
fi

# --- train: CP=1 on 1 GPU vs CP=2 and DP=2 on 2 GPUs -------------------------------------------
# lr 1e-3: the trainer's default 0.02 suits its small default model and makes
# AdamW diverge at C = H·D = 2240 channels.
train() {  # ranks cp frames
  timeout 150 mpirun -np "$1" --bind-to none "$BUILD_DIR/examples/gdncp_train" --device cuda --dtype bf16 \
    --heads 20 --head-dim 112 --tokens 920 --frames "$3" --cp "$2" --layers 2 --batch 1 --pool 2 \
    --lr 1e-3 --steps "$TRAIN_STEPS" --warmup 2 --print-every 2 --log "$OUT/train_np$1.jsonl" --plot ''
}
if has train; then
  {
    echo "### 1 GPU, CP=1, 11 frames"; train 1 1 11
    if [ "$NP" -ge 2 ]; then
      echo "### 2 GPUs, CP=2, 22 frames (11 per rank)"; train 2 2 22
      echo "### 2 GPUs, CP=1 x DP=2, 11 frames each"; train 2 1 11
    fi
  } >"$OUT/train.log" 2>&1 || fail
  say "train:"
  grep -E "^###|step +$TRAIN_STEPS/|done:|rror" "$OUT/train.log" | tee -a "$SUMMARY"
  rm -f "$OUT"/train_np*.jsonl
fi

# --- sanitize: compute-sanitizer over the CUDA twin tests --------------------------------------
if has sanitize; then
  if command -v compute-sanitizer >/dev/null; then
    # racecheck is the slow tool (minutes over test_cuda_kernels): it runs one test at a
    # time, so that a time limit costs one test's summary, not the binary's.
    for tool in memcheck racecheck initcheck; do
      for t in test_cuda_kernels test_cp_cuda_kernels test_nn_cuda; do
        filters=("${SANITIZER_FILTER:-*}")
        [ $tool = racecheck ] && [ -z "${SANITIZER_FILTER:-}" ] &&
          mapfile -t filters < <("$BUILD_DIR/tests/$t" --gtest_list_tests |
            awk '/^[A-Za-z]/ { suite = $1 } /^  [A-Za-z]/ { print suite $1 }')
        for filter in "${filters[@]}"; do
          t0=$(date +%s)
          log="$OUT/${tool}_$t.log"
          GDNCP_TEST_SMALL=1 timeout "${SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool $tool --error-exitcode 7 \
            "$BUILD_DIR/tests/$t" --gtest_brief=1 --gtest_filter="$filter" >>"$log" 2>&1
          rc=$?
          [ $rc -eq 0 ] || fail
          say "compute-sanitizer $tool $t $filter: rc=$rc in $(($(date +%s) - t0)) s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
        done
      done
    done
  else
    say "compute-sanitizer: not found"
    fail
  fi
fi

[ -n "${BASE:-}" ] && git worktree remove --force "$BASE_TREE" >/dev/null 2>&1
say "gpu.sh ${suites[*]}: $([ $status -eq 0 ] && echo OK || echo FAILURES)"
exit $status

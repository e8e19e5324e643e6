#!/usr/bin/env bash
# A short CP check on a machine with 2 GPUs: build the library, the CP GPU tests and the
# benchmark, run mpi_test_cp_gpu on 1 and 2 GPUs, then the CP benchmark (gdncp_bench --cp)
# alternating with another tree's when BASE_DIR is given (ours, base, ours, base: an A/B
# in one call). Logs go to $OUT.
#   OUT=/tmp/out BASE_DIR=.carry/base scripts/cp_quick.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/cp_quick_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PATH="$PATH:/usr/local/cuda/bin"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
build() {  # tree targets...
  local tree=$1
  shift
  (cd "$tree" && cmake -S . -B build-gpu "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DGDNCP_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90-real && cmake --build build-gpu -j "$(nproc)" --target "$@")
}
status=0
build . gdncp_bench mpi_test_cp_gpu >"$OUT/build.log" 2>&1 || { echo "build FAILED"; tail -30 "$OUT/build.log"; exit 1; }
for np in 1 2; do
  mpirun -np $np --oversubscribe --bind-to none build-gpu/tests/mpi_test_cp_gpu --gtest_color=no >"$OUT/test_np$np.log" 2>&1 || status=1
  echo "mpi_test_cp_gpu np$np: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/test_np$np.log" | sort | uniq -c | tr '\n' ' ')"
done
runs="ours ours"
if [ -n "${BASE_DIR:-}" ]; then
  if build "$BASE_DIR" gdncp_bench >"$OUT/base_build.log" 2>&1; then runs="ours base ours base"; else echo "base build FAILED"; fi
fi
for who in $runs; do
  bin=build-gpu/bench/gdncp_bench
  [ $who = base ] && bin="$BASE_DIR/build-gpu/bench/gdncp_bench"
  echo "### $who"
  timeout 120 mpirun -np 2 --bind-to none "$bin" --cp --json "$OUT/cp_$who.json" >"$OUT/cp_$who.log" 2>&1 || status=1
  grep -E "bigdn_cp P=1  |P=2 strong|scaling|stack of  8|checkpointing bigdn_cp P=2" "$OUT/cp_$who.log"
done
echo "cp_quick: $([ $status -eq 0 ] && echo OK || echo FAILURES)"
exit $status

#!/usr/bin/env bash
# Builds gdncp and runs every test (ctest): unit tests, fp64 gradchecks,
# multi-rank MPI tests (mpirun -np 1..4 --oversubscribe) and the
# find_package consumer. GPU tests skip themselves without a device.
#   scripts/test.sh            # build in ./build, run everything
#   BUILD_DIR=... JOBS=... CTEST_ARGS="-R Gradcheck" scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
# Everything runs as root in CI containers; mpirun refuses that unless told.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export NCCL_NVLS_ENABLE=0

cmake -S . -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "$JOBS"
# MPI tests oversubscribe the cores; run ctest serially so they do not starve each other.
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 1800 ${CTEST_ARGS:-}

#!/usr/bin/env bash
# Builds gdncp CPU-only with AddressSanitizer and UndefinedBehaviorSanitizer in
# a build directory of its own and runs the ctest entries under them: unit
# tests, multi-rank MPI tests and the find_package consumer (which picks the
# sanitizer flags up from CXXFLAGS/LDFLAGS when it configures); not the Python
# entries (below).
#   scripts/sanitize.sh                        # build in ./build-sanitize, run everything
#   BUILD_DIR=... JOBS=... CTEST_ARGS="-R BadInput" scripts/sanitize.sh
# Any sanitizer report fails the test that produced it (halt on the first).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build-sanitize}
JOBS=${JOBS:-$(nproc)}
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
LAUNCHER=()
command -v ccache >/dev/null 2>&1 && LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)

SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
export CXXFLAGS="$SAN ${CXXFLAGS:-}"
export LDFLAGS="-fsanitize=address,undefined ${LDFLAGS:-}"
# Open MPI keeps its allocations until exit: leak checking would report only
# those. Huge requests come back as a failed allocation (the library turns it
# into gdncp::Error, which the bad-size tests check) instead of a fatal report.
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=0:halt_on_error=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1

# Warnings are not errors here: GCC's flow analysis warns differently with the
# sanitizers' instrumentation; the normal build keeps -Werror. -O1 with line
# tables: reports point at source lines, and the build stays quick.
cmake -S . -B "$BUILD_DIR" "${GEN[@]}" "${LAUNCHER[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS_RELEASE="-O1 -g1" -DGDNCP_CUDA=OFF -DGDNCP_WERROR=OFF ${CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "$JOBS"
# The Python entries load the instrumented library into an interpreter built
# without the sanitizers, which ASan refuses ("runtime does not come first");
# the door's C ABI runs here through its C tests (CApi.*).
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 3600 -E '^Python[.]' ${CTEST_ARGS:-}

#!/usr/bin/env bash
# Installs what a fresh machine lacks to build and test gdncp (Debian/Ubuntu,
# as root or with sudo): cmake, a C++ compiler, ninja, GoogleTest, Open MPI.
# CUDA (nvcc, cuBLAS, NCCL) is used when present in /usr/local/cuda and is
# never installed here. Safe to run again: it installs only what is missing.
set -euo pipefail

need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/mpi/mpi.h ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] \
  || [ -e /usr/include/mpi.h ] || need+=(libopenmpi-dev)
[ -e /usr/include/gtest/gtest.h ] || [ -e /usr/src/googletest/CMakeLists.txt ] || need+=(googletest libgtest-dev)

if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

#!/usr/bin/env bash
# Installs what a fresh machine lacks to build and test gdncp (Debian/Ubuntu,
# as root or with sudo): cmake, a C++ compiler, ninja, GoogleTest, Open MPI;
# for the C ABI and the Python package: DLPack's header, PyTorch and pytest
# (Debian's python3-torch, python3-pytest for /usr/bin/python3), and setuptools
# and pip for `pip install --no-build-isolation .`. An image
# whose python3 already has torch needs neither (CMake then takes DLPack's
# header from torch's include folder).
# CUDA (nvcc, cuBLAS, NCCL) is used when present in /usr/local/cuda and is
# never installed here. Safe to run again: it installs only what is missing.
set -euo pipefail

need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
command -v clang-format >/dev/null 2>&1 || need+=(clang-format)  # scripts/format.sh
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/mpi/mpi.h ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] \
  || [ -e /usr/include/mpi.h ] || need+=(libopenmpi-dev)
[ -e /usr/include/gtest/gtest.h ] || [ -e /usr/src/googletest/CMakeLists.txt ] || need+=(googletest libgtest-dev)
has_torch() { "$1" -c "import torch" >/dev/null 2>&1; }
other_torch=0
command -v python3 >/dev/null 2>&1 && has_torch "$(command -v python3)" && other_torch=1
if [ ! -e /usr/include/dlpack/dlpack.h ] && [ $other_torch = 0 ]; then need+=(libdlpack-dev); fi
if ! { [ -x /usr/bin/python3 ] && has_torch /usr/bin/python3; } && [ $other_torch = 0 ]; then
  need+=(python3-torch python3-pytest)
elif [ -x /usr/bin/python3 ] && has_torch /usr/bin/python3 && ! /usr/bin/python3 -c "import pytest" >/dev/null 2>&1; then
  need+=(python3-pytest)
fi

# pip install --no-build-isolation . (setup.py) builds with the system's setuptools; nothing is fetched.
[ -x /usr/bin/python3 ] && ! /usr/bin/python3 -c "import setuptools" >/dev/null 2>&1 && need+=(python3-setuptools)
[ -x /usr/bin/python3 ] && ! /usr/bin/python3 -m pip --version >/dev/null 2>&1 && need+=(python3-pip)

if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

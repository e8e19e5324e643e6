"""pip install of gdncp from a checkout, offline, with the system's setuptools:

    pip install --no-build-isolation .

builds libgdncp with CMake (tests, examples and benchmarks off; CUDA when nvcc
is found, as CMake's GDNCP_CUDA=AUTO decides) and installs the package
python/gdncp with the library inside it, where gdncp/_capi.py looks first.
GDNCP_CMAKE_ARGS adds CMake arguments (e.g. "-DGDNCP_CUDA=OFF"),
GDNCP_BUILD_JOBS the parallel jobs (default: the CPU count).
"""
import os
import shlex
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithLibrary(build_py):
    """Copies the package, then builds libgdncp and puts it into the package as libgdncp.so."""

    def run(self):
        super().run()
        build = os.path.join(os.path.abspath(os.path.dirname(self.build_lib)), "cmake")
        cmd = ["cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGDNCP_BUILD_TESTS=OFF",
               "-DGDNCP_BUILD_EXAMPLES=OFF", "-DGDNCP_BUILD_BENCH=OFF"]
        if shutil.which("ninja") and not os.path.exists(os.path.join(build, "CMakeCache.txt")):
            cmd += ["-G", "Ninja"]
        cmd += shlex.split(os.environ.get("GDNCP_CMAKE_ARGS", ""))
        subprocess.check_call(cmd)
        jobs = os.environ.get("GDNCP_BUILD_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", build, "--target", "gdncp", "-j", jobs])
        lib = os.path.join(build, "libgdncp.so")
        dest = os.path.join(self.build_lib, "gdncp", "libgdncp.so")
        shutil.copyfile(os.path.realpath(lib), dest)  # the file, not the symlink
        os.chmod(dest, 0o755)


class BinaryDistribution(Distribution):
    """The wheel holds a shared library: tag it for this platform."""

    def has_ext_modules(self):
        return True


setup(
    name="gdncp",
    version="0.1.0",
    description="Context-parallel bidirectional gated-delta-net layer (C++/CUDA) with PyTorch bindings",
    packages=["gdncp"],
    package_dir={"gdncp": "python/gdncp"},
    python_requires=">=3.8",
    cmdclass={"build_py": BuildPyWithLibrary},
    distclass=BinaryDistribution,
    zip_safe=False,
)

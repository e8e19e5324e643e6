"""The layout `cmake --install` gives the package: installs the build into a
fresh prefix, then imports gdncp under the interpreter running this script
(CMake's Python3_EXECUTABLE: /usr/bin/python3 on Debian, a venv elsewhere)
with only that prefix's <libdir>/python3/dist-packages added to its path. The package must load
the installed library (not the build tree's) and reach the layer; without the
library, the ImportError must list every place it tried.

    python3 install_layout.py CMAKE BUILD_DIR LIBDIR
"""
import os
import shutil
import subprocess
import sys
import tempfile

cmake, build, libdir = sys.argv[1:4]
with tempfile.TemporaryDirectory() as prefix:
    subprocess.check_call([cmake, "--install", build, "--prefix", prefix], stdout=subprocess.DEVNULL)
    site = os.path.join(prefix, libdir, "python3", "dist-packages")
    assert not os.path.exists(os.path.join(site, "gdncp", "_library.py")), "the build tree's path was installed"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": site, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    code = ("import os, gdncp; p = os.path.realpath(gdncp._capi.lib._name); "
            "assert p.startswith(os.path.realpath(%r)), p; "
            "import importlib.util as u; assert u.find_spec('torch') is None or gdncp.bigdn; print('loaded', p)"
            % prefix)
    # cwd: the prefix (python3 -c puts the working folder first on the path, and ctest's is the build tree's
    # python folder).
    subprocess.check_call([sys.executable, "-c", code], env=env, cwd=prefix)

    for name in os.listdir(os.path.join(prefix, libdir)):
        if name.startswith("libgdncp.so"):
            os.remove(os.path.join(prefix, libdir, name))
    r = subprocess.run([sys.executable, "-c", "import gdncp"], env=env, capture_output=True, text=True,
                       cwd=prefix)
    assert r.returncode != 0, "imported without a library"
    msg = r.stderr.strip().splitlines()[-1]
    want = os.path.join(prefix, libdir, "libgdncp.so")
    assert "Tried:" in msg and want in msg and "loader's search path" in msg, msg
    print("without the library:", msg)

"""The example trainer on 2 CPU ranks under mpirun (--device cpu): it trains,
and layer 0's output and input gradients of its first step through the door
equal the C++ entry's (tests/door_reference --cp under mpirun), bitwise —
the CPU twin of Python.torchrun."""
import os
import subprocess
import sys

import pytest

import door_files

NPROC = 2
EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "train_torchrun.py")


def test_example_trains_and_equals_cpp_entry(tmp_path):
    if not door_files.reference_binary():
        pytest.skip("GDNCP_DOOR_REFERENCE (tests/door_reference) not set: run through ctest")
    dump = str(tmp_path)
    mpirun = os.environ.get("GDNCP_MPIEXEC") or "mpirun"
    cmd = [mpirun, "-np", str(NPROC), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", sys.executable,
           EXAMPLE, "--device", "cpu", "--steps", "6", "--frames", "4", "--tokens", "4", "--heads", "2",
           "--head-dim", "8", "--dim", "16", "--dump", dump]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, "example failed:\n%s\n%s" % (r.stdout[-4000:], r.stderr[-4000:])
    losses = [float(line.split("loss")[1]) for line in r.stdout.splitlines() if line.startswith("step")]
    assert len(losses) >= 2 and losses[-1] < losses[0], r.stdout
    door_files.assert_dump_matches_reference(dump, NPROC)

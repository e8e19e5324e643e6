"""Exit after an abort (docs/design.md §10): on 2 CPU ranks under mpirun
(started here), rank 1 hangs; rank 0's next collective meets its deadline,
the communicator is aborted, and rank 0's interpreter exits at once: the
package's exit handler (gdncp.comm._finalize_mpi) closes the communicator
and skips MPI_Finalize, which would wait for the hung rank forever."""
import os
import subprocess
import sys
import time

import pytest

RANK_SCRIPT = r"""
import atexit, os, sys, time
marks, rank = sys.argv[1], int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))

def mark(name):
    with open(os.path.join(marks, "%s.%d" % (name, rank)), "w") as f:
        f.write(repr(time.time()))

atexit.register(mark, "exited")  # registered before gdncp's handler: runs after it
import torch
import gdncp
comm = gdncp.Communicator.mpi_world()
comm.timeout = 2.0
x = torch.ones(4, dtype=torch.float64)
comm.all_reduce_sum_(x)  # both ranks in step once
if rank == 1:
    mark("hung")
    time.sleep(3600)  # hung: never joins the next collective, never exits by itself
try:
    comm.all_reduce_sum_(x)
except gdncp.GdncpError as e:
    mark("error")
    print("rank 0:", e, flush=True)
    sys.exit(3)  # non-zero: mpirun then ends the job, the hung rank included
sys.exit(4)
"""

DEADLINE_S = 2.0
EXIT_BOUND_S = 5.0


def test_harden_exit_after_abort_does_not_wait_for_a_hung_rank(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    marks = tmp_path / "marks"
    marks.mkdir()
    mpirun = os.environ.get("GDNCP_MPIEXEC") or "mpirun"
    cmd = [mpirun, "-np", "2", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", sys.executable,
           str(script), str(marks)]
    env = dict(os.environ, OMPI_MCA_rmaps_base_oversubscribe="1")
    start = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail("the job did not end within 300 s (an exit waits for the hung rank): %s" % (e.stdout or "")[-2000:])
    end = time.time()
    got = {p.name: float(p.read_text()) for p in marks.iterdir()}
    log = "exit %d\n%s\n%s" % (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    assert "hung.1" in got and "error.0" in got, "%s: marks %s" % (log, sorted(got))
    assert "exited.0" in got, "rank 0's exit handlers did not finish: %s" % log
    waited = got["error.0"] - got["hung.1"]
    assert DEADLINE_S - 0.5 <= waited < DEADLINE_S + 10, "the deadline took %.1f s: %s" % (waited, log)
    assert got["exited.0"] - got["error.0"] < EXIT_BOUND_S, \
        "rank 0's exit took %.1f s after the error: %s" % (got["exited.0"] - got["error.0"], log)
    assert end - got["error.0"] < EXIT_BOUND_S + 10, \
        "the job ended %.1f s after rank 0's error: %s" % (end - got["error.0"], log)
    assert "exited.1" not in got, "the hung rank exited by itself: %s" % log
    assert start < got["hung.1"]

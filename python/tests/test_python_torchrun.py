"""The door under torchrun on 2 GPUs, while the example trains: layer 0's
output and input gradients of a training step through the door equal the
C++ entry (tests/door_reference under mpirun, gdncp::cp::bigdn_cp over NCCL)
on the same inputs, bitwise, on every rank. Skips without 2 GPUs."""
import os
import subprocess
import sys

import pytest
import torch

import door_files

NPROC = 2
if not torch.cuda.is_available() or torch.cuda.device_count() < NPROC:
    pytest.skip("needs %d CUDA devices" % NPROC, allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "train_torchrun.py")


def test_door_equals_cpp_entry_under_torchrun(tmp_path):
    if not door_files.reference_binary():
        pytest.skip("GDNCP_DOOR_REFERENCE (tests/door_reference) not set: run through ctest")
    dump = str(tmp_path)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=%d" % NPROC, EXAMPLE,
                        "--steps", "3", "--dump", dump], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, "torchrun failed:\n%s\n%s" % (r.stdout[-4000:], r.stderr[-4000:])
    assert "loss" in r.stdout
    door_files.assert_dump_matches_reference(dump, NPROC)

"""The door against the C++ entries on the same inputs: writes a layer call's
inputs for tests/door_reference (the C++ library without the door), runs it,
and reads its outputs and gradients back."""
import ctypes
import os
import subprocess

import torch

ORDER = ["qkv", "beta", "decay", "q_norm_w", "k_norm_w", "rope_cos", "rope_sin", "grad_out"]
GRADS = ["qkv", "beta", "decay", "q_norm_w", "k_norm_w"]
_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float64: "f64"}


def reference_binary():
    return os.environ.get("GDNCP_DOOR_REFERENCE")


def _write(path, t):
    t = t.detach().cpu().contiguous()
    with open(path, "wb") as f:
        f.write(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))


def _read(path, like):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=like.dtype).reshape(like.shape).to(like.device)


def write_call(dir, x, F, S, k_scale, checkpoint="off", precision="auto"):
    """x: qkv, beta, decay, q_norm_w, k_norm_w (or None), rope_cos, rope_sin, grad_out."""
    os.makedirs(dir, exist_ok=True)
    B, N, _, H, D = x["qkv"].shape
    dev = "cuda" if x["qkv"].is_cuda else "cpu"
    with open(os.path.join(dir, "meta.txt"), "w") as f:
        f.write("%d %d %d %d %d %.17g %s %s %s %s\n" % (B, H, D, F, S, k_scale, _NAMES[x["qkv"].dtype], checkpoint,
                                                       dev, precision))
    for k in ORDER:
        p = os.path.join(dir, k)
        if x.get(k) is None:
            if os.path.exists(p):
                os.remove(p)
            continue
        _write(p, x[k])


def run_reference(dir, mpi_ranks=0, time_iters=0):
    """Runs door_reference on dir (under mpirun with mpi_ranks > 0); returns its stdout."""
    cmd = [reference_binary(), dir]
    if mpi_ranks:
        cmd = [os.environ.get("GDNCP_MPIEXEC") or "mpirun", "-np", str(mpi_ranks), "--oversubscribe",
               "--allow-run-as-root", "--bind-to", "none"] + cmd + ["--cp"]
    if time_iters:
        cmd += ["--time", str(time_iters)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, "door_reference failed (%d):\n%s\n%s" % (r.returncode, r.stdout, r.stderr)
    return r.stdout


def read_results(dir, out_like, x):
    out = _read(os.path.join(dir, "out.ref"), out_like)
    grads = {k: _read(os.path.join(dir, "grad_%s.ref" % k), x[k]) for k in GRADS if x.get(k) is not None}
    return out, grads


def door_step(layer_fn, x):
    """out and input gradients of one forward + backward(out, grad_out) through the door."""
    leaves = {k: (x[k].detach().clone().requires_grad_(True) if k in GRADS and x.get(k) is not None else x.get(k))
              for k in ORDER}
    out = layer_fn(leaves)
    torch.autograd.backward(out, leaves["grad_out"])
    return out.detach(), {k: leaves[k].grad for k in GRADS if leaves.get(k) is not None}


def assert_bitwise(got, want, what=""):
    out, grads = got
    out_ref, grads_ref = want
    assert torch.equal(out, out_ref), "%sout differs from the C++ entry (max |diff| %g)" % (
        what, (out.double() - out_ref.double()).abs().max())
    assert grads.keys() == grads_ref.keys()
    for k in grads_ref:
        assert torch.equal(grads[k], grads_ref[k]), "%sd/d %s differs from the C++ entry (max |diff| %g)" % (
            what, k, (grads[k].double() - grads_ref[k].double()).abs().max())


def assert_dump_matches_reference(dump, nproc):
    """Runs door_reference --cp under mpirun on what the example dumped (train_torchrun.py --dump)
    and compares each rank's door results with it, bitwise."""
    run_reference(dump, mpi_ranks=nproc)
    for rank in range(nproc):
        d = os.path.join(dump, "rank%d" % rank)
        door = torch.load(os.path.join(d, "door.pt"))
        want = read_results(d, door["out"], {k: door[k] for k in GRADS})
        assert_bitwise((door["out"], {k: door[k] for k in GRADS}), want, "rank %d: " % rank)

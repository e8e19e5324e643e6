"""The PyTorch door on one GPU: against the C++ entry bitwise (the same
kernels on the same inputs; tests/door_reference runs them without the door),
against the eager float64 coding within the f32 tolerance, and on a
non-default torch stream. Skips without a GPU."""
import pytest
import torch

import bigdn_eager as eager
import door_files
import gdncp

if not (torch.cuda.is_available() and gdncp.cuda_available()):
    pytest.skip("no CUDA device visible to torch and gdncp", allow_module_level=True)

B, H, D, F, S = 1, 4, 112, 5, 32
NAMES = ["qkv", "beta", "decay", "q_norm_w", "k_norm_w", "rope_cos", "rope_sin"]


def cuda_inputs(dtype, seed):
    x = eager.inputs(B, H, D, F, S, seed=seed, dtype=torch.float64)
    y = {k: x[k].to("cuda", dtype if k in ("qkv", "beta", "decay") else torch.float32) for k in NAMES}
    y["grad_out"] = torch.randn(B, F * S, H, D, dtype=torch.float64).to("cuda", dtype)
    return x, y


def door_fn(k_scale, checkpoint="off", precision="auto"):
    def fn(v):
        return gdncp.bigdn(v["qkv"], v["beta"], v["decay"], v["q_norm_w"], v["k_norm_w"], v["rope_cos"],
                           v["rope_sin"], F, S, k_scale=k_scale, checkpoint=checkpoint, precision=precision)
    return fn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("checkpoint", ["off", "on"])
def test_door_equals_cpp_entry_bitwise(tmp_path, dtype, checkpoint):
    if not door_files.reference_binary():
        pytest.skip("GDNCP_DOOR_REFERENCE (tests/door_reference) not set: run through ctest")
    x, y = cuda_inputs(dtype, seed=31)
    door_files.write_call(str(tmp_path), y, F, S, x["k_scale"], checkpoint)
    door_files.run_reference(str(tmp_path))
    got = door_files.door_step(door_fn(x["k_scale"], checkpoint), y)
    torch.cuda.synchronize()
    door_files.assert_bitwise(got, door_files.read_results(str(tmp_path), got[0], y))


def test_ieee_f32_matches_eager_f64():
    x, y = cuda_inputs(torch.float32, seed=33)
    got_out, got = door_files.door_step(door_fn(x["k_scale"], precision="ieee"), y)
    ref = {k: (x[k].clone().requires_grad_(True) if k in door_files.GRADS else x[k]) for k in NAMES}
    out = eager.bigdn(*(ref[k] for k in NAMES), F, S, x["k_scale"])
    torch.autograd.backward(out, y["grad_out"].double().cpu())
    tol = eager.tolerance("f32")
    assert eager.rel_l2(got_out.cpu(), out.detach()) <= tol
    for k in door_files.GRADS:
        assert eager.rel_l2(got[k].cpu(), ref[k].grad) <= tol, k


def test_side_stream_equals_default_stream():
    x, y = cuda_inputs(torch.bfloat16, seed=35)
    base = door_files.door_step(door_fn(x["k_scale"]), y)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        side = door_files.door_step(door_fn(x["k_scale"]), y)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    door_files.assert_bitwise(side, base, "side stream: ")


def test_nccl_one_rank_bootstrap_without_mpi():
    uid = gdncp.unique_id()
    assert len(uid) == 128
    comm = gdncp.Communicator.nccl(uid, 0, 1, torch.cuda.current_device())
    assert (comm.rank, comm.size, comm.backend) == (0, 1, "nccl")
    x, y = cuda_inputs(torch.float32, seed=37)

    def cp_fn(v):
        return gdncp.bigdn_cp(comm, v["qkv"], v["beta"], v["decay"], v["q_norm_w"], v["k_norm_w"], v["rope_cos"],
                              v["rope_sin"], F, S, k_scale=x["k_scale"], precision="ieee")

    got_out, got = door_files.door_step(cp_fn, y)
    ref_out, ref = door_files.door_step(door_fn(x["k_scale"], precision="ieee"), y)
    tol = eager.tolerance("f32")
    assert eager.rel_l2(got_out, ref_out) <= tol
    for k in ref:
        assert eager.rel_l2(got[k], ref[k]) <= tol, k
    comm.close()


@pytest.mark.parametrize("bad", [0.5, 2.0, -1.0, float("nan")])
def test_harden_cuda_clip_mask_values(bad):
    """A CUDA clip mask holding another value than 0 or 1 is checked on the device (docs/design.md §9): that
    call's output and gradients are NaN, and the next call that takes a mask raises naming clip_starts (once)."""
    x, y = cuda_inputs(torch.float32, seed=37)
    good = torch.zeros(B, F, dtype=torch.float32, device="cuda")
    good[0, 2] = 1.0
    mask = good.clone()
    mask[0, int(torch.randint(0, F, (1,)))] = bad

    def call(m):
        v = {k: (y[k].clone().requires_grad_(True) if k in door_files.GRADS else y[k]) for k in NAMES}
        out = gdncp.bigdn(*(v[k] for k in NAMES), F, S, k_scale=x["k_scale"], clip_starts=m)
        out.backward(y["grad_out"])
        return out.detach(), {k: v[k].grad for k in door_files.GRADS}

    ref_out, _ = call(good)
    out, grads = call(mask)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()
    for k, g in grads.items():
        assert torch.isnan(g).all(), k
    with pytest.raises(gdncp.GdncpError, match="clip_starts: must hold 0 or 1"):
        call(good)
    again, _ = call(good)
    assert torch.equal(again, ref_out)

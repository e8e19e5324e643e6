"""The PyTorch door on the CPU, one rank: gdncp.bigdn / BiGDN / bigdn_cp over
a 1-rank MPI world against the eager float64 coding in bigdn_eager.py,
forward and every gradient through torch.autograd."""
import pytest
import torch

import bigdn_eager as eager
import gdncp

TOL = eager.tolerance("f64")
B, H, D, F, S = 2, 2, 8, 4, 3
GRADS = ["qkv", "beta", "decay", "q_norm_w", "k_norm_w"]


def leaves(x):
    return {k: (v.clone().requires_grad_(True) if isinstance(v, torch.Tensor) and k in GRADS else v)
            for k, v in x.items()}


def run(fn, x, w):
    out = fn(x)
    (out * w).sum().backward()
    return out.detach(), {k: x[k].grad for k in GRADS if x[k] is not None}


def eager_fn(x):
    return eager.bigdn(x["qkv"], x["beta"], x["decay"], x["q_norm_w"], x["k_norm_w"], x["rope_cos"], x["rope_sin"],
                       F, S, x["k_scale"])


def check(got, want):
    out, grads = got
    out_ref, grads_ref = want
    assert out.dtype == torch.float64 and out.shape == out_ref.shape
    assert eager.rel_l2(out, out_ref) <= TOL, "out: rel %.3g" % eager.rel_l2(out, out_ref)
    assert grads.keys() == grads_ref.keys()
    for k in grads_ref:
        err = eager.rel_l2(grads[k], grads_ref[k])
        assert err <= TOL, "d/d %s: rel %.3g" % (k, err)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("checkpoint", ["off", "on"])
def test_bigdn_matches_eager(norm, checkpoint):
    x = eager.inputs(B, H, D, F, S, seed=11, norm=norm)
    w = torch.randn(B, F * S, H, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def door(x):
        return gdncp.bigdn(x["qkv"], x["beta"], x["decay"], x["q_norm_w"], x["k_norm_w"], x["rope_cos"],
                           x["rope_sin"], F, S, k_scale=x["k_scale"], checkpoint=checkpoint)

    check(run(door, leaves(x), w), run(eager_fn, leaves(x), w))


def test_packed_clips_match_eager():
    # Row 0: clips 1, 3; row 1: clips 2, 1, 1 (rows packed differently, 1-frame clips among them).
    clips = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1]], dtype=torch.float32)
    x = eager.inputs(B, H, D, F, S, seed=13)
    w = torch.randn(B, F * S, H, D, generator=torch.Generator().manual_seed(6), dtype=torch.float64)

    def door(x):
        return gdncp.bigdn(x["qkv"], x["beta"], x["decay"], x["q_norm_w"], x["k_norm_w"], x["rope_cos"],
                           x["rope_sin"], F, S, k_scale=x["k_scale"], clip_starts=clips)

    def eager_clips(x):
        return eager.bigdn(x["qkv"], x["beta"], x["decay"], x["q_norm_w"], x["k_norm_w"], x["rope_cos"],
                           x["rope_sin"], F, S, x["k_scale"], clip_starts=clips)

    got, want = run(door, leaves(x), w), run(eager_clips, leaves(x), w)
    check(got, want)
    # The mask matters: without it the numbers differ.
    assert eager.rel_l2(got[0], run(eager_fn, leaves(x), w)[0]) > 1e-3


def test_checkpoint_on_equals_off_bitwise():
    x = eager.inputs(B, H, D, F, S, seed=3)
    w = torch.randn(B, F * S, H, D, dtype=torch.float64)
    got = {}
    for mode in ("off", "on"):
        def door(x):
            return gdncp.bigdn(x["qkv"], x["beta"], x["decay"], x["q_norm_w"], x["k_norm_w"], x["rope_cos"],
                               x["rope_sin"], F, S, k_scale=x["k_scale"], checkpoint=mode)
        got[mode] = run(door, leaves(x), w)
    assert torch.equal(got["off"][0], got["on"][0])
    for k in GRADS:
        assert torch.equal(got["off"][1][k], got["on"][1][k]), k


def test_module_exchange_options_need_comm():
    """The exchange options of the CP layer are refused without comm, and bad values at construction."""
    with pytest.raises(ValueError, match="apply only with comm"):
        gdncp.BiGDN(H, D, exchange="log")
    with pytest.raises(ValueError, match="apply only with comm"):
        gdncp.BiGDN(H, D, overlap_exchange=True)
    with pytest.raises(ValueError, match="exchange must be one of"):
        gdncp.BiGDN(H, D, exchange="ring")
    with pytest.raises(TypeError, match="overlap_exchange must be True or False"):
        gdncp.BiGDN(H, D, overlap_exchange=1)
    assert "cp=off" in repr(gdncp.BiGDN(H, D))


def test_module_and_partial_grads():
    x = eager.inputs(B, H, D, F, S, seed=7)
    layer = gdncp.BiGDN(H, D, dtype=torch.float64)
    with torch.no_grad():
        layer.q_norm_w.copy_(x["q_norm_w"])
        layer.k_norm_w.copy_(x["k_norm_w"])
    qkv = x["qkv"].clone().requires_grad_(True)  # beta, decay: no grad
    out = layer(qkv, x["beta"], x["decay"], x["rope_cos"], x["rope_sin"], F, S)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    ref = leaves(x)
    out_ref = eager_fn(ref)
    (out_ref * w).sum().backward()
    assert eager.rel_l2(out.detach(), out_ref.detach()) <= TOL
    assert eager.rel_l2(qkv.grad, ref["qkv"].grad) <= TOL
    assert eager.rel_l2(layer.q_norm_w.grad, ref["q_norm_w"].grad) <= TOL
    assert eager.rel_l2(layer.k_norm_w.grad, ref["k_norm_w"].grad) <= TOL


def test_inference_records_nothing():
    x = eager.inputs(B, H, D, F, S, seed=9)
    with torch.no_grad():
        out = gdncp.bigdn(*(x[k] for k in ["qkv", "beta", "decay", "q_norm_w", "k_norm_w", "rope_cos", "rope_sin"]),
                          F, S, k_scale=x["k_scale"])
    assert not out.requires_grad
    assert eager.rel_l2(out, eager_fn(x)) <= TOL


def test_output_shares_memory_with_the_library():
    # The door hands back the library's buffer: writing through torch is seen by
    # a second view over the same DLPack export (no copy on the way out).
    x = eager.inputs(1, 1, 4, 2, 2, seed=1)
    out = gdncp.bigdn(x["qkv"], x["beta"], x["decay"], None, None, x["rope_cos"], x["rope_sin"], 2, 2)
    view = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(out))
    assert view.data_ptr() == out.data_ptr()


def test_bad_argument_names_it():
    x = eager.inputs(1, 2, 4, 2, 2, seed=2)
    with pytest.raises(gdncp.GdncpError, match="decay"):
        gdncp.bigdn(x["qkv"], x["beta"], x["decay"][..., :1].contiguous(), None, None, x["rope_cos"],
                    x["rope_sin"], 2, 2)
    with pytest.raises(gdncp.ArgumentError, match="qkv"):
        gdncp.bigdn(x["qkv"].int(), x["beta"], x["decay"], None, None, x["rope_cos"], x["rope_sin"], 2, 2)
    with pytest.raises(gdncp.GdncpError, match="clip_starts"):  # (B, F) = (1, 2)
        gdncp.bigdn(x["qkv"], x["beta"], x["decay"], None, None, x["rope_cos"], x["rope_sin"], 2, 2,
                    clip_starts=torch.zeros(1, 3, dtype=torch.float32))
    with pytest.raises(ValueError, match="precision"):
        gdncp.bigdn(x["qkv"], x["beta"], x["decay"], None, None, x["rope_cos"], x["rope_sin"], 2, 2,
                    precision="fp8")


def test_strided_input_is_made_contiguous():
    x = eager.inputs(1, 2, 4, 2, 2, seed=4)
    qkv_t = x["qkv"].transpose(0, 1).contiguous().transpose(0, 1)  # same values, strided (B=1 keeps it dense)
    out = gdncp.bigdn(qkv_t, x["beta"], x["decay"], x["q_norm_w"], x["k_norm_w"], x["rope_cos"], x["rope_sin"], 2,
                      2, k_scale=x["k_scale"])
    ref = eager.bigdn(x["qkv"], x["beta"], x["decay"], x["q_norm_w"], x["k_norm_w"], x["rope_cos"], x["rope_sin"],
                      2, 2, x["k_scale"])
    assert eager.rel_l2(out, ref) <= TOL


def test_cp_layer_one_rank_matches_eager():
    comm = gdncp.Communicator.mpi_world()
    if comm.size != 1:
        pytest.skip("runs on one rank (the MPI test covers more)")
    assert comm.backend == "mpi" and comm.rank == 0
    comm.timeout = 60.0
    assert comm.timeout == 60.0
    with pytest.raises(gdncp.ArgumentError, match="seconds"):
        comm.timeout = float("inf")
    x = eager.inputs(B, H, D, F, S, seed=13)
    w = torch.randn(B, F * S, H, D, dtype=torch.float64)

    def door(x):
        return gdncp.bigdn_cp(comm, x["qkv"], x["beta"], x["decay"], x["q_norm_w"], x["k_norm_w"], x["rope_cos"],
                              x["rope_sin"], F, S, k_scale=x["k_scale"])

    check(run(door, leaves(x), w), run(eager_fn, leaves(x), w))
    # The graph keeps the communicator alive: close the handle between forward and backward.
    y = leaves(x)
    out = door(y)
    comm.close()
    (out * w).sum().backward()
    assert y["qkv"].grad is not None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_door_equals_cpp_entry_bitwise(tmp_path, dtype):
    import door_files

    if not door_files.reference_binary():
        pytest.skip("GDNCP_DOOR_REFERENCE (tests/door_reference) not set: run through ctest")
    x = eager.inputs(B, H, D, F, S, seed=17)
    table = torch.float64 if dtype == torch.float64 else torch.float32
    y = {k: (x[k].to(table if k in ("q_norm_w", "k_norm_w", "rope_cos", "rope_sin") else dtype))
         for k in ["qkv", "beta", "decay", "q_norm_w", "k_norm_w", "rope_cos", "rope_sin"]}
    y["grad_out"] = torch.randn(B, F * S, H, D, dtype=dtype)
    door_files.write_call(str(tmp_path), y, F, S, x["k_scale"])
    door_files.run_reference(str(tmp_path))

    def door(v):
        return gdncp.bigdn(v["qkv"], v["beta"], v["decay"], v["q_norm_w"], v["k_norm_w"], v["rope_cos"],
                           v["rope_sin"], F, S, k_scale=x["k_scale"])

    got = door_files.door_step(door, y)
    door_files.assert_bitwise(got, door_files.read_results(str(tmp_path), got[0], y))


def test_cp_gdn_raw_through_the_c_abi():
    # The raw single-direction entry, called through the C ABI binding itself:
    # num and den of the forward direction, and the graph's backward with
    # gradients for both outputs, against the eager coding.
    import ctypes

    from gdncp import _capi, _dlpack

    comm = gdncp.Communicator.mpi_world()
    if comm.size != 1:
        pytest.skip("runs on one rank")
    x = eager.inputs(B, H, D, F, S, seed=19)
    names = ["qkv", "beta", "decay", "q_norm_w", "k_norm_w", "rope_cos", "rope_sin"]
    outs = (ctypes.c_void_p * 4)()
    graph = ctypes.c_void_p()
    _capi.call("cp_gdn_raw", comm.handle, *(_dlpack.give(x[k]) for k in names), None, None, None, F, S,
               ctypes.byref(_capi.layer_options(k_scale=x["k_scale"])), None, None, 0x1F, outs, ctypes.byref(graph))
    num, den, tM, tz = (_dlpack.take(outs[k]) for k in range(4))
    assert tM is None and tz is None  # no truncate_to_active
    g_num, g_den = torch.randn_like(num), torch.randn_like(den)
    grads_in = (ctypes.c_void_p * 5)()
    grads_out = (ctypes.c_void_p * 4)(_dlpack.give(g_num), _dlpack.give(g_den), None, None)
    _capi.call("graph_backward", graph, grads_out, None, grads_in)
    _capi.call("graph_destroy", graph)
    grads = [_dlpack.take(grads_in[i]) for i in range(5)]
    comm.close()

    ref = leaves(x)
    num_ref, den_ref = eager.bigdn(*(ref[k] for k in names), F, S, x["k_scale"], raw=True)
    ((num_ref * g_num).sum() + (den_ref * g_den).sum()).backward()
    assert eager.rel_l2(num, num_ref.detach()) <= TOL
    assert eager.rel_l2(den, den_ref.detach()) <= TOL
    for k, g in zip(GRADS, grads):
        assert eager.rel_l2(g, ref[k].grad) <= TOL, k


def test_cp_scan_through_the_c_abi():
    # The distributed frame scan's entry on one rank: M, z and every gradient
    # against the recurrence M_f = g_f (I - P_f) M_{f-1} + A_f (z likewise).
    import ctypes

    from gdncp import _capi, _dlpack

    comm = gdncp.Communicator.mpi_world()
    if comm.size != 1:
        pytest.skip("runs on one rank")
    g = torch.Generator().manual_seed(23)
    BH = B * H
    x = dict(P=0.1 * torch.randn(BH, F, D, D, generator=g, dtype=torch.float64),
             A=torch.randn(BH, F, D, D, generator=g, dtype=torch.float64),
             Pz=0.1 * torch.randn(BH, F, D, D, generator=g, dtype=torch.float64),
             bz=torch.randn(BH, F, D, generator=g, dtype=torch.float64),
             decay=0.5 + 0.49 * torch.rand(B, H, F, generator=g, dtype=torch.float64))
    names = ["P", "A", "Pz", "bz", "decay"]
    outs = (ctypes.c_void_p * 4)()
    graph = ctypes.c_void_p()
    _capi.call("cp_scan", comm.handle, *(_dlpack.give(x[k]) for k in names), None, None, None, 0x1F, outs,
               ctypes.byref(graph))
    M, z, tM, tz = (_dlpack.take(outs[k]) for k in range(4))
    assert tM is None and tz is None
    gM, gz = torch.randn_like(M), torch.randn_like(z)
    grads_in = (ctypes.c_void_p * 5)()
    _capi.call("graph_backward", graph, (ctypes.c_void_p * 4)(_dlpack.give(gM), _dlpack.give(gz), None, None), None,
               grads_in)
    _capi.call("graph_destroy", graph)
    grads = [_dlpack.take(grads_in[i]) for i in range(5)]
    comm.close()

    r = {k: v.clone().requires_grad_(True) for k, v in x.items()}
    I = torch.eye(D, dtype=torch.float64)
    dec = r["decay"].reshape(BH, F)
    Mi, zi, Ms, zs = torch.zeros(BH, D, D, dtype=torch.float64), torch.zeros(BH, D, dtype=torch.float64), [], []
    for f in range(F):
        gf = dec[:, f, None, None]
        Mi = gf * (I - r["P"][:, f]) @ Mi + r["A"][:, f]
        zi = (gf * (I - r["Pz"][:, f]) @ zi[..., None])[..., 0] + r["bz"][:, f]
        Ms.append(Mi)
        zs.append(zi)
    M_ref, z_ref = torch.stack(Ms, 1), torch.stack(zs, 1)
    ((M_ref * gM).sum() + (z_ref * gz).sum()).backward()
    assert eager.rel_l2(M, M_ref.detach()) <= TOL
    assert eager.rel_l2(z, z_ref.detach()) <= TOL
    for k, gr in zip(names, grads):
        assert eager.rel_l2(gr, r[k].grad) <= TOL, k


def test_deterministic_bigdn_cp_equals_bigdn_bitwise():
    """deterministic=True (docs/design.md §12): the CP layer on a one-rank world is
    bitwise the single-rank layer in that mode, which stays within the f64 bar."""
    comm = gdncp.Communicator.mpi_world()
    if comm.size != 1:
        pytest.skip("runs on one rank (tests/mpi_test_cp_deterministic.cpp covers P ranks)")
    x = eager.inputs(B, H, D, F, S, seed=17)
    w = torch.randn(B, F * S, H, D, dtype=torch.float64)
    args = lambda x: (x["qkv"], x["beta"], x["decay"], x["q_norm_w"], x["k_norm_w"], x["rope_cos"], x["rope_sin"], F, S)
    one = run(lambda x: gdncp.bigdn(*args(x), k_scale=x["k_scale"], deterministic=True), leaves(x), w)
    cp = run(lambda x: gdncp.bigdn_cp(comm, *args(x), k_scale=x["k_scale"], deterministic=True), leaves(x), w)
    assert torch.equal(one[0], cp[0])
    for k in one[1]:
        assert torch.equal(one[1][k], cp[1][k]), "d/d %s differs" % k
    check(one, run(eager_fn, leaves(x), w))

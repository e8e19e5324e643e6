"""The PyTorch door's CP layer on CPU ranks under mpirun (MPI_COMM_WORLD):
ranks split the frames; every rank runs the eager float64 coding on the whole
seeded sequence itself and compares its own frames — out and every gradient
(the norm weights' after the sum over ranks).

    mpirun -np 2 /usr/bin/python3 python/tests/run_pytest.py python/tests/test_python_mpi.py
"""
import pytest
import torch

import bigdn_eager as eager
import gdncp

TOL = eager.tolerance("f64")
B, H, D, S = 1, 2, 8, 3
GRADS = ["qkv", "beta", "decay", "q_norm_w", "k_norm_w"]


@pytest.fixture(scope="module")
def comm():
    c = gdncp.Communicator.mpi_world()
    c.timeout = 60.0  # a rank out of step ends in an error, not a hang
    yield c
    c.close()


def local(x, off, F):
    """This rank's frames [off, off + F) of the global inputs."""
    y = dict(x)
    y["qkv"] = x["qkv"][:, off * S:(off + F) * S]
    y["beta"] = x["beta"][:, :, off:off + F]
    y["decay"] = x["decay"][:, :, off:off + F]
    y["rope_cos"] = x["rope_cos"][off * S:(off + F) * S]
    y["rope_sin"] = x["rope_sin"][off * S:(off + F) * S]
    return {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in y.items()}


def leaves(x):
    return {k: (v.clone().requires_grad_(True) if isinstance(v, torch.Tensor) and k in GRADS else v)
            for k, v in x.items()}


def door_step(comm, x, F, w, checkpoint="off", clip_starts=None, exchange="auto"):
    out = gdncp.bigdn_cp(comm, x["qkv"], x["beta"], x["decay"], x["q_norm_w"], x["k_norm_w"], x["rope_cos"],
                         x["rope_sin"], F, S, k_scale=x["k_scale"], checkpoint=checkpoint, clip_starts=clip_starts,
                         exchange=exchange)
    (out * w).sum().backward()
    grads = {k: x[k].grad for k in GRADS if x[k] is not None}
    for k in ("q_norm_w", "k_norm_w"):  # partial per rank: the sum over ranks is the gradient
        if k in grads:
            comm.all_reduce_sum_(grads[k])
    return out.detach(), grads


def clip_mask(F_total):
    """Clips of lengths 2, 1, 2, ... per row, row 1 packed differently; crosses rank boundaries."""
    c = torch.zeros(B, F_total, dtype=torch.float32)
    for b in range(B):
        for f in range(F_total):
            c[b, f] = 1.0 if f == 0 or (f + b) % 3 == 0 else 0.0
    return c


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("checkpoint", ["off", "on"])
@pytest.mark.parametrize("shape", ["even", "uneven", "clips"])
def test_cp_layer_matches_eager(comm, norm, checkpoint, shape, exchange="auto"):
    P, r = comm.size, comm.rank
    # even: 2 frames a rank; uneven: 2·P + 1 frames (5 on 2 ranks = 3 + 2); clips: uneven, packed clips.
    F_total = 2 * P if shape == "even" else 2 * P + 1
    F, off = eager.balanced_split(F_total, P, r)
    x = eager.inputs(B, H, D, F_total, S, seed=21, norm=norm)
    w = torch.randn(B, F_total * S, H, D, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    w_local = w[:, off * S:(off + F) * S].contiguous()
    clips = clip_mask(F_total) if shape == "clips" else None
    clips_local = clips[:, off:off + F].contiguous() if clips is not None else None

    # Collectives first, on every rank, so a failed comparison cannot leave a peer waiting.
    out, grads = door_step(comm, leaves(local(x, off, F)), F, w_local, checkpoint, clips_local, exchange)

    ref = leaves(x)
    out_ref = eager.bigdn(ref["qkv"], ref["beta"], ref["decay"], ref["q_norm_w"], ref["k_norm_w"], ref["rope_cos"],
                          ref["rope_sin"], F_total, S, ref["k_scale"], clip_starts=clips)
    (out_ref * w).sum().backward()
    ref_local = local({k: (v.grad if k in GRADS and v is not None else v) for k, v in ref.items()}, off, F)

    errs = {"out": eager.rel_l2(out, out_ref.detach()[:, off * S:(off + F) * S])}
    for k in grads:
        want = ref[k].grad if k in ("q_norm_w", "k_norm_w") else ref_local[k]
        errs[k] = eager.rel_l2(grads[k], want)
    assert set(grads) == {k for k in GRADS if x[k] is not None}
    bad = {k: e for k, e in errs.items() if not e <= TOL}
    assert not bad, "rank %d of %d: rel L2 above %g: %s" % (r, P, TOL, bad)


@pytest.mark.parametrize("exchange", ["allgather", "log", "hierarchical"])
def test_cp_layer_exchange_matches_eager(comm, exchange):
    """Every exchange of the composites (gdncp/cp.h Exchange), packed clips across ranks."""
    test_cp_layer_matches_eager(comm, True, "off", "clips", exchange)


def test_bad_exchange_is_refused():
    with pytest.raises(ValueError, match="exchange"):
        gdncp._capi.cp_options(exchange="ring")


def test_bad_argument_on_one_rank_raises_on_every_rank(comm):
    P, r = comm.size, comm.rank
    F_total = 2 * P
    F, off = eager.balanced_split(F_total, P, r)
    x = local(eager.inputs(B, H, D, F_total, S, seed=5), off, F)
    if r == P - 1:
        x["decay"] = x["decay"][:, :, : F - 1].contiguous()  # one frame short on the last rank
    with pytest.raises(gdncp.GdncpError) as e:
        gdncp.bigdn_cp(comm, x["qkv"], x["beta"], x["decay"], x["q_norm_w"], x["k_norm_w"], x["rope_cos"],
                       x["rope_sin"], F, S, k_scale=x["k_scale"])
    msg = str(e.value)
    assert ("decay" if r == P - 1 else "rank") in msg, msg
    assert not comm.aborted


def test_from_process_group_wraps_mpi_world(comm):
    import socket

    import torch.distributed as dist

    P, r = comm.size, comm.rank
    # Rank 0 picks a free port; the sum over the MPI ranks tells the others.
    port = torch.zeros(1, dtype=torch.float64)
    if r == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    comm.all_reduce_sum_(port)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % int(port.item()), rank=r, world_size=P)
    try:
        c = gdncp.from_process_group()
        assert (c.rank, c.size, c.backend) == (r, P, "mpi")
        F_total = 2 * P
        F, off = eager.balanced_split(F_total, P, r)
        x = local(eager.inputs(B, H, D, F_total, S, seed=41), off, F)
        w = torch.randn(B, F * S, H, D, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        a = door_step(c, leaves(x), F, w)
        b = door_step(comm, leaves(x), F, w)
        c.close()
        # The frame helpers over the torch.distributed group itself (gloo), uneven: 2·P + 1 frames.
        video = torch.randn(B, (2 * P + 1) * S, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        part = gdncp.split_frames(video, None, 2 * P + 1, dim=1)
        F_u, off_u = eager.balanced_split(2 * P + 1, P, r)
        assert torch.equal(part, video[:, off_u * S:(off_u + F_u) * S])
        assert torch.equal(gdncp.gather_frames(part, None, 2 * P + 1, dim=1), video)
    finally:
        dist.destroy_process_group()
    assert torch.equal(a[0], b[0])
    for k in b[1]:
        assert torch.equal(a[1][k], b[1][k]), k


# --- every entry on P ranks: cp_gdn_raw, cp_cam_gdn_num, cp_scan, uneven frames ----------------------------

ENTRY_CASES = [("cp_gdn_raw", {}), ("cp_gdn_raw", {"reverse_rank_order": True}),
               ("cp_gdn_raw", {"truncate_to_active": 4}), ("cp_gdn_raw", {"clips": True, "checkpoint": "on"}),
               ("cp_cam_gdn_num", {}), ("cp_cam_gdn_num", {"truncate_to_active": 3}),
               ("cp_cam_gdn_num", {"reverse_rank_order": True}),
               ("cp_scan", {"clips": True}), ("cp_scan", {"truncate_to_active": 4})]


def entry_case_inputs(name, F_total, seed):
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    if name == "cp_gdn_raw":
        return eager.inputs(B, H, D, F_total, S, seed=seed), GRADS
    if name == "cp_cam_gdn_num":
        N = F_total * S
        x = dict(q=0.6 * torch.randn(B, H, D, N, generator=g, dtype=f64),
                 k=0.6 * torch.randn(B, H, D, N, generator=g, dtype=f64),
                 v=torch.randn(B, H, D, N, generator=g, dtype=f64),
                 beta=0.1 + 0.8 * torch.rand(B, H, F_total, S, generator=g, dtype=f64),
                 decay=0.5 + 0.49 * torch.rand(B, H, F_total, generator=g, dtype=f64))
        return x, ["q", "k", "v", "beta", "decay"]
    BH = B * H
    x = dict(P=0.1 * torch.randn(BH, F_total, D, D, generator=g, dtype=f64),
             A=torch.randn(BH, F_total, D, D, generator=g, dtype=f64),
             Pz=0.1 * torch.randn(BH, F_total, D, D, generator=g, dtype=f64),
             bz=torch.randn(BH, F_total, D, generator=g, dtype=f64),
             decay=0.5 + 0.49 * torch.rand(B, H, F_total, generator=g, dtype=f64))
    return x, ["P", "A", "Pz", "bz", "decay"]


def frames_of(name, x, off, F):
    """This rank's frames [off, off + F) of an entry's global inputs."""
    if name == "cp_gdn_raw":
        return local(x, off, F)
    y = dict(x)
    if name == "cp_cam_gdn_num":
        for k in ("q", "k", "v"):
            y[k] = x[k][..., off * S:(off + F) * S]
    else:
        for k in ("P", "A", "Pz", "bz"):
            y[k] = x[k][:, off:off + F]
    y["beta"] = x["beta"][:, :, off:off + F] if "beta" in x else None
    y["decay"] = x["decay"][:, :, off:off + F]
    return {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in y.items()}


def output_frames(name, outs, off, F):
    """The frames [off, off + F) of an entry's per-frame outputs; terminal states whole."""
    if name == "cp_gdn_raw":
        num, den = outs[:2]
        cut = [num[:, off * S:(off + F) * S], den[:, :, off * S:(off + F) * S]]
    elif name == "cp_cam_gdn_num":
        cut = [outs[0][..., off * S:(off + F) * S]]
    else:
        cut = [outs[0][:, off:off + F], outs[1][:, off:off + F]]
    return cut + list(outs[len(cut):])


@pytest.mark.parametrize("name,kw", ENTRY_CASES,
                         ids=["%s-%s" % (n, "-".join(k) or "plain") for n, k in ENTRY_CASES])
def test_every_entry_uneven_matches_eager(comm, name, kw):
    P, r = comm.size, comm.rank
    F_total = 2 * P + 1  # uneven: 3 + 2 on 2 ranks
    F, off_rank = eager.balanced_split(F_total, P, r)
    reverse = kw.get("reverse_rank_order", False)
    # Where this rank's frames sit in the global order (reversed: rank P−1's frames come first).
    off = sum(eager.balanced_split(F_total, P, j)[0] for j in range(r + 1, P)) if reverse else off_rank
    K = kw.get("truncate_to_active", 0)
    clips = clip_mask(F_total) if kw.get("clips") else None
    x, names = entry_case_inputs(name, F_total, seed=51)
    opts = {k: v for k, v in kw.items() if k != "clips"}

    def door(y):
        c = None if clips is None else clips[:, off:off + F].contiguous()
        if name == "cp_gdn_raw":
            r_ = gdncp.cp_gdn_raw(comm, *(y[k] for k in GRADS), y["rope_cos"], y["rope_sin"], F, S,
                                  k_scale=y["k_scale"], clip_starts=c, **opts)
        elif name == "cp_cam_gdn_num":
            r_ = gdncp.cp_cam_gdn_num(comm, *(y[k] for k in names), F, S, **opts)
        else:
            r_ = gdncp.cp_scan(comm, *(y[k] for k in names), clip_starts=c, **opts)
        return [t for t in r_ if t is not None]

    def ref(y):
        if name == "cp_gdn_raw":
            o = eager.bigdn(*(y[k] for k in GRADS), y["rope_cos"], y["rope_sin"], F_total, S, y["k_scale"], raw=True,
                            clip_starts=clips, truncate_to_active=K)
        elif name == "cp_cam_gdn_num":
            o = eager.cam_num(*(y[k] for k in names), F_total, S, truncate_to_active=K)
        else:
            o = eager.scan(*(y[k] for k in names), clip_starts=clips, truncate_to_active=K)
        return list(o) if isinstance(o, tuple) else [o]

    ref_leaves = {k: (v.clone().requires_grad_(True) if k in names and v is not None else v) for k, v in x.items()}
    want_all = ref(ref_leaves)
    gw = torch.Generator().manual_seed(9)
    weights = [torch.randn(o.shape, generator=gw, dtype=torch.float64) for o in want_all]
    y = {k: (v.clone().requires_grad_(True) if k in names and v is not None else v)
         for k, v in frames_of(name, x, off, F).items()}
    got = door(y)  # collectives first, on every rank
    loss = sum((o * w).sum() for o, w in zip(got, output_frames(name, weights, off, F)))
    loss.backward()
    grads = {k: y[k].grad for k in names if y[k] is not None}
    for k in ("q_norm_w", "k_norm_w"):
        if k in grads:
            comm.all_reduce_sum_(grads[k])
    # Every rank weighs the terminal states (identical on every rank): the global loss counts them P times.
    n_frames_out = 2 if name != "cp_cam_gdn_num" else 1
    ref_loss = sum((o * w).sum() * (1 if i < n_frames_out else P) for i, (o, w) in enumerate(zip(want_all, weights)))
    ref_loss.backward()
    want = output_frames(name, [o.detach() for o in want_all], off, F)
    assert len(got) == len(want)
    errs = {"out%d" % i: eager.rel_l2(a.detach(), b) for i, (a, b) in enumerate(zip(got, want)) if b.numel()}
    want_grads = frames_of(name, {k: (ref_leaves[k].grad if k in names and ref_leaves[k] is not None else v)
                                  for k, v in x.items()}, off, F)
    for k in grads:
        errs[k] = eager.rel_l2(grads[k], ref_leaves[k].grad if k in ("q_norm_w", "k_norm_w") else want_grads[k])
    bad = {k: e for k, e in errs.items() if not e <= TOL}
    assert not bad, "rank %d of %d: rel L2 above %g: %s" % (r, P, TOL, bad)


def test_split_and_gather_frames_round_trip(comm):
    P, r = comm.size, comm.rank
    F_total = 2 * P + 1
    x = torch.randn(B, F_total * S, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    part = gdncp.split_frames(x, comm, F_total, dim=1)
    F, off = eager.balanced_split(F_total, P, r)
    assert torch.equal(part, x[:, off * S:(off + F) * S])
    assert torch.equal(gdncp.gather_frames(part, comm, F_total, dim=1), x)


def test_sana_raw_on_ranks_matches_eager(comm):
    P, r = comm.size, comm.rank
    F_total = 2 * P + 1
    F, off = eager.balanced_split(F_total, P, r)
    x = eager.inputs(B, H, D, F_total, S, seed=61)
    y = local(x, off, F)
    res = gdncp.sana.cp_fused_gdn_chunkwise_raw_autograd(*(y[k] for k in GRADS), y["rope_cos"], y["rope_sin"], F=F,
                                                         S=S, group=comm, k_scale=y["k_scale"], truncate_to_active=2)
    num, den, tM, tz = eager.bigdn(*(x[k] for k in GRADS), x["rope_cos"], x["rope_sin"], F_total, S, x["k_scale"],
                                   raw=True, truncate_to_active=2)
    assert eager.rel_l2(res.num, num[:, off * S:(off + F) * S]) <= TOL
    assert eager.rel_l2(res.den, den[:, :, off * S:(off + F) * S]) <= TOL
    assert eager.rel_l2(res.terminal_state_kv, tM.transpose(-1, -2)) <= TOL
    assert eager.rel_l2(res.terminal_state_z, tz) <= TOL


def test_retain_graph_rerecords_collectively(comm):
    # A second backward of one graph records the CP call again on every rank (collective) and gives the same grads.
    P, r = comm.size, comm.rank
    # Even frames without norm weights: a call whose arguments differ from the last bigdn_cp call on EVERY rank
    # (under the on_change validation a change on some ranks only puts the ranks out of step).
    F_total = 2 * P
    F, off = eager.balanced_split(F_total, P, r)
    y = leaves(local(eager.inputs(B, H, D, F_total, S, seed=71, norm=False), off, F))
    out = gdncp.bigdn_cp(comm, *(y[k] for k in GRADS), y["rope_cos"], y["rope_sin"], F, S, k_scale=y["k_scale"])
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
    first = torch.autograd.grad((out * w).sum(), [y["qkv"], y["decay"]], retain_graph=True)
    again = torch.autograd.grad((out * w).sum(), [y["qkv"], y["decay"]])  # recorded again, collectively
    for a, b in zip(first, again):
        assert torch.equal(a, b)


# --- the hidden exchange (overlap_exchange) on CPU ranks: accepted, changes nothing --------------------------

@pytest.mark.parametrize("name", ["bigdn_cp", "cp_gdn_raw", "cp_cam_gdn_num", "cp_scan"])
@pytest.mark.parametrize("exchange", ["allgather", "log"])
def test_OverlapExchange_changes_nothing_on_cpu(comm, name, exchange):
    """overlap_exchange=True (gdncp/cp.h CpOptions::overlap_exchange) has no stream to use on the CPU:
    out and every gradient bitwise those with it off, on fresh inputs (each rank its own)."""
    P, r = comm.size, comm.rank
    F_total = 2 * P + 1
    F, off = eager.balanced_split(F_total, P, r)
    base = "cp_gdn_raw" if name == "bigdn_cp" else name
    x, names = entry_case_inputs(base, F_total, seed=int(torch.randint(1 << 30, (1,))))
    x = frames_of(base, x, off, F)

    def step(overlap):
        y = {k: (v.clone().requires_grad_(True) if k in names and v is not None else v) for k, v in x.items()}
        kw = dict(exchange=exchange, overlap_exchange=overlap)
        if name == "bigdn_cp":
            outs = [gdncp.bigdn_cp(comm, *(y[k] for k in GRADS), y["rope_cos"], y["rope_sin"], F, S,
                                   k_scale=y["k_scale"], **kw)]
        elif name == "cp_gdn_raw":
            outs = list(gdncp.cp_gdn_raw(comm, *(y[k] for k in GRADS), y["rope_cos"], y["rope_sin"], F, S,
                                         k_scale=y["k_scale"], **kw)[:2])
        elif name == "cp_cam_gdn_num":
            outs = [gdncp.cp_cam_gdn_num(comm, *(y[k] for k in names), F, S, **kw).out]
        else:
            outs = list(gdncp.cp_scan(comm, *(y[k] for k in names), **kw)[:2])
        gw = torch.Generator().manual_seed(3)
        sum((o * torch.randn(o.shape, generator=gw, dtype=o.dtype)).sum() for o in outs).backward()
        return [o.detach() for o in outs], {k: y[k].grad for k in names if y[k] is not None}

    off_outs, off_grads = step(False)
    on_outs, on_grads = step(True)
    assert len(off_outs) == len(on_outs) and set(off_grads) == set(on_grads) and off_grads
    for i, (a, b) in enumerate(zip(off_outs, on_outs)):
        assert torch.equal(a, b), "rank %d: output %d differs with overlap_exchange=True" % (r, i)
    for k in off_grads:
        assert torch.equal(off_grads[k], on_grads[k]), "rank %d: d %s differs with overlap_exchange=True" % (r, k)


def test_OverlapExchange_and_exchange_reach_the_BiGDN_module(comm):
    """gdncp.BiGDN(comm=..., exchange=..., overlap_exchange=...) is bigdn_cp with those options, bitwise,
    and its repr names them."""
    F = 2
    x = local(eager.inputs(B, H, D, F * comm.size, S, seed=11), F * comm.rank, F)
    for exchange in ("log", "hierarchical", "allgather"):
        layer = gdncp.BiGDN(H, D, comm=comm, k_scale=x["k_scale"], dtype=torch.float64, exchange=exchange,
                            overlap_exchange=True)
        assert ("exchange %s, hidden" % exchange) in repr(layer)
        with torch.no_grad():
            layer.q_norm_w.copy_(x["q_norm_w"])
            layer.k_norm_w.copy_(x["k_norm_w"])
        qkv = x["qkv"].clone().requires_grad_(True)
        out = layer(qkv, x["beta"], x["decay"], x["rope_cos"], x["rope_sin"], F, S)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
        (out * w).sum().backward()
        y = leaves(x)
        ref = gdncp.bigdn_cp(comm, y["qkv"], y["beta"], y["decay"], y["q_norm_w"], y["k_norm_w"], y["rope_cos"],
                             y["rope_sin"], F, S, k_scale=x["k_scale"], exchange=exchange, overlap_exchange=True)
        (ref * w).sum().backward()
        assert torch.equal(out, ref), "rank %d, %s: the module's output differs from bigdn_cp's" % (comm.rank, exchange)
        assert torch.equal(qkv.grad, y["qkv"].grad), exchange
        assert torch.equal(layer.q_norm_w.grad, y["q_norm_w"].grad), exchange
        assert torch.equal(layer.k_norm_w.grad, y["k_norm_w"].grad), exchange
    assert not comm.aborted


def test_OverlapExchange_must_be_a_bool(comm):
    """A value other than True or False is refused on every rank (before any collective), naming it."""
    x = local(eager.inputs(B, H, D, 2 * comm.size, S, seed=5), 2 * comm.rank, 2)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="gdncp.bigdn_cp: overlap_exchange must be True or False"):
            gdncp.bigdn_cp(comm, *(x[k] for k in GRADS), x["rope_cos"], x["rope_sin"], 2, S, k_scale=x["k_scale"],
                           overlap_exchange=bad)
    with pytest.raises(TypeError, match="overlap_exchange"):
        gdncp._capi.cp_options(overlap_exchange=2)
    assert gdncp._capi.cp_options().overlap_exchange == 0
    assert gdncp._capi.cp_options(overlap_exchange=True).overlap_exchange == 1
    assert not comm.aborted

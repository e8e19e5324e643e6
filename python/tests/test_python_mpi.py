"""The PyTorch door's CP layer on CPU ranks under mpirun (MPI_COMM_WORLD):
ranks split the frames; every rank runs the eager float64 coding on the whole
seeded sequence itself and compares its own frames — out and every gradient
(the norm weights' after the sum over ranks).

    mpirun -np 2 python3 python/tests/run_pytest.py python/tests/test_python_mpi.py
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
    finally:
        dist.destroy_process_group()
    assert torch.equal(a[0], b[0])
    for k in b[1]:
        assert torch.equal(a[1][k], b[1][k]), k

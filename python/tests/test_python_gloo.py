"""The CP layer over a torch.distributed gloo group, no MPI: gdncp.from_process_group
drives the library's collectives through the group's own all_gather and broadcast.

Each test starts its ranks itself (subprocesses of this file, a file:// rendezvous)
and every rank compares its frames with the eager float64 coding (bigdn_eager.py) run
on the whole seeded sequence — out and every gradient, the norm weights' after the
sum over the group. Uneven splits, an empty rank, clips crossing rank boundaries,
separate q RoPE tables, a sub-group of the world, and a failing collective.

    python3 python/tests/run_pytest.py python/tests/test_python_gloo.py
"""
import os
import subprocess
import sys
import tempfile

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bigdn_eager as eager  # noqa: E402

B, H, D, S = 2, 2, 8, 3
GRADS = ["qkv", "beta", "decay", "q_norm_w", "k_norm_w"]


# --- the ranks ---------------------------------------------------------------------------------


def local(x, off, F):
    """This rank's frames [off, off + F) of the global inputs."""
    y = dict(x)
    y["qkv"] = x["qkv"][:, off * S:(off + F) * S]
    y["beta"] = x["beta"][:, :, off:off + F]
    y["decay"] = x["decay"][:, :, off:off + F]
    for k in ("rope_cos", "rope_sin", "rope_cos_q", "rope_sin_q"):
        if y.get(k) is not None:
            y[k] = x[k][off * S:(off + F) * S]
    if y.get("clip_starts") is not None:
        y["clip_starts"] = x["clip_starts"][:, off:off + F]
    return {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in y.items()}


def leaves(x):
    return {k: (v.clone().requires_grad_(True) if isinstance(v, torch.Tensor) and k in GRADS else v)
            for k, v in x.items()}


def global_inputs(F_total, seed, clips, q_tables):
    x = eager.inputs(B, H, D, F_total, S, seed=seed)
    x["clip_starts"] = None
    if clips:  # starts at 0, 2, 3, 5, ... (row 1 shifted by one): several cross rank boundaries
        c = torch.zeros(B, F_total, dtype=torch.float32)
        for b in range(B):
            for f in range(F_total):
                c[b, f] = 1.0 if f == 0 or (f + b) % 3 == 2 else 0.0
        x["clip_starts"] = c
    x["rope_cos_q"] = x["rope_sin_q"] = None
    if q_tables:
        x["rope_cos_q"], x["rope_sin_q"] = eager.rope_tables(F_total * S, D, offset=4, base=700.0)
    return x


def check_layer(gdncp, comm, frames, seed, clips=False, q_tables=False):
    """bigdn_cp on this rank's share of `frames` vs the eager coding of the whole sequence."""
    r = comm.rank
    F_total, F, off = sum(frames), frames[r], sum(frames[:r])
    x = global_inputs(F_total, seed, clips, q_tables)
    w = torch.randn(B, F_total * S, H, D, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)

    ref = leaves(x)
    out_ref = eager.bigdn(ref["qkv"], ref["beta"], ref["decay"], ref["q_norm_w"], ref["k_norm_w"], ref["rope_cos"],
                          ref["rope_sin"], F_total, S, ref["k_scale"], clip_starts=ref["clip_starts"],
                          rope_cos_q=ref["rope_cos_q"], rope_sin_q=ref["rope_sin_q"])
    (out_ref * w).sum().backward()

    y = leaves(local(x, off, F))
    out = gdncp.bigdn_cp(comm, y["qkv"], y["beta"], y["decay"], y["q_norm_w"], y["k_norm_w"], y["rope_cos"],
                         y["rope_sin"], F, S, k_scale=y["k_scale"], clip_starts=y["clip_starts"],
                         rope_cos_q=y["rope_cos_q"], rope_sin_q=y["rope_sin_q"])
    w_local = w[:, off * S:(off + F) * S]
    (out * w_local).sum().backward()
    for k in ("q_norm_w", "k_norm_w"):  # partial per rank: the sum over the group is the gradient
        comm.all_reduce_sum_(y[k].grad)

    tol = eager.tolerance("f64")
    what = "frames %s rank %d clips %s q_tables %s" % (frames, r, clips, q_tables)
    expect = {
        "out": (out.detach(), out_ref.detach()[:, off * S:(off + F) * S]),
        "qkv": (y["qkv"].grad, ref["qkv"].grad[:, off * S:(off + F) * S]),
        "beta": (y["beta"].grad, ref["beta"].grad[:, :, off:off + F]),
        "decay": (y["decay"].grad, ref["decay"].grad[:, :, off:off + F]),
        "q_norm_w": (y["q_norm_w"].grad, ref["q_norm_w"].grad),
        "k_norm_w": (y["k_norm_w"].grad, ref["k_norm_w"].grad),
    }
    for k, (a, e) in expect.items():
        assert a is not None and a.shape == e.shape, (k, what)
        if F == 0 and k not in ("q_norm_w", "k_norm_w"):
            assert a.numel() == 0, (k, what)
            continue
        err = eager.rel_l2(a, e)
        assert err <= tol, "%s: rel L2 %.3g > %.3g (%s)" % (k, err, tol, what)


def rank_main(case, rank, size, init):
    import torch.distributed as dist

    import gdncp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        if case == "subgroup":  # the CP group is ranks 1..size-1 of the world (rank 0 sits out)
            sub = dist.new_group(list(range(1, size)))
            if rank == 0:
                return
            comm = gdncp.from_process_group(sub)
            assert (comm.rank, comm.size, comm.backend) == (rank - 1, size - 1, "callbacks")
            check_layer(gdncp, comm, [3, 2], seed=71, clips=True)
            return
        if case == "failure":
            run_failure(gdncp)
            return
        # A communicator per split: under the default validation policy (on_change) a split in which some
        # rank's share stays the same is a new call on the other ranks only (ranks out of step).
        splits = {2: [[2, 2], [3, 2], [0, 5]], 3: [[2, 2, 1], [2, 0, 3], [1, 3, 1]]}[size]
        cases = [dict(frames=f, seed=10 * i + size) for i, f in enumerate(splits)]
        cases += [dict(frames=splits[1], seed=50 + size, clips=True),
                  dict(frames=splits[1], seed=60 + size, clips=True, q_tables=True)]
        for c in cases:
            comm = gdncp.from_process_group()
            assert (comm.rank, comm.size, comm.backend) == (rank, size, "callbacks")
            check_layer(gdncp, comm, **c)
            comm.close()
    finally:
        dist.destroy_process_group()


def call(gdncp, comm, frames, seed):
    x = local(global_inputs(sum(frames), seed, False, False), sum(frames[:comm.rank]), frames[comm.rank])
    F = frames[comm.rank]
    return gdncp.bigdn_cp(comm, x["qkv"], x["beta"], x["decay"], x["q_norm_w"], x["k_norm_w"], x["rope_cos"],
                          x["rope_sin"], F, S, k_scale=x["k_scale"])


def run_failure(gdncp):
    """Ownership that changes on one rank alone works; a collective that fails in the caller's transport:
    gdncp errors on every rank naming the collective, then an aborted communicator."""
    from gdncp import comm as comm_module

    comm = gdncp.from_process_group()
    frames = [2] * comm.size
    check_layer(gdncp, comm, frames, seed=90)  # usable first
    # Rank 0's share changes alone (a video of another length): a legitimate call, right on every rank.
    check_layer(gdncp, comm, [3] + frames[1:], seed=92)
    assert not comm.aborted
    comm.close()

    comm = gdncp.from_process_group()
    check_layer(gdncp, comm, frames, seed=93)
    impl = comm_module._tables[max(comm_module._tables)][0]  # the newest communicator's collectives

    def broken(out, inp, n):
        raise RuntimeError("the transport is down")

    impl.all_gather = broken
    with pytest.raises(gdncp.GdncpError) as e:
        call(gdncp, comm, frames, 91)
    msg = str(e.value)
    assert "all_gather" in msg and "the transport is down" in msg, msg
    assert comm.aborted
    with pytest.raises(gdncp.GdncpError, match="aborted"):
        call(gdncp, comm, frames, 91)
    comm.close()


# --- the tests: start the ranks, collect their verdicts ---------------------------------------------


def run_ranks(case, size, timeout=600):
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "rendezvous")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), case, str(r), str(size), init],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) for r in range(size)]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=timeout)[0].decode("utf-8", "replace"))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail("%s on %d ranks: timed out after %ds" % (case, size, timeout))
        for r, (p, out) in enumerate(zip(procs, outs)):
            assert p.returncode == 0, "rank %d of %d (%s) failed:\n%s" % (r, size, case, out)
            assert "rank done" in out, out


@pytest.mark.parametrize("size", [2, 3])
def test_gloo_bigdn_cp_matches_eager(size):
    run_ranks("layer", size)


def test_gloo_subgroup_of_the_world():
    run_ranks("subgroup", 3)


def test_gloo_callback_failure_names_the_collective():
    run_ranks("failure", 2)


if __name__ == "__main__":
    case, rank, size, init = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    rank_main(case, rank, size, init)
    print("rank done")

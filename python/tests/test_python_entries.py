"""Every entry of the PyTorch package on the CPU, one rank: gradcheck in
float64, every entry against the eager float64 coding (bigdn_eager.py), the
autograd contract (retain_graph, repeated backward, double backward, version
counters), the argument refusals, gdncp.sana against the same coding, the
helpers, and the torch.compile path (torch >= 2.4)."""
import math

import pytest
import torch

import bigdn_eager as eager
import gdncp

TOL = eager.tolerance("f64")
f64 = torch.float64
LAYER = ["qkv", "beta", "decay", "q_norm_w", "k_norm_w"]


@pytest.fixture(scope="module")
def comm():
    c = gdncp.Communicator.mpi_world()
    if c.size != 1:
        pytest.skip("runs on one rank (test_python_mpi.py covers more)")
    c.timeout = 60.0
    yield c
    c.close()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def clips_of(B, F):
    """Row 0: clips 1, F−1; row 1 (if any): one clip per frame pair."""
    c = torch.zeros(B, F, dtype=torch.bool)
    c[:, 0] = True
    c[0, 1 % F] = True
    if B > 1:
        c[1, ::2] = True
    return c


def scan_inputs(B, H, D, F, seed):
    g = gen(seed)
    BH = B * H
    return dict(P=0.1 * torch.randn(BH, F, D, D, generator=g, dtype=f64),
                A=torch.randn(BH, F, D, D, generator=g, dtype=f64),
                Pz=0.1 * torch.randn(BH, F, D, D, generator=g, dtype=f64),
                bz=torch.randn(BH, F, D, generator=g, dtype=f64),
                decay=0.5 + 0.49 * torch.rand(B, H, F, generator=g, dtype=f64))


def cam_inputs(B, H, D, F, S, seed, per_frame_beta=False):
    g = gen(seed)
    N = F * S
    return dict(q=0.6 * torch.randn(B, H, D, N, generator=g, dtype=f64),
                k=0.6 * torch.randn(B, H, D, N, generator=g, dtype=f64),
                v=torch.randn(B, H, D, N, generator=g, dtype=f64),
                beta=0.1 + 0.8 * torch.rand(*((B, H, F) if per_frame_beta else (B, H, F, S)), generator=g, dtype=f64),
                decay=0.5 + 0.49 * torch.rand(B, H, F, generator=g, dtype=f64))


# --- the entries, each as (door, eager) closures over the same inputs -----------------------------------------

def layer_args(x):
    return [x[k] for k in LAYER] + [x["rope_cos"], x["rope_sin"]]


def q_tables(kw):
    return {k: kw[k] for k in ("rope_cos_q", "rope_sin_q") if k in kw}


def entry(name, comm, F, S, k_scale=None, **kw):
    """(door, eager, names of the differentiable inputs): door(x) and eager(x) -> a tuple of tensors."""
    if name in ("bigdn", "bigdn_cp"):
        head = (comm,) if name == "bigdn_cp" else ()
        fn = getattr(gdncp, name)
        return (lambda x: (fn(*head, *layer_args(x), F, S, k_scale=x["k_scale"], **kw),),
                lambda x: (eager.bigdn(*layer_args(x), F, S, x["k_scale"], clip_starts=kw.get("clip_starts"),
                                       **q_tables(kw)),),
                LAYER)
    if name == "cp_gdn_raw":
        K = kw.get("truncate_to_active") or 0
        return (lambda x: tuple(t for t in gdncp.cp_gdn_raw(comm, *layer_args(x), F, S, k_scale=x["k_scale"], **kw)
                                if t is not None),
                lambda x: eager.bigdn(*layer_args(x), F, S, x["k_scale"], raw=True,
                                      clip_starts=kw.get("clip_starts"), truncate_to_active=K, **q_tables(kw)),
                LAYER)
    if name == "cp_cam_gdn_num":
        K = kw.get("truncate_to_active") or 0
        names = ["q", "k", "v", "beta", "decay"]

        def door(x):
            r = gdncp.cp_cam_gdn_num(comm, *(x[n] for n in names), F, S, **kw)
            return tuple(t for t in r if t is not None)

        def ref(x):
            r = eager.cam_num(*(x[n] for n in names), F, S, truncate_to_active=K)
            return r if isinstance(r, tuple) else (r,)

        return door, ref, names
    if name == "cp_scan":
        K = kw.get("truncate_to_active") or 0
        names = ["P", "A", "Pz", "bz", "decay"]

        def door(x):
            return tuple(t for t in gdncp.cp_scan(comm, *(x[n] for n in names), **kw) if t is not None)

        return door, lambda x: eager.scan(*(x[n] for n in names), clip_starts=kw.get("clip_starts"),
                                          truncate_to_active=K), names
    raise ValueError(name)


def inputs_for(name, B, H, D, F, S, seed):
    if name == "cp_cam_gdn_num":
        return cam_inputs(B, H, D, F, S, seed)
    if name == "cp_scan":
        return scan_inputs(B, H, D, F, seed)
    return eager.inputs(B, H, D, F, S, seed=seed)


def leaves(x, names):
    return {k: (v.clone().requires_grad_(True) if k in names and isinstance(v, torch.Tensor) else v)
            for k, v in x.items()}


def step(fn, x, names, weights):
    outs = fn(x)
    loss = sum((o * w).sum() for o, w in zip(outs, weights))
    loss.backward()
    return [o.detach() for o in outs], {k: x[k].grad for k in names if x[k] is not None}


EVERY = [
    ("bigdn", {}), ("bigdn", {"checkpoint": "on"}), ("bigdn", {"clip_starts": "clips"}), ("bigdn", {"rope_q": 1}),
    ("bigdn_cp", {}), ("bigdn_cp", {"clip_starts": "clips", "checkpoint": "on"}),
    ("bigdn_cp", {"rope_q": 1, "checkpoint": "on"}),
    ("cp_gdn_raw", {}), ("cp_gdn_raw", {"truncate_to_active": 2}), ("cp_gdn_raw", {"reverse_rank_order": True}),
    ("cp_gdn_raw", {"rope_q": 1, "truncate_to_active": 2}),
    ("cp_gdn_raw", {"truncate_to_active": 3, "clip_starts": "clips", "checkpoint": "on"}),
    ("cp_cam_gdn_num", {}), ("cp_cam_gdn_num", {"truncate_to_active": 2, "checkpoint": "on"}),
    ("cp_cam_gdn_num", {"reverse_rank_order": True}),
    ("cp_scan", {}), ("cp_scan", {"truncate_to_active": 2}), ("cp_scan", {"clip_starts": "clips"}),
    ("cp_scan", {"reverse_rank_order": True}),
]


def resolve(kw, B, F, S, D):
    """"clips": a clip mask; rope_q: q's own RoPE tables (another offset and base than k's)."""
    out = {k: (clips_of(B, F) if v == "clips" else v) for k, v in kw.items() if k != "rope_q"}
    if kw.get("rope_q"):
        out["rope_cos_q"], out["rope_sin_q"] = eager.rope_tables(F * S, D, offset=5, base=300.0)
    return out


@pytest.mark.parametrize("name,kw", EVERY, ids=["%s-%s" % (n, "-".join(k) or "plain") for n, k in EVERY])
def test_every_entry_matches_eager(comm, name, kw):
    B, H, D, F, S = 2, 2, 6, 4, 3
    kw = resolve(kw, B, F, S, D)
    door, ref, names = entry(name, comm, F, S, **kw)
    x = inputs_for(name, B, H, D, F, S, seed=31)
    want_outs = ref(leaves(x, names))
    weights = [torch.randn(o.shape, generator=gen(7 + i), dtype=f64) for i, o in enumerate(want_outs)]
    got = step(door, leaves(x, names), names, weights)
    want = step(ref, leaves(x, names), names, weights)
    assert len(got[0]) == len(want[0])
    for i, (a, b) in enumerate(zip(got[0], want[0])):
        assert a.shape == b.shape and a.dtype == f64, (i, a.shape, b.shape)
        assert eager.rel_l2(a, b) <= TOL, "output %d: rel %.3g" % (i, eager.rel_l2(a, b))
    assert got[1].keys() == want[1].keys()
    for k in want[1]:
        assert eager.rel_l2(got[1][k], want[1][k]) <= TOL, "d/d %s: rel %.3g" % (k, eager.rel_l2(got[1][k], want[1][k]))


@pytest.mark.parametrize("name,kw", EVERY, ids=["%s-%s" % (n, "-".join(k) or "plain") for n, k in EVERY])
def test_gradcheck_every_entry(comm, name, kw):
    B, H, D, F, S = 2, 1, 2, 3, 2
    kw = resolve(kw, B, F, S, D)
    kw = {k: (min(v, F) if k == "truncate_to_active" else v) for k, v in kw.items()}
    door, _, names = entry(name, comm, F, S, **kw)
    x = inputs_for(name, B, H, D, F, S, seed=43)
    diff = [k for k in names if x[k] is not None]

    def f(*ts):
        return door({**x, **dict(zip(diff, ts))})

    assert torch.autograd.gradcheck(f, [x[k].clone().requires_grad_(True) for k in diff], eps=1e-6, atol=1e-8,
                                    rtol=1e-6)


def test_gradcheck_bigdn_plain_function():
    # gradcheck straight on gdncp.bigdn, as a user would call it.
    x = eager.inputs(1, 1, 4, 2, 2, seed=3)
    args = [x[k].clone().requires_grad_(True) for k in LAYER] + [x["rope_cos"], x["rope_sin"], 2, 2]
    assert torch.autograd.gradcheck(gdncp.bigdn, args, eps=1e-6, atol=1e-8, rtol=1e-6)


# --- the autograd contract ---------------------------------------------------------------------------------

def small_layer(seed=5):
    x = eager.inputs(1, 2, 4, 3, 2, seed=seed)
    return leaves(x, LAYER), 3, 2


def test_retain_graph_and_repeated_backward():
    x, F, S = small_layer()
    out = gdncp.bigdn(*layer_args(x), F, S, k_scale=x["k_scale"])
    w = torch.randn(out.shape, generator=gen(2), dtype=f64)
    (out * w).sum().backward(retain_graph=True)  # the forward's graph
    first = {k: x[k].grad.clone() for k in LAYER}
    (out * w).sum().backward(retain_graph=True)  # recorded again from the saved inputs
    (out * w).sum().backward()
    for k in LAYER:
        assert torch.allclose(x[k].grad, 3 * first[k], rtol=1e-12, atol=0), k
    with pytest.raises(RuntimeError, match="second time|freed"):  # torch's own error, not an AttributeError
        (out * w).sum().backward()


def test_retain_graph_cp_entry_collective_rerecord(comm):
    x, F, S = small_layer(seed=6)
    r = gdncp.cp_gdn_raw(comm, *layer_args(x), F, S, k_scale=x["k_scale"], truncate_to_active=2)
    loss = r.num.sum() + r.den.sum() + r.terminal_M.sum() + r.terminal_z.sum()
    g1 = torch.autograd.grad(loss, [x["qkv"], x["decay"]], retain_graph=True)
    g2 = torch.autograd.grad(loss, [x["qkv"], x["decay"]])
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_double_backward_refused():
    x, F, S = small_layer()
    out = gdncp.bigdn(*layer_args(x), F, S, k_scale=x["k_scale"])
    (g,) = torch.autograd.grad(out.sum(), [x["qkv"]], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        g.sum().backward()


@pytest.mark.parametrize("what", ["leaf_under_no_grad", "non_leaf", "rope_sin", "clip_mask"])
def test_in_place_edit_after_forward_raises_version_error(what):
    x, F, S = small_layer()
    clips = torch.tensor([[1.0, 0.0, 1.0]])
    qkv = x["qkv"] * 1.0 if what == "non_leaf" else x["qkv"]
    out = gdncp.bigdn(qkv, *(x[k] for k in LAYER[1:]), x["rope_cos"], x["rope_sin"], F, S, k_scale=x["k_scale"],
                      clip_starts=clips)
    with torch.no_grad():
        {"leaf_under_no_grad": x["decay"], "non_leaf": qkv, "rope_sin": x["rope_sin"], "clip_mask": clips}[what].mul_(
            0.5 if what != "clip_mask" else 1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# --- refusals ---------------------------------------------------------------------------------------------

def test_rope_tables_requiring_grad_refused():
    x, F, S = small_layer()
    with pytest.raises(ValueError, match="rope_cos requires grad"):
        gdncp.bigdn(*layer_args({**x, "rope_cos": x["rope_cos"].clone().requires_grad_(True)}), F, S)


def test_module_checks_heads_and_head_dim():
    x = eager.inputs(1, 2, 4, 2, 2, seed=1)  # H = 2, D = 4
    layer = gdncp.BiGDN(heads=4, head_dim=2, dtype=f64)  # same C = 8, other split
    with pytest.raises(ValueError, match=r"heads=4, head_dim=2.*qkv must be"):
        layer(x["qkv"], x["beta"], x["decay"], x["rope_cos"], x["rope_sin"], 2, 2)


def test_clip_mask_bool_accepted_other_dtypes_and_values_refused():
    x, F, S = small_layer()
    as_bool = torch.tensor([[True, False, True]])
    a = gdncp.bigdn(*layer_args(x), F, S, k_scale=x["k_scale"], clip_starts=as_bool)
    b = gdncp.bigdn(*layer_args(x), F, S, k_scale=x["k_scale"], clip_starts=as_bool.float())
    assert torch.equal(a, b)
    assert eager.rel_l2(a, gdncp.bigdn(*layer_args(x), F, S, k_scale=x["k_scale"])) > 1e-3  # the mask matters
    for bad, msg in [(as_bool.long(), "bool or float32"), (as_bool.double(), "bool or float32"),
                     (2 * as_bool.float(), "only 0 and 1")]:
        with pytest.raises((TypeError, ValueError), match="clip_starts.*" + msg):
            gdncp.bigdn(*layer_args(x), F, S, clip_starts=bad)


def test_q_rope_tables_alone_or_requiring_grad_refused():
    x, F, S = small_layer()
    with pytest.raises(gdncp.GdncpError, match="rope_sin_q"):
        gdncp.bigdn(*layer_args(x), F, S, rope_cos_q=x["rope_cos"])
    with pytest.raises(ValueError, match="rope_cos_q requires grad"):
        gdncp.bigdn(*layer_args(x), F, S, rope_cos_q=x["rope_cos"].clone().requires_grad_(True),
                    rope_sin_q=x["rope_sin"])


# --- gdncp.sana --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gloo_group(comm):
    """A one-rank torch.distributed gloo group (the group Sana's entries take)."""
    import os
    import tempfile

    import torch.distributed as dist

    path = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method="file://" + path, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_sana_fused_bigdn_none_norm_weights_are_ones():
    x = eager.inputs(2, 2, 4, 3, 2, seed=8)
    ones = torch.ones(8, dtype=f64)
    got = gdncp.sana.fused_bigdn_chunkwise_autograd(x["qkv"], x["beta"], x["decay"], None, None, x["rope_cos"],
                                                    x["rope_sin"], 3, 2, k_scale=x["k_scale"], dot_precision=2)
    want = eager.bigdn(x["qkv"], x["beta"], x["decay"], ones, ones, x["rope_cos"], x["rope_sin"], 3, 2, x["k_scale"])
    assert eager.rel_l2(got, want) <= TOL
    with pytest.raises(ValueError, match="dot_precision"):
        gdncp.sana.fused_bigdn_chunkwise_autograd(*layer_args(x), 3, 2, dot_precision=3)


def test_sana_raw_matches_eager_with_group(gloo_group):
    x = leaves(eager.inputs(1, 2, 4, 4, 2, seed=9), LAYER)
    r = gdncp.sana.cp_fused_gdn_chunkwise_raw_autograd(*layer_args(x), F=4, S=2, group=gloo_group,
                                                       k_scale=x["k_scale"], truncate_to_active=3, use_checkpoint=True)
    ref = leaves(eager.inputs(1, 2, 4, 4, 2, seed=9), LAYER)
    num, den, tM, tz = eager.bigdn(*layer_args(ref), 4, 2, ref["k_scale"], raw=True, truncate_to_active=3)
    # Sana's terminal KV state is S = Mᵀ ([value][key]).
    pairs = [(r.num, num), (r.den, den), (r.terminal_state_kv, tM.transpose(-1, -2)), (r.terminal_state_z, tz)]
    for a, b in pairs:
        assert eager.rel_l2(a.detach(), b.detach()) <= TOL
    sum((a * (i + 1)).sum() for i, (a, _) in enumerate(pairs)).backward()
    sum((b * (i + 1)).sum() for i, (_, b) in enumerate(pairs)).backward()
    for k in LAYER:
        assert eager.rel_l2(x[k].grad, ref[k].grad) <= TOL, k
    plain = gdncp.sana.cp_fused_gdn_chunkwise_raw_autograd(*layer_args(x), F=4, S=2, group=gloo_group)
    assert plain.terminal_state_kv is None and plain.terminal_state_z is None


def test_sana_cam_matches_eager(gloo_group):
    x = cam_inputs(1, 2, 4, 3, 2, seed=10, per_frame_beta=True)
    out, term = gdncp.sana.cp_fused_cam_gdn_num_autograd(x["q"], x["k"], x["v"], x["beta"], x["decay"], F=3, S=2,
                                                          group=gloo_group, truncate_to_active=2)
    out_ref, term_ref = eager.cam_num(x["q"], x["k"], x["v"], x["beta"], x["decay"], 3, 2, truncate_to_active=2)
    assert eager.rel_l2(out, out_ref) <= TOL
    assert eager.rel_l2(term, term_ref.transpose(-1, -2)) <= TOL


def test_sana_frame_scan_right_multiplied(comm):
    g = gen(12)
    BH, F, D = 3, 4, 4
    W_kv = 0.5 * torch.eye(D, dtype=f64) + 0.1 * torch.randn(BH, F, D, D, generator=g, dtype=f64)
    U_kv = torch.randn(BH, F, D, D, generator=g, dtype=f64)
    W_z = 0.5 * torch.eye(D, dtype=f64) + 0.1 * torch.randn(BH, F, D, D, generator=g, dtype=f64)
    U_z = torch.randn(BH, F, D, generator=g, dtype=f64)
    leaves_ = [t.clone().requires_grad_(True) for t in (W_kv, U_kv, W_z, U_z)]
    S_kv, S_z = gdncp.sana.cp_frame_gdn_scan(*leaves_, group=comm)
    S, z, Ss, zs = torch.zeros(BH, D, D, dtype=f64), torch.zeros(BH, D, dtype=f64), [], []
    ref = [t.clone().requires_grad_(True) for t in (W_kv, U_kv, W_z, U_z)]
    for f in range(F):
        S = S @ ref[0][:, f] + ref[1][:, f]
        z = (ref[2][:, f] @ z[..., None])[..., 0] + ref[3][:, f]
        Ss.append(S)
        zs.append(z)
    S_ref, z_ref = torch.stack(Ss, 1), torch.stack(zs, 1)
    assert eager.rel_l2(S_kv.detach(), S_ref.detach()) <= TOL and eager.rel_l2(S_z.detach(), z_ref.detach()) <= TOL
    (S_kv.sum() + 2 * S_z.sum()).backward()
    (S_ref.sum() + 2 * z_ref.sum()).backward()
    for a, b in zip(leaves_, ref):
        assert eager.rel_l2(a.grad, b.grad) <= TOL
    r = gdncp.sana.cp_frame_gdn_scan(W_kv, U_kv, W_z, U_z, group=comm, truncate_to_active=2)
    assert eager.rel_l2(r.terminal_state_kv, S_ref[:, 1].detach()) <= TOL
    assert eager.rel_l2(r.terminal_state_z, z_ref[:, 1].detach()) <= TOL


# --- helpers -------------------------------------------------------------------------------------------------

def test_rope_tables_convention():
    cos, sin = gdncp.rope_tables(5, 6, offset=3, dtype=f64)
    cos_ref, sin_ref = eager.rope_tables(5, 6, offset=3)
    assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)
    # The sign lives in sin: pair (x0, x1) turns by +θ.
    x = torch.tensor([1.0, 0.0] * 3, dtype=f64)
    rot = x * cos[1] + x.reshape(3, 2).flip(-1).reshape(6) * sin[1]
    theta = 4.0  # token 1 + offset 3, pair 0
    assert torch.allclose(rot[:2], torch.tensor([math.cos(theta), math.sin(theta)], dtype=f64), rtol=0, atol=1e-15)
    assert cos.dtype == f64 and gdncp.rope_tables(2, 4)[0].dtype == torch.float32
    with pytest.raises(ValueError, match="even"):
        gdncp.rope_tables(2, 5)


def test_split_and_gather_frames_one_rank(comm):
    x = torch.randn(2, 5 * 3, 4, generator=gen(1), dtype=f64)
    part = gdncp.split_frames(x, comm, 5, dim=1)
    assert torch.equal(part, x)
    assert torch.equal(gdncp.gather_frames(part, comm, 5, dim=1), x)
    assert gdncp.balanced_split(21, 2, 0) == (11, 0) and gdncp.balanced_split(21, 2, 1) == (10, 11)
    with pytest.raises(ValueError, match="multiple"):
        gdncp.split_frames(x, comm, 4, dim=1)


# --- torch.compile (custom ops, torch >= 2.4) -----------------------------------------------------------------

def test_compile_fullgraph_bigdn_module_matches_eager():
    if not hasattr(torch.library, "custom_op"):
        pytest.skip("torch %s < 2.4: no torch.library custom ops (autograd.Function path only)" % torch.__version__)
    assert gdncp._ops.REGISTERED, gdncp._ops.UNAVAILABLE
    torch.manual_seed(0)
    B, H, D, F, S = 1, 2, 4, 3, 2
    x = eager.inputs(B, H, D, F, S, seed=14, dtype=torch.float32)
    x["rope_cos"], x["rope_sin"] = gdncp.rope_tables(F * S, D)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(H * D, 3 * H * D)
            self.attn = gdncp.BiGDN(H, D)

        def forward(self, h, beta, decay, cos, sin):
            qkv = self.proj(h).reshape(B, F * S, 3, H, D)
            return self.attn(qkv, beta, decay, cos, sin, F, S).reshape(B, F * S, H * D).sum()

    model = Model()
    h = torch.randn(B, F * S, H * D)
    args = (h, x["beta"].float(), x["decay"].float(), x["rope_cos"], x["rope_sin"])
    loss_eager = model(*args)
    grads_eager = torch.autograd.grad(loss_eager, list(model.parameters()))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss_c = compiled(*args)
    grads_c = torch.autograd.grad(loss_c, list(model.parameters()))
    assert torch.allclose(loss_c, loss_eager, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads_c, grads_eager):
        assert eager.rel_l2(a, b) <= 1e-6


def test_custom_ops_opcheck_bigdn():
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch %s < 2.4: no torch.library.opcheck" % torch.__version__)
    assert gdncp._ops.REGISTERED, gdncp._ops.UNAVAILABLE
    x = eager.inputs(1, 2, 4, 3, 2, seed=15)
    args = tuple(x[k].clone().requires_grad_(True) for k in LAYER) + (x["rope_cos"], x["rope_sin"], None, None, None, 3,
                                                                      2, x["k_scale"], 1e-5, 1e-6, "auto", "off",
                                                                      False, 0)
    torch.library.opcheck(torch.ops.gdncp.bigdn, args)

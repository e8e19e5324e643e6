"""Separate q RoPE tables (rope_cos_q, rope_sin_q) through the PyTorch door, one
process: gdncp.bigdn against the eager float64 coding (bigdn_eager.py) with q
and k rotated by different tables — out and every gradient — and equal tables
bitwise the same as omitting them. (bigdn_cp with q tables: test_python_gloo.py.)
"""
import pytest
import torch

import bigdn_eager as eager
import gdncp

B, H, D, F, S = 2, 2, 8, 4, 3
GRADS = ["qkv", "beta", "decay", "q_norm_w", "k_norm_w"]


def leaves(x):
    return {k: (v.clone().requires_grad_(True) if isinstance(v, torch.Tensor) and k in GRADS else v)
            for k, v in x.items()}


def step(fn, x, w, **kw):
    out = fn(x["qkv"], x["beta"], x["decay"], x["q_norm_w"], x["k_norm_w"], x["rope_cos"], x["rope_sin"], F, S,
             k_scale=x["k_scale"], **kw)
    (out * w).sum().backward()
    return out.detach(), {k: x[k].grad for k in GRADS}


@pytest.mark.parametrize("checkpoint", ["off", "on"])
def test_rope_q_matches_eager(checkpoint):
    x = eager.inputs(B, H, D, F, S, seed=31)
    cos_q, sin_q = eager.rope_tables(F * S, D, offset=5, base=300.0)
    w = torch.randn(B, F * S, H, D, generator=torch.Generator().manual_seed(32), dtype=torch.float64)

    def eager_fn(*a, k_scale, rope_cos_q, rope_sin_q):
        return eager.bigdn(*a, k_scale=k_scale, rope_cos_q=rope_cos_q, rope_sin_q=rope_sin_q)

    ref_out, ref_grads = step(eager_fn, leaves(x), w, rope_cos_q=cos_q, rope_sin_q=sin_q)
    out, grads = step(gdncp.bigdn, leaves(x), w, rope_cos_q=cos_q, rope_sin_q=sin_q, checkpoint=checkpoint)
    plain, _ = step(gdncp.bigdn, leaves(x), w)
    tol = eager.tolerance("f64")
    assert eager.rel_l2(plain, ref_out) > 1e-3  # the q tables matter
    assert eager.rel_l2(out, ref_out) <= tol
    for k in GRADS:
        err = eager.rel_l2(grads[k], ref_grads[k])
        assert err <= tol, "%s: rel L2 %.3g" % (k, err)


def test_equal_q_tables_bitwise_as_omitted():
    x = eager.inputs(B, H, D, F, S, seed=33, dtype=torch.float32)
    w = torch.randn(B, F * S, H, D, generator=torch.Generator().manual_seed(34))
    a_out, a_grads = step(gdncp.bigdn, leaves(x), w)
    b_out, b_grads = step(gdncp.bigdn, leaves(x), w, rope_cos_q=x["rope_cos"].clone(),
                          rope_sin_q=x["rope_sin"].clone())
    assert torch.equal(a_out, b_out)
    for k in GRADS:
        assert torch.equal(a_grads[k], b_grads[k]), k


def test_lone_q_table_is_named():
    x = eager.inputs(B, H, D, F, S, seed=35)
    with pytest.raises(gdncp.GdncpError, match="rope_sin_q"):
        gdncp.bigdn(x["qkv"], x["beta"], x["decay"], x["q_norm_w"], x["k_norm_w"], x["rope_cos"], x["rope_sin"], F,
                    S, k_scale=x["k_scale"], rope_cos_q=x["rope_cos"])

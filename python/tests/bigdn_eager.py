"""An independent eager PyTorch coding of the layer's math (docs/design.md
§2-§5), float64, for the Python tests: plain tensor ops, one frame at a
time, differentiated by torch.autograd. Nothing here calls gdncp.

Layouts as gdncp/bigdn.h: qkv (B, N, 3, H, D), beta (B, H, F, S), decay
(B, H, F), norm weights (C) or None, rope tables (N, D) with the sign in sin.
"""
import math

import torch


def rope_tables(N, D, offset=0, base=10000.0, dtype=torch.float64):
    """cos, sin (N, D) of the pair layout: rope(x)[d] = x[d]·cos[d] + x[d^1]·sin[d]."""
    n = torch.arange(N, dtype=torch.float64)[:, None] + offset
    i = torch.arange(D // 2, dtype=torch.float64)[None, :]
    theta = n * base ** (-2.0 * i / D)
    cos = torch.repeat_interleave(torch.cos(theta), 2, dim=1)
    sin = torch.stack([-torch.sin(theta), torch.sin(theta)], dim=-1).reshape(N, D)
    return cos.to(dtype), sin.to(dtype)


def inputs(B, H, D, F, S, seed, norm=True, dtype=torch.float64):
    """Seeded layer inputs (every rank draws the same global ones):
    beta in (0.1, 0.9), decay in (0.5, 0.99), norm weights in (0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    N = F * S
    x = dict(
        qkv=torch.randn(B, N, 3, H, D, generator=g, dtype=dtype),
        beta=0.1 + 0.8 * torch.rand(B, H, F, S, generator=g, dtype=dtype),
        decay=0.5 + 0.49 * torch.rand(B, H, F, generator=g, dtype=dtype),
        q_norm_w=(0.5 + torch.rand(H * D, generator=g, dtype=dtype)) if norm else None,
        k_norm_w=(0.5 + torch.rand(H * D, generator=g, dtype=dtype)) if norm else None,
    )
    x["rope_cos"], x["rope_sin"] = rope_tables(N, D, offset=seed % 7, dtype=dtype)
    x["k_scale"] = 1.0 / math.sqrt(D * S)
    return x


def bigdn(qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, F, S, k_scale, norm_eps=1e-5, eps=1e-6,
          raw=False, clip_starts=None, truncate_to_active=0, rope_cos_q=None, rope_sin_q=None):
    """out (B, N, H, D); raw=True: the forward direction's num (B, N, H, D) and
    den (B, H, N) without the divide (gdncp/cp.h cp_gdn_raw), and with
    truncate_to_active = K also the state after frame K−1, (B·H, D, D)
    [key][value] and (B·H, D): frames ≥ K neither update nor cut the state.
    clip_starts (B, F): 1 where a frame begins a clip (§4a), None = one clip per row.
    rope_cos_q, rope_sin_q: q's own tables (§5), None = q uses rope_cos, rope_sin."""
    B, N, three, H, D = qkv.shape
    assert three == 3 and N == F * S
    C = H * D
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, N, H, D)

    # §2: full-channel RMSNorm, relu, k_scale, RoPE on the pair layout.
    def rmsnorm(x, w):
        if w is None:
            return x
        flat = x.reshape(B, N, C)
        r = 1.0 / torch.sqrt((flat * flat).mean(dim=-1, keepdim=True) + norm_eps)
        return (flat * r * w).reshape(B, N, H, D)

    def rope(x, cos, sin):
        partner = x.reshape(B, N, H, D // 2, 2).flip(-1).reshape(B, N, H, D)  # x[d^1]
        return x * cos[None, :, None, :] + partner * sin[None, :, None, :]

    q_plus = torch.relu(rmsnorm(q, q_norm_w))
    k_plus = torch.relu(rmsnorm(k, k_norm_w)) * k_scale
    q_tables = (rope_cos, rope_sin) if rope_cos_q is None else (rope_cos_q, rope_sin_q)
    q_rot, k_rot = rope(q_plus, *q_tables), rope(k_plus, rope_cos, rope_sin)

    def frames(x):  # (B, N, H, D) -> (B, H, F, S, D)
        return x.reshape(B, F, S, H, D).permute(0, 3, 1, 2, 4)

    KR, KP, V, QR, QP = frames(k_rot), frames(k_plus), frames(v), frames(q_rot), frames(q_plus)
    bk_rot = KR * beta[..., None]
    bk_plus = KP * beta[..., None]
    # §3: per-frame matrices.
    P = bk_rot.transpose(-1, -2) @ KR  # (B, H, F, D, D)
    A = bk_rot.transpose(-1, -2) @ V
    Pz = bk_plus.transpose(-1, -2) @ KP
    bz = bk_plus.sum(dim=3)  # (B, H, F, D)
    I = torch.eye(D, dtype=qkv.dtype)

    # §4: forward states (inclusive), reverse states (strictly later frames).
    def step(f, M, z):
        g = decay[:, :, f, None, None]
        return g * (I - P[:, :, f]) @ M + A[:, :, f], (g * (I - Pz[:, :, f]) @ z[..., None])[..., 0] + bz[:, :, f]

    # §4a: at a clip start f no state crosses: M_f = A_f, M̃_{f−1} = 0.
    keep = torch.ones(B, F, dtype=qkv.dtype) if clip_starts is None else 1 - clip_starts.to(qkv.dtype)

    def cut(f, M, z):  # zero the rows of batch entries whose frame f starts a clip
        k = keep[:, f, None]
        return M * k[..., None, None], z * k[..., None]

    M = torch.zeros(B, H, D, D, dtype=qkv.dtype)
    z = torch.zeros(B, H, D, dtype=qkv.dtype)
    fwd = []
    for f in range(F):
        if not truncate_to_active or f < truncate_to_active:
            M, z = step(f, *cut(f, M, z))
        fwd.append((M, z))
    rev = [None] * F
    M = torch.zeros(B, H, D, D, dtype=qkv.dtype)
    z = torch.zeros(B, H, D, dtype=qkv.dtype)
    rev[F - 1] = (M, z)
    for f in range(F - 2, -1, -1):
        M, z = cut(f + 1, *step(f + 1, M, z))
        rev[f] = (M, z)

    if raw:
        num = torch.stack([QR[:, :, f] @ fwd[f][0] for f in range(F)], dim=2)  # (B, H, F, S, D)
        den = torch.stack([(QP[:, :, f] @ fwd[f][1][..., None])[..., 0] for f in range(F)], dim=2)  # (B, H, F, S)
        num, den = num.permute(0, 2, 3, 1, 4).reshape(B, N, H, D), den.reshape(B, H, N)
        if not truncate_to_active:
            return num, den
        M, z = fwd[truncate_to_active - 1]
        return num, den, M.reshape(B * H, D, D), z.reshape(B * H, D)

    # §5: out = num / (den + eps), per frame.
    outs = []
    for f in range(F):
        Mf = fwd[f][0] + rev[f][0]
        zf = fwd[f][1] + rev[f][1]
        num = QR[:, :, f] @ Mf  # (B, H, S, D)
        den = (QP[:, :, f] @ zf[..., None])[..., 0]  # (B, H, S)
        outs.append(num / (den[..., None] + eps))
    out = torch.stack(outs, dim=2)  # (B, H, F, S, D)
    return out.permute(0, 2, 3, 1, 4).reshape(B, N, H, D)


def scan(P, A, Pz, bz, decay, clip_starts=None, truncate_to_active=0):
    """The frame scan of gdncp/cp.h cp_scan on one rank: M_f = g_f (I − P_f)
    M_{f−1} + A_f, z_f = g_f (I − Pz_f) z_{f−1} + bz_f; P, A, Pz (B·H, F, D, D),
    bz (B·H, F, D), decay (B, H, F). A clip start at f restarts from zero;
    frames ≥ truncate_to_active keep the state. Returns M, z and, with
    truncation, the state after frame K−1."""
    BH, F, D = P.shape[0], P.shape[1], P.shape[-1]
    B = decay.shape[0]
    g = decay.reshape(BH, F)
    keep = torch.ones(B, F, dtype=P.dtype) if clip_starts is None else 1 - clip_starts.to(P.dtype)
    keep = keep.repeat_interleave(BH // B, dim=0)  # (B·H, F), rows b·H + h
    I = torch.eye(D, dtype=P.dtype)
    M, z = torch.zeros(BH, D, D, dtype=P.dtype), torch.zeros(BH, D, dtype=P.dtype)
    Ms, zs = [], []
    for f in range(F):
        if not truncate_to_active or f < truncate_to_active:
            k = keep[:, f]
            M = g[:, f, None, None] * (I - P[:, f]) @ (M * k[:, None, None]) + A[:, f]
            z = (g[:, f, None, None] * (I - Pz[:, f]) @ (z * k[:, None])[..., None])[..., 0] + bz[:, f]
        Ms.append(M)
        zs.append(z)
    M_all, z_all = torch.stack(Ms, 1), torch.stack(zs, 1)
    if not truncate_to_active:
        return M_all, z_all
    return M_all, z_all, Ms[truncate_to_active - 1], zs[truncate_to_active - 1]


def cam_num(q, k, v, beta, decay, F, S, truncate_to_active=0):
    """The camera branch's numerator (gdncp/cp.h cp_cam_gdn_num), right-multiplied
    as written there: per frame W = g (I − Σ_s β_s k_s k_sᵀ), U = Σ_s β_s v_s k_sᵀ,
    S_t = S_{t−1} W + U, out_s = S_t q_s. q, k, v (B, H, D, N); beta (B, H, F, S)
    or (B, H, F); decay (B, H, F). Returns out (B, H, D, N) and, with
    truncation, the state after frame K−1 as [key][value] = Sᵀ, (B·H, D, D)."""
    B, H, D, N = q.shape
    bt = beta if beta.dim() == 4 else beta[..., None].expand(B, H, F, S)
    St = torch.zeros(B, H, D, D, dtype=q.dtype)  # [value][key]
    I = torch.eye(D, dtype=q.dtype)
    outs, terminal = [], None
    for f in range(F):
        cols = slice(f * S, (f + 1) * S)
        kf, vf, qf, bf = k[..., cols], v[..., cols], q[..., cols], bt[:, :, f]  # (B, H, D, S), bf (B, H, S)
        if not truncate_to_active or f < truncate_to_active:
            W = decay[:, :, f, None, None] * (I - (kf * bf[:, :, None]) @ kf.transpose(-1, -2))
            U = (vf * bf[:, :, None]) @ kf.transpose(-1, -2)
            St = St @ W + U
        if truncate_to_active and f == truncate_to_active - 1:
            terminal = St.transpose(-1, -2).reshape(B * H, D, D)
        outs.append(St @ qf)
    out = torch.cat(outs, dim=-1)
    return out if not truncate_to_active else (out, terminal)


def rel_l2(actual, expected):
    diff = (actual.double() - expected.double()).norm()
    ref = expected.double().norm()
    return float(diff / ref) if ref > 0 else float(diff)


def balanced_split(F_total, P, r):
    """(frames, offset) of rank r: the first F_total % P ranks hold one frame more."""
    base, extra = divmod(F_total, P)
    frames = base + (1 if r < extra else 0)
    offset = r * base + min(r, extra)
    return frames, offset


def tolerance(row):
    """A row of tests/util/tolerance.h (the suite's one tolerance table)."""
    import os
    import re

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "util", "tolerance.h")
    with open(path) as f:
        m = re.search(r"constexpr double %s = ([0-9.eE+-]+);" % re.escape(row), f.read())
    assert m, "tests/util/tolerance.h has no row %s" % row
    return float(m.group(1))

#!/usr/bin/python3
"""scripts/scaling_model.py — the CP scaling model of docs/scaling.md.

Writes docs/scaling.md (the tables and their inputs) and docs/scaling.svg (the
plot, drawn by hand: no matplotlib here). Run from the repository root:

    /usr/bin/python3 scripts/scaling_model.py

A rank's time per layer call (forward + backward) is modeled as

    T_rank(P, F_r) = W(F_r) + C(F_r) + X_alg(P)

W the layer work of a rank's frames (measured), C the CP-only work that
grows with the rank's frames (measured at P = 2), X the exchange of the
chosen algorithm: link time per round (alpha + bytes / beta), the folds
and compositions on the device, and kernel launches, nothing overlapped
(the layer overlaps nothing with the exchange). Strong scaling
E = T_1(F_total) / (P * max_r T_rank); weak scaling E = W(11) / T_rank(P, 11).
"""
import math
import os

# --- measured inputs (H200, B = 1, H = 20, D = 112, bf16) -------------------------------
# One CP bench call (2026-12-03 12:35 UTC, `gdncp_bench --cp --emulate 2 --frames 22`, at
# a229873): one GPU, bigdn forward+backward over 22 frames, S = 920: 2.166 ms; the slowest
# stand-in-peer rank of 2 over its 11 frames: 1.401 ms, of which 1.180 ms is bigdn on one GPU
# over those 11 frames (a rank's layer work W) and 0.221 ms the CP-only work C (under ncu: the
# second cumulative-product sweep of each kind, +143 us, and two cuBLAS f32 GEMMs applying
# them, 60 us).
T1_22 = 2.166
W_11 = 1.180
C_11 = 0.221
# The scan phases of one GPU at 11 frames (S-independent, D^3 work): scan_bidi_fwd 0.086 +
# scan_bidi_bwd 0.182 ms (gdncp_bench, the same day); the rest of the layer scales with S.
SCAN_11 = 0.0857 + 0.1820
# The one real 2-GPU run (2026-11-30, docs/history.md): 22 frames, 76-80 % strong,
# NCCL device time 0.11-0.17 ms a step (two all-gathers).
REAL_P2 = (0.76, 0.80)
REAL_P2_NCCL = (0.11, 0.17)

# --- modeled inputs ------------------------------------------------------------------------
S_REF = 920
BH, D = 20, 112
F32 = 4
# Links (bench/modeled_link.h, from published nccl-tests figures).
NVLINK = (8e-3, 365e6)  # alpha ms, beta bytes per ms (365 GB/s)
IB = (20e-3, 45e6)  # alpha ms, beta bytes per ms (45 GB/s)
NODE = 8
# Device time of one sequential fold step over all heads (a D x D by D x D product per head,
# the batch of jobs in one launch): assumed 2 us; one small kernel launch (copy or fold) 3 us.
TAU = 2e-3
KAPPA = 3e-3

# Bytes of the composites (src/cp/scan/scan_engine.cpp layout): per scan direction the KV and
# Z states h (D^2 + D per head) and their transitions M (2 D^2), f32.
H_BYTES = BH * (D * D + D) * F32
M_BYTES = BH * 2 * D * D * F32


def per_frame(ms_11_or_22, frames, S, scan_11=SCAN_11):
    """ms per frame at S tokens a frame: the scan part stays, the rest scales with S."""
    scan = scan_11 / 11
    rest = ms_11_or_22 / frames - scan
    return scan + rest * S / S_REF


def T1(F, S):
    return F * per_frame(T1_22, 22, S)


def W(F, S):
    return F * per_frame(W_11, 11, S)


def C(F):
    return F * C_11 / 11  # D^3 work per frame: independent of S


def link(P_span):
    return NVLINK if P_span <= NODE else IB


def x_allgather(P):
    if P == 1:
        return 0.0
    a, b = link(P)
    fwd = 2 * (H_BYTES + (M_BYTES if P > 2 else 0))  # both directions in one pack
    bwd = 2 * H_BYTES
    t = 2 * a + (P - 1) * (fwd + bwd) / b
    t += 2 * (P - 1) * TAU  # the folds over up to P - 1 composites, forward and backward
    t += 2 * 4 * KAPPA  # pack/fold launches around the two collectives
    return t


# The implementation as it is: the two rank orders of a round go in one grouped send/recv
# (ncclSend/ncclRecv in one group: the links' full duplex), and a round launches about 20
# small kernels (16 copies packing and unpacking the 4 maps, their 16 compositions in batched
# fold launches of 4, src/cp/scan/exchange.cpp). IMPROVED models what is not built: the maps
# composed straight out of and into the message buffers (no copies: 8 launches a round).
IMPROVED = False


def log_rounds(G, a, b, init_M=False):
    """One scan (forward or backward) of the log algorithm over G positions: h and M of both
    jobs of each rank order a round, h alone in the last round."""
    R = math.ceil(math.log2(G)) if G > 1 else 0
    launches = 8 if IMPROVED else 20
    t = 0.0
    for k in range(R):
        last = k == R - 1
        bytes_dir = H_BYTES + (M_BYTES if (not last or init_M) else 0)
        t += a + bytes_dir / b + 2 * TAU + launches * KAPPA  # the two orders at once
    return t


def x_log(P):
    if P == 1:
        return 0.0
    a, b = link(P)
    return 2 * log_rounds(P, a, b)


def x_hier(P, n=NODE):
    if P == 1:
        return 0.0
    n = min(n, P)
    G = P // n
    a_n, b_n = NVLINK
    fwd_pack = 2 * (H_BYTES + (M_BYTES if P > 2 else 0))
    bwd_pack = 2 * H_BYTES
    ring = (n - 1) * (2 * a_n + (fwd_pack + bwd_pack) / b_n) + 2 * (n - 1) * 2 * KAPPA
    folds = 2 * (2 * n * TAU + 8 * KAPPA)  # the node's map (h and the product), the fold into X0
    a, b = IB if G > 1 else NVLINK
    return ring + folds + 2 * log_rounds(G, a, b)


ALGS = {"allgather": x_allgather, "log": x_log, "hierarchical": x_hier}
PS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def rank_time(P, F_r, S, alg):
    if P == 1:
        return W(F_r, S)
    return W(F_r, S) + C(F_r) + ALGS[alg](P)


def strong(Ft, S, P, alg):
    F_r = math.ceil(Ft / P)  # the largest share of the balanced split
    if F_r == 0 or P > Ft:
        return None
    return T1(Ft, S) / (P * rank_time(P, F_r, S, alg))


def weak(P, alg, F=11, S=S_REF):
    return W(F, S) / rank_time(P, F, S, alg)


def fmt(e):
    return "—" if e is None else "%.0f %%" % (100 * e)


CASES = [(21, 920), (84, 920), (240, 920), (21, 3600), (84, 3600), (240, 3600)]


def tables():
    out = []
    for Ft, S in CASES:
        out.append("\n**Strong scaling, %d frames of %d tokens** (T₁ = %.2f ms modeled%s)\n" %
                   (Ft, S, T1(Ft, S), "" if S == 920 else ", S scaled from 920"))
        out.append("| P | " + " | ".join(ALGS) + " | rank ms (allgather / log / hier) |")
        out.append("|---|" + "---|" * (len(ALGS) + 1))
        for P in PS:
            if P > Ft:
                continue
            F_r = math.ceil(Ft / P)
            es = [strong(Ft, S, P, a) for a in ALGS]
            ts = [rank_time(P, F_r, S, a) for a in ALGS]
            out.append("| %d | %s | %s |" % (P, " | ".join(fmt(e) for e in es), " / ".join("%.2f" % t for t in ts)))
    global IMPROVED
    IMPROVED = True
    out.append("\n**Not built — compositions straight out of and into the message buffers** (log and "
               "hierarchical only; "
               "strong 240 × 3 600 / 84 × 920, weak 11 × 920)\n")
    out.append("| P | log 240×3600 | hier 240×3600 | log 84×920 | hier 84×920 | log weak | hier weak |")
    out.append("|---|---|---|---|---|---|---|")
    for P in PS[1:]:
        out.append("| %d | %s | %s | %s | %s | %s | %s |" % (
            P, fmt(strong(240, 3600, P, "log")), fmt(strong(240, 3600, P, "hierarchical")),
            fmt(strong(84, 920, P, "log") if P <= 84 else None),
            fmt(strong(84, 920, P, "hierarchical") if P <= 84 else None), fmt(weak(P, "log")),
            fmt(weak(P, "hierarchical"))))
    IMPROVED = False
    out.append("\n**Weak scaling, 11 frames of 920 tokens a rank** (P = 1: W(11) = %.2f ms)\n" % W(11, 920))
    out.append("| P | " + " | ".join(ALGS) + " | exchange ms (allgather / log / hier) |")
    out.append("|---|" + "---|" * (len(ALGS) + 1))
    for P in PS:
        out.append("| %d | %s | %s |" % (P, " | ".join(fmt(weak(P, a)) for a in ALGS),
                                         " / ".join("%.3f" % ALGS[a](P) for a in ALGS)))
    return "\n".join(out)


def svg(path):
    """Strong scaling at 240 frames of 3 600 tokens and weak scaling, efficiency against log2 P."""
    Wd, Ht, L, T, PW, PH = 860, 380, 60, 30, 340, 280
    colors = {"allgather": "#d62728", "log": "#1f77b4", "hierarchical": "#2ca02c"}
    s = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" '
         'font-size="12">' % (Wd, Ht), '<rect width="100%" height="100%" fill="white"/>']
    panels = [("strong, 240 frames x 3 600 tokens", lambda P, a: strong(240, 3600, P, a)),
              ("weak, 11 frames x 920 tokens a rank", lambda P, a: weak(P, a))]
    for i, (title, f) in enumerate(panels):
        x0 = L + i * (PW + 90)
        s.append('<text x="%d" y="%d" font-weight="bold">%s</text>' % (x0, T - 10, title))
        s.append('<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="black"/>' % (x0, T, PW, PH))
        for e in (0, 25, 50, 75, 100):
            y = T + PH - PH * e / 100
            s.append('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>' % (x0, y, x0 + PW, y))
            s.append('<text x="%d" y="%.1f" text-anchor="end">%d %%</text>' % (x0 - 4, y + 4, e))
        for k, P in enumerate(PS):
            x = x0 + PW * k / (len(PS) - 1)
            s.append('<text x="%.1f" y="%d" text-anchor="middle">%d</text>' % (x, T + PH + 16, P))
        s.append('<text x="%d" y="%d" text-anchor="middle">P (GPUs; nodes of 8)</text>' % (x0 + PW / 2, T + PH + 34))
        for j, a in enumerate(ALGS):
            pts = []
            for k, P in enumerate(PS):
                e = f(P, a)
                if e is None:
                    continue
                pts.append("%.1f,%.1f" % (x0 + PW * k / (len(PS) - 1), T + PH - PH * min(e, 1.0)))
            s.append('<polyline points="%s" fill="none" stroke="%s" stroke-width="2"/>' % (" ".join(pts), colors[a]))
            s.append('<text x="%d" y="%d" fill="%s">%s</text>' % (x0 + 8, T + 16 + 14 * j, colors[a], a))
    s.append('<text x="%d" y="%d" fill="#555">modeled from measured H200 rank times and modeled links '
             '(docs/scaling.md)</text>' % (L, Ht - 6))
    s.append("</svg>")
    with open(path, "w") as fh:
        fh.write("\n".join(s) + "\n")


def check_p2():
    """The model against the real 2-GPU run (22 frames)."""
    model = strong(22, 920, 2, "allgather")
    x = x_allgather(2)
    lo = T1(22, 920) / (2 * (W(11, 920) + C(11) + REAL_P2_NCCL[1]))
    hi = T1(22, 920) / (2 * (W(11, 920) + C(11) + REAL_P2_NCCL[0]))
    return model, x, lo, hi


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    svg(os.path.join(root, "docs", "scaling.svg"))
    with open(os.path.join(root, "scripts", "scaling.md.in")) as fh:
        text = fh.read()
    model, x, lo, hi = check_p2()
    goals = {
        "G84": strong(84, 920, 8, "allgather"),
        "G84LOG": strong(84, 920, 8, "log"),
        "G240": max(strong(240, 3600, 64, a) for a in ALGS),
        "G240ALG": max(ALGS, key=lambda a: strong(240, 3600, 64, a)),
        "GWEAK": min(weak(P, "hierarchical") for P in PS),
        "GWEAKMAX": max(weak(P, "hierarchical") for P in PS[1:]),
    }
    subs = {
        "@TABLES@": tables(),
        "@P2_MODEL@": fmt(model),
        "@P2_X@": "%.3f" % x,
        "@P2_CAL@": "%s – %s" % (fmt(lo), fmt(hi)),
        "@G84@": fmt(goals["G84"]),
        "@G84LOG@": fmt(goals["G84LOG"]),
        "@G240@": fmt(goals["G240"]),
        "@G240ALG@": goals["G240ALG"],
        "@GWEAK@": fmt(goals["GWEAK"]),
        "@GWEAKMAX@": fmt(goals["GWEAKMAX"]),
        "@W11@": "%.2f" % W(11, 920),
        "@C11@": "%.2f" % C(11),
        "@T1_84@": "%.2f" % T1(84, 920),
        "@T1_240@": "%.1f" % T1(240, 3600),
        "@W4_3600@": "%.2f" % W(4, 3600),
        "@X64@": " / ".join("%.2f" % ALGS[a](64) for a in ALGS),
        "@CEIL84@": fmt(T1(84, 920) / (8 * (W(11, 920) + C(11)))),
        "@CEIL240@": fmt(T1(240, 3600) / (64 * (W(4, 3600) + C(4)))),
        "@CEILWEAK@": fmt(W(11, 920) / (W(11, 920) + C(11))),
        "@T1_22@": "%.3f" % T1_22,
        "@RANK_11@": "%.3f" % (W_11 + C_11),
        "@WPF@": "%.3f" % (W(11, 920) / 11),
        "@T1PF@": "%.3f" % (T1(22, 920) / 22),
        "@WOVER@": "%.0f %%" % (100 * (W(11, 920) / 11 / (T1(22, 920) / 22) - 1)),
        "@COFW@": "%.0f %%" % (100 * C(11) / W(11, 920)),
        "@SCAN11@": "%.3f" % SCAN_11,
        "@RANK240@": "%.2f" % (W(4, 3600) + C(4)),
    }
    for k, v in subs.items():
        text = text.replace(k, v)
    with open(os.path.join(root, "docs", "scaling.md"), "w") as fh:
        fh.write(text)
    print("wrote docs/scaling.md and docs/scaling.svg")


if __name__ == "__main__":
    main()

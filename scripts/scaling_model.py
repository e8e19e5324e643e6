#!/usr/bin/python3
"""scripts/scaling_model.py — the CP scaling model of docs/scaling.md.

Writes docs/scaling.md (the tables and their inputs) and docs/scaling.svg (the
plot, drawn by hand: no matplotlib here). Run from the repository root:

    /usr/bin/python3 scripts/scaling_model.py          # write them
    /usr/bin/python3 scripts/scaling_model.py --check  # exit 1 if they are not what it writes

A rank's time per layer call (forward + backward) is modeled as

    T_rank(P, F_r) = W(F_r) + C(P, F_r) + X_alg(P)

W the layer work of a rank's frames (bigdn on one GPU over them, measured), C the
CP-only work of the slowest rank on the device (its correction sweeps; measured on
emulated ranks at P = 2, 4 and 8), X the exchange of the chosen algorithm: link time
(alpha + bytes / beta a transfer) plus its device work (folds, compositions, copies;
per step and per round from the emulated ranks), nothing overlapped. Strong scaling
E = T_1(F_total) / (P * max_r T_rank); weak scaling E = W(11) / T_rank(P, 11).
"""
import collections
import math
import os
import sys

# --- measured inputs (H200, B = 1, H = 20, D = 112, bf16, S = 920) ------------------------
# One call, 2026-12-03 16:29 UTC, `gdncp_bench --cp --emulate P --frames 11P` for P = 2, 4, 8
# and `--emulate 8 --frames 84` (stand-in peers; the log row with modeled NVLink), at 0e484b7
# (the copy-free exchanges); `scripts/gpu.sh scaling` runs these rows.
# One GPU, bigdn forward+backward: T1 over 22, 44, 84, 88 frames. A line through 22 and 88
# frames gives 44 and 84 within 0.5 % (a fixed part of 0.16 ms: launches, the RMSNorm
# weights' sums).
T1_MEAS = {22: 2.168, 44: 4.190, 84: 7.798, 88: 8.202}
T1_B = (T1_MEAS[88] - T1_MEAS[22]) / 66  # ms a frame
T1_A = T1_MEAS[22] - 22 * T1_B  # ms
# bigdn_cp at P = 1 over one rank's 11 frames in those calls (a rank's layer work W):
# 1.196, 1.203, 1.193, 1.186, 1.184 ms. W(F) is the line.
W_11_MEAS = (1.196, 1.203, 1.193, 1.186, 1.184)
# CP-only time of each emulated rank at 11 frames (its time minus W of its call), ms.
# Ends: the first and last rank (one direction local, one rescanned from X0, Note [rescan]);
# middles: both directions corrected (cumulative products and a GEMM each), P > 2 only.
CP_ONLY = {
    2: {"end": (0.104, 0.098)},
    4: {"end": (0.203, 0.213), "mid": (0.407, 0.408)},
    8: {"end": (0.359, 0.373), "mid": (0.560, 0.516, 0.510, 0.495, 0.522, 0.571)},
}
# The fold over the gathered composites grows by one product step (forward and backward) a
# rank: from the ends' growth between P = 2 and 8 (each end folds P - 2 products).
PHI = (sum(CP_ONLY[8]["end"]) / 2 - sum(CP_ONLY[2]["end"]) / 2) / 6
C_END = max(CP_ONLY[2]["end"])  # P = 2: no fold product, nothing corrected
C_MID = max(CP_ONLY[4]["mid"]) - PHI  # a middle rank of P folds P - 3 products
# The log exchange, slowest rank of 8 over 84 frames with modeled NVLink (docs/perf.md): the
# device work of one round (compositions, copies, launches) is what is left after W, C_MID
# and the link time of its 2 x 3 rounds.
LOG_8_84 = 2.383
# The slowest emulated rank of each input run, ms (the check of the model's form in docs/scaling.md):
# P = 2, 4, 8 over 11 frames a rank, and 8 over 84 frames with modeled NVLink and the all-gather.
SLOWEST = {"2_22": 1.300, "4_44": 1.611, "8_88": 1.764, "8_84_nvlink": 1.957}
# The scan phases of one GPU at 11 frames (S-independent, D^3 work): scan_bidi_fwd 0.0877 +
# scan_bidi_bwd 0.1864 ms (gdncp_bench, 2026-12-03 14:55 UTC, two runs each).
SCAN_11 = 0.0877 + 0.1864
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
# One small kernel launch (a copy of the ring's steps): assumed 3 us.
KAPPA = 3e-3

# What-if factors on the inputs (the table "Which lever moves what"): fold scales the device work
# of the folds and of the log rounds' compositions, mid a middle rank's corrections, link the link
# time of every exchange (0: hidden behind the rank's work), layer the one-GPU layer (T1 and W,
# which the CP-only work and the exchange do not follow). TODAY: the measured and modeled inputs.
Levers = collections.namedtuple("Levers", "fold mid link layer")
TODAY = Levers(fold=1.0, mid=1.0, link=1.0, layer=1.0)

# Bytes of the composites (src/cp/scan/scan_engine.cpp layout): per scan direction the KV and
# Z states h (D^2 + D per head) and their transitions M (2 D^2), f32.
H_BYTES = BH * (D * D + D) * F32
M_BYTES = BH * 2 * D * D * F32


def T1(F, S, lv=TODAY):
    """One GPU over F frames of S tokens: the scan part stays, the rest of a frame scales with S."""
    scan = SCAN_11 / 11
    return lv.layer * (T1_A + F * (scan + (T1_B - scan) * S / S_REF))


def W(F, S, lv=TODAY):
    return T1(F, S, lv)  # bigdn_cp at P = 1 is bigdn (W_11_MEAS against T1(11): within 3.5 %)


def C(P, F, lv=TODAY):
    """CP-only device work of the slowest rank beside the exchange (D^3 a frame: S-independent)."""
    if P == 1:
        return 0.0
    return (C_END if P == 2 else lv.mid * C_MID) * F / 11


def link(P_span):
    return NVLINK if P_span <= NODE else IB


def x_allgather(P, lv=TODAY):
    if P == 1:
        return 0.0
    a, b = link(P)
    fwd = 2 * (H_BYTES + (M_BYTES if P > 2 else 0))  # both directions in one pack
    bwd = 2 * H_BYTES
    return lv.link * (2 * a + (P - 1) * (fwd + bwd) / b) + max(P - 3, 0) * lv.fold * PHI  # the folds' products


def log_links(G, a, b, init_M=False):
    """Link time of one scan (forward or backward) of the log algorithm over G positions: h and
    M of both jobs of each rank order a round, h alone in the last round."""
    R = math.ceil(math.log2(G)) if G > 1 else 0
    t = 0.0
    for k in range(R):
        last = k == R - 1
        t += a + (H_BYTES + (M_BYTES if (not last or init_M) else 0)) / b  # the two orders at once
    return t


def rounds(G):
    return math.ceil(math.log2(G)) if G > 1 else 0


ROUND_DEV = (LOG_8_84 - W(11, S_REF) - C_MID - 2 * log_links(8, *NVLINK)) / (2 * rounds(8))


def x_log(P, lv=TODAY):
    if P == 1:
        return 0.0
    a, b = link(P)
    return 2 * (lv.link * log_links(P, a, b) + rounds(P) * lv.fold * ROUND_DEV)


def x_hier(P, lv=TODAY, n=NODE):
    if P == 1:
        return 0.0
    n = min(n, P)
    G = P // n
    a_n, b_n = NVLINK
    fwd_pack = 2 * (H_BYTES + (M_BYTES if P > 2 else 0))
    bwd_pack = 2 * H_BYTES
    ring = lv.link * (n - 1) * (2 * a_n + (fwd_pack + bwd_pack) / b_n) + 2 * (n - 1) * 2 * KAPPA
    folds = ((n - 1) + max(n - 3, 0)) * lv.fold * PHI  # the node's map, then the fold into X0
    a, b = IB if G > 1 else NVLINK
    return ring + folds + 2 * (lv.link * log_links(G, a, b) + rounds(G) * lv.fold * ROUND_DEV)


ALGS = {"allgather": x_allgather, "log": x_log, "hierarchical": x_hier}
PS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def rank_time(P, F_r, S, alg, lv=TODAY):
    if P == 1:
        return W(F_r, S, lv)
    return W(F_r, S, lv) + C(P, F_r, lv) + ALGS[alg](P, lv)


def strong(Ft, S, P, alg, lv=TODAY):
    F_r = math.ceil(Ft / P)  # the largest share of the balanced split
    if F_r == 0 or P > Ft:
        return None
    return T1(Ft, S, lv) / (P * rank_time(P, F_r, S, alg, lv))


def weak(P, alg, F=11, S=S_REF, lv=TODAY):
    return W(F, S, lv) / rank_time(P, F, S, alg, lv)


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
    out.append("\n**Weak scaling, 11 frames of 920 tokens a rank** (P = 1: W(11) = %.2f ms)\n" % W(11, 920))
    out.append("| P | " + " | ".join(ALGS) + " | exchange ms (allgather / log / hier) |")
    out.append("|---|" + "---|" * (len(ALGS) + 1))
    for P in PS:
        out.append("| %d | %s | %s |" % (P, " | ".join(fmt(weak(P, a)) for a in ALGS),
                                         " / ".join("%.3f" % ALGS[a](P) for a in ALGS)))
    return "\n".join(out)


# The rows of "Which lever moves what": a name and the factors (TODAY's where not named).
ALONE = [
    ("fold and composition products 4x faster (fold = 1/4)", TODAY._replace(fold=0.25)),
    ("a middle rank's corrections halved (mid = 1/2)", TODAY._replace(mid=0.5)),
    ("every link hidden behind the rank's work (link = 0)", TODAY._replace(link=0.0)),
]
THREE = Levers(fold=0.25, mid=0.5, link=0.0, layer=1.0)
FAST_LAYER = 0.85 / 1.15  # the one-GPU speed goal against today's layer
# The fold kernel's rewrite as measured per kernel on an H100 (docs/scaling.md): a middle rank's
# fold launches of the log rounds, 292 against 705 us a step. A ratio from another GPU applied
# to the H200's inputs: modeled, until `scripts/gpu.sh scaling` measures it on an H200.
FOLD_H100 = 292.0 / 705.0
LEVER_ROWS = [("today's inputs", TODAY),
              ("the fold kernel's rewrite at its H100 ratio (fold = 292/705 µs = %.2f)" % FOLD_H100,
               TODAY._replace(fold=FOLD_H100))] + ALONE + [
    ("the three together", THREE),
    ("the three, and the one-GPU layer at 0.85 of 1.15 ms (layer = 0.74)", THREE._replace(layer=FAST_LAYER)),
    ("the one-GPU layer at 0.85 ms alone", TODAY._replace(layer=FAST_LAYER)),
    ("no CP cost at all (fold = mid = link = 0; the ends' own CP-only work stays)",
     Levers(fold=0.0, mid=0.0, link=0.0, layer=1.0)),
]


def lever_goals(lv):
    """The three goals' efficiencies under lv, each with the best of the exchanges (weak: the
    lowest over P of the best at each P)."""
    g84 = max(strong(84, 920, 8, a, lv) for a in ALGS)
    g240 = max(strong(240, 3600, 64, a, lv) for a in ALGS)
    gweak = min(max(weak(P, a, lv=lv) for a in ALGS) for P in PS)
    return g84, g240, gweak


def lever_gains(rows):
    """The smallest and largest gain, in points, of the rows' goals over today's."""
    base = lever_goals(TODAY)
    gains = [round(100 * e) - round(100 * e0) for _, lv in rows for e, e0 in zip(lever_goals(lv), base)]
    return min(gains), max(gains)


def levers_table():
    out = ["| inputs | 84 frames, 8 GPUs (goal 85 %) | 240 × 3 600, 64 GPUs (goal 70 %) "
           "| weak, 11 frames a rank, P ≤ 256 (goal 90 %) |", "|---|---|---|---|"]
    for name, lv in LEVER_ROWS:
        out.append("| %s | %s |" % (name, " | ".join(fmt(e) for e in lever_goals(lv))))
    return "\n".join(out)


def svg():
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
    return "\n".join(s) + "\n"


def emulated(P, F, alg="allgather", links=False):
    """The model of an emulated rank (`gdncp_bench --cp --emulate P`): without links, the device
    work of the exchange alone."""
    F_r = math.ceil(F / P)
    if links:
        return rank_time(P, F_r, S_REF, alg)
    return W(F_r, S_REF) + C(P, F_r) + max(P - 3, 0) * PHI


def check_p2():
    """The model against the real 2-GPU run (22 frames)."""
    model = strong(22, 920, 2, "allgather")
    x = x_allgather(2)
    lo = T1(22, 920) / (2 * (W(11, 920) + C(2, 11) + REAL_P2_NCCL[1]))
    hi = T1(22, 920) / (2 * (W(11, 920) + C(2, 11) + REAL_P2_NCCL[0]))
    return model, x, lo, hi


def main(check):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
        "@LEVERS@": levers_table(),
        "@CMIDHALF@": "%.2f" % (0.5 * C_MID),
        "@G84FAST@": fmt(lever_goals(TODAY._replace(layer=FAST_LAYER))[0]),
        "@G84BEST@": fmt(lever_goals(TODAY)[0]),
        "@THREE@": " / ".join("%.0f" % (100 * e) for e in lever_goals(THREE)) + " %",
        "@FOLDH100@": " / ".join("%.0f" % (100 * e) for e in lever_goals(TODAY._replace(fold=FOLD_H100))) + " %",
        "@ALONE@": "%d–%d" % lever_gains(ALONE),
        "@CEIL84FREE@": fmt(T1(84, 920) / (8 * W(11, 920))),
        "@CEIL84EVEN@": fmt(T1(84, 920) / (8 * W(10.5, 920))),
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
        "@E2@": "%.3f" % emulated(2, 22),
        "@E4@": "%.3f" % emulated(4, 44),
        "@E8@": "%.3f" % emulated(8, 88),
        "@E8NV@": "%.3f" % emulated(8, 84, links=True),
        "@C2@": "%.3f" % C_END,
        "@CMID@": "%.3f" % C_MID,
        "@PHI@": "%.0f" % (1000 * PHI),
        "@ROUND@": "%.0f" % (1000 * ROUND_DEV),
        "@T1A@": "%.3f" % T1_A,
        "@T1B@": "%.4f" % T1_B,
        "@T1_88@": "%.3f" % T1_MEAS[88],
        "@C8MID@": "%.3f" % max(CP_ONLY[8]["mid"]),
        "@C8MODEL@": "%.3f" % (C(8, 11) + max(8 - 3, 0) * PHI),
        "@C4END@": "%.3f" % max(CP_ONLY[4]["end"]),
        "@C4MID@": "%.3f" % max(CP_ONLY[4]["mid"]),
        "@LOG884@": "%.3f" % LOG_8_84,
        "@M2@": "%.3f" % SLOWEST["2_22"],
        "@M4@": "%.3f" % SLOWEST["4_44"],
        "@M8@": "%.3f" % SLOWEST["8_88"],
        "@M8NV@": "%.3f" % SLOWEST["8_84_nvlink"],
        "@C8END@": "%.3f" % max(CP_ONLY[8]["end"]),
        "@W11M@": ", ".join("%.3f" % w for w in W_11_MEAS),
        "@T1_84@": "%.2f" % T1(84, 920),
        "@T1_240@": "%.1f" % T1(240, 3600),
        "@W4_3600@": "%.2f" % W(4, 3600),
        "@X64@": " / ".join("%.2f" % ALGS[a](64) for a in ALGS),
        "@CEIL84@": fmt(T1(84, 920) / (8 * (W(11, 920) + C(8, 11)))),
        "@CEIL240@": fmt(T1(240, 3600) / (64 * (W(4, 3600) + C(64, 4)))),
        "@CEILWEAK@": fmt(W(11, 920) / (W(11, 920) + C(8, 11))),
        "@CEILWEAK2@": fmt(W(11, 920) / (W(11, 920) + C(2, 11))),
        "@T1_22@": "%.3f" % T1_MEAS[22],
        "@P2RANK@": "%.3f" % (W(11, 920) + C(2, 11)),
        "@COFW@": "%.0f %%" % (100 * C(8, 11) / W(11, 920)),
        "@C2OFW@": "%.0f %%" % (100 * C(2, 11) / W(11, 920)),
        "@SCAN11@": "%.3f" % SCAN_11,
        "@RANK240@": "%.2f" % (W(4, 3600) + C(64, 4)),
    }
    for k, v in subs.items():
        text = text.replace(k, v)
    outputs = {os.path.join("docs", "scaling.md"): text, os.path.join("docs", "scaling.svg"): svg()}
    stale = []
    for name, content in outputs.items():
        path = os.path.join(root, name)
        if check:
            with open(path) as fh:
                if fh.read() != content:
                    stale.append(name)
        else:
            with open(path, "w") as fh:
                fh.write(content)
    if check and stale:
        print("scaling_model.py --check: %s not what the model writes; run /usr/bin/python3 "
              "scripts/scaling_model.py and commit the result" % " and ".join(stale))
        return 1
    print("%s docs/scaling.md and docs/scaling.svg" % ("checked" if check else "wrote"))
    return 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv[1:]))

"""The library's entries as torch ops with autograd, and the nn.Module.

Each call hands its inputs to the library through DLPack (no copies) and runs
on torch's current CUDA stream of the inputs' device. Math, layouts and dtypes:
gdncp/bigdn.h and gdncp/cp.h.

Autograd contract (one generic Function, _EntryFunction, for every entry):
- the inputs are saved with ctx.save_for_backward, so an in-place edit of any
  of them after the forward (a leaf edited under no_grad, a non-leaf, the RoPE
  tables, the clip mask) raises torch's own version-counter error at backward
  instead of giving silently wrong gradients;
- the first backward uses the graph the library recorded in the forward (its
  saved activations); a further backward of the same graph (retain_graph=True,
  torch.autograd.gradcheck) records the call again from the saved inputs and
  runs that graph — the CP entries re-record collectively, so every rank must
  run the same backwards, as for any collective;
- first derivatives only: differentiating a gradient (create_graph=True, then
  backward through it) raises a RuntimeError saying so.
Under torch.compile (torch >= 2.4) the same entries are torch.library custom
ops (gdncp._ops); eager calls take this path either way.
"""
import collections
import ctypes
import math

import torch

from . import _capi, _dlpack, _ops
from .comm import Communicator

RawResult = collections.namedtuple("RawResult", "num den terminal_M terminal_z")
CamResult = collections.namedtuple("CamResult", "out terminal_M")
ScanResult = collections.namedtuple("ScanResult", "M z terminal_M terminal_z")


class _Graph(_capi.OwnedHandle):
    """Owns a gdncp_graph handle: one backward, then released."""

    _destroy_fn = "graph_destroy"

    def __init__(self, handle, n_out, n_in):
        super().__init__(handle)
        self.n_out, self.n_in = n_out, n_in

    def backward(self, grad_outputs, stream):
        arr_out = (ctypes.c_void_p * self.n_out)()
        given = []
        try:
            for k, g in enumerate(grad_outputs):
                if g is not None:
                    arr_out[k] = _dlpack.give(g)
                    given.append(k)
        except BaseException:
            for k in given:
                _dlpack.free(arr_out[k])
            raise
        arr_in = (ctypes.c_void_p * self.n_in)()
        try:
            _capi.call("graph_backward", self._h, arr_out, stream, arr_in)
            return [_dlpack.take(arr_in[i]) for i in range(self.n_in)]
        finally:
            self.release()


# name: (inputs, differentiable inputs (the leading ones), output slots, scalar arguments)
_LAYER_SCALARS = ("F", "S", "k_scale", "norm_eps", "eps", "precision", "checkpoint", "deterministic")
_CP_SCALARS = ("reverse_rank_order", "truncate_to_active", "exchange", "overlap_exchange")
ENTRIES = {
    "bigdn": (10, 5, 1, _LAYER_SCALARS),
    "bigdn_cp": (10, 5, 1, _LAYER_SCALARS + ("exchange", "overlap_exchange")),
    "cp_gdn_raw": (10, 5, 4, _LAYER_SCALARS + _CP_SCALARS),
    "cp_cam_gdn_num": (5, 5, 2, ("F", "S") + _CP_SCALARS + ("checkpoint",)),
    "cp_scan": (6, 5, 4, _CP_SCALARS),
}


def present(entry, scalars):
    """How many leading outputs a call returns: the terminal states exist only with truncate_to_active."""
    names = ENTRIES[entry][3]
    truncated = "truncate_to_active" in names and bool(scalars[names.index("truncate_to_active")])
    return {"cp_gdn_raw": 4 if truncated else 2, "cp_scan": 4 if truncated else 2,
            "cp_cam_gdn_num": 2 if truncated else 1}.get(entry, 1)


class _Call:
    """One call of a C entry (a key of ENTRIES): its communicator (None for
    bigdn) and its scalar arguments (a tuple in the order ENTRIES names them)."""

    def __init__(self, entry, comm, scalars):
        self.entry, self.comm, self.scalars = entry, comm, tuple(scalars)
        self.n_in, self.n_diff, self.n_out, names = ENTRIES[entry]
        s = dict(zip(names, self.scalars))
        self.present = present(entry, self.scalars)
        # The C arguments between the tensors and the stream (ctypes.byref keeps the structs alive).
        cp = ((ctypes.byref(_capi.cp_options(s.get("reverse_rank_order", False), s.get("truncate_to_active", 0),
                                             s["exchange"], overlap_exchange=s["overlap_exchange"])),)
              if "exchange" in s else ())
        self.c_entry = "bigdn_cp_ex" if entry == "bigdn_cp" else entry  # the bidirectional layer's CP options
        if entry == "cp_scan":
            self.middle = cp
        elif entry == "cp_cam_gdn_num":
            self.middle = (int(s["F"]), int(s["S"]), *cp, _capi.CHECKPOINTS[s["checkpoint"]])
        else:
            opts = _capi.layer_options(s["k_scale"], s["norm_eps"], s["eps"], s["precision"], s["checkpoint"],
                                       s["deterministic"])
            self.middle = (int(s["F"]), int(s["S"]), ctypes.byref(opts), *cp)
        self.record = False

    def run(self, inputs, needs, record):
        """Outputs (the present ones) and the recorded graph (or None)."""
        mask = 0
        for i in range(self.n_diff):
            if needs[i] and inputs[i] is not None:
                mask |= 1 << i
        ptrs = []
        try:
            for t in inputs:
                ptrs.append(_dlpack.give(t))
        except BaseException:
            for p in ptrs:
                _dlpack.free(p)
            raise
        graph = ctypes.c_void_p()
        out = (ctypes.c_void_p * self.n_out)()
        head = [self.comm.handle] if self.comm is not None else []
        graph_arg = ctypes.byref(graph) if (record and mask) else None
        _capi.call(self.c_entry, *head, *ptrs, *self.middle, _dlpack.stream_of(inputs[0]), mask, out, graph_arg)
        outs = [_dlpack.take(out[k]) for k in range(self.n_out)]
        g = _Graph(graph.value, self.n_out, self.n_diff) if graph.value else None
        return outs[:self.present], g


class _EntryFunction(torch.autograd.Function):
    """apply(call, *inputs) -> the call's present outputs (a tuple)."""

    @staticmethod
    def forward(ctx, call, *inputs):
        ctx.call = call
        ctx.needs = ctx.needs_input_grad[1:1 + call.n_diff]
        outs, ctx.graph = call.run(inputs, ctx.needs, call.record)
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)  # an unused output's gradient goes to the library as NULL (zeros)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors  # torch checks their version counters here
        call = ctx.call
        graph, ctx.graph = ctx.graph, None
        if graph is None:  # the forward's graph ran its one backward: record the call again
            _, graph = call.run(inputs, ctx.needs, True)
        stream = _dlpack.stream_of(next((g for g in grads if g is not None), inputs[0]))
        grads_in = graph.backward(list(grads) + [None] * (call.n_out - len(grads)), stream)
        if torch.is_grad_enabled():  # create_graph=True: the gradients refuse to be differentiated
            anchors = [t for t in inputs if t is not None and t.requires_grad]
            grads_in = [_FirstOrderOnly.apply(g, *anchors) if g is not None else None for g in grads_in]
        return (None, *grads_in, *([None] * (len(inputs) - call.n_diff)))


class _FirstOrderOnly(torch.autograd.Function):
    """Passes a gradient through (tied to the inputs it depends on); differentiating it raises."""

    @staticmethod
    def forward(ctx, g, *anchors):
        return g.view_as(g)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("gdncp: double backward is not supported: the library computes first derivatives "
                           "only (a gradient of a gdncp op cannot be differentiated again)")


def _apply(entry, comm, scalars, inputs):
    """The present outputs of one entry call, differentiable through torch.autograd."""
    if _ops.REGISTERED:
        if _ops.is_compiling():
            return _ops.call(entry, comm, scalars, inputs)
        _ops.register_comm(comm)  # so that a later compiled call finds it
    call = _Call(entry, comm, scalars)
    call.record = torch.is_grad_enabled()
    return _EntryFunction.apply(call, *inputs)


# --- argument checks shared by the entries ---------------------------------------------


def _clip_mask(clip_starts, fn):
    """The (B, F) f32 mask the library takes: bool converted, f32 as is, else refused.
    Values must be 0 or 1: a CPU mask is checked here outside torch.compile (and by the library); a CUDA mask
    is checked by the library on the device, without a host wait: that call's outputs and gradients become NaN
    and the next call that takes a mask raises (docs/design.md §9)."""
    if clip_starts is None:
        return None
    if not isinstance(clip_starts, torch.Tensor):
        raise TypeError("%s: clip_starts must be a tensor or None, got %s" % (fn, type(clip_starts).__name__))
    if clip_starts.requires_grad:
        raise ValueError("%s: clip_starts requires grad, but a clip mask gets no gradient; detach it" % fn)
    if clip_starts.dtype == torch.bool:
        return clip_starts.to(torch.float32)
    if clip_starts.dtype != torch.float32:
        raise TypeError("%s: clip_starts must be bool or float32 (1 where a frame starts a clip), got %s"
                        % (fn, clip_starts.dtype))
    if (clip_starts.device.type == "cpu" and not _ops.is_compiling()
            and not bool(((clip_starts == 0) | (clip_starts == 1)).all())):
        raise ValueError("%s: clip_starts must hold only 0 and 1" % fn)
    return clip_starts


def _no_grad_tables(fn, **tables):
    for name, t in tables.items():
        if t is not None and t.requires_grad:
            raise ValueError("%s: %s requires grad, but the library gives RoPE tables no gradient; "
                             "pass them detached (tables are constants of the layer)" % (fn, name))


def _rope_args(fn, rope_cos, rope_sin, rope_cos_q, rope_sin_q):
    """The RoPE tables of the C call: k's, then q's own (both None: q uses k's; the library
    refuses one without the other, naming it)."""
    _no_grad_tables(fn, rope_cos=rope_cos, rope_sin=rope_sin, rope_cos_q=rope_cos_q, rope_sin_q=rope_sin_q)
    return [rope_cos, rope_sin, rope_cos_q, rope_sin_q]


def _comm_of(comm, fn):
    if not isinstance(comm, Communicator):
        raise TypeError("%s: comm must be a gdncp.Communicator, got %s" % (fn, type(comm).__name__))
    return comm


def _layer_inputs(fn, qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, rope_cos_q, rope_sin_q, clip_starts):
    return [qkv, beta, decay, q_norm_w, k_norm_w, *_rope_args(fn, rope_cos, rope_sin, rope_cos_q, rope_sin_q),
            _clip_mask(clip_starts, fn)]


def _truncate(truncate_to_active):
    """None or 0: off; K >= 1: the library checks K against the global frame count."""
    return 0 if truncate_to_active is None else int(truncate_to_active)


# --- the entries ---------------------------------------------------------------------------


def bigdn(qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, F, S, k_scale=1.0, norm_eps=1e-5, eps=1e-6,
          precision="auto", checkpoint="off", clip_starts=None, rope_cos_q=None, rope_sin_q=None,
          deterministic=False):
    """The single-rank layer (gdncp/bigdn.h): out (B, F·S, H, D).
    clip_starts: the (B, F) clip-start mask (docs/design.md §4a), bool or
    float32 0/1; None = one clip per row. deterministic: the mode whose
    results bigdn_cp matches bitwise on any CP group (docs/design.md §12)."""
    fn = "gdncp.bigdn"
    inputs = _layer_inputs(fn, qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, rope_cos_q, rope_sin_q,
                           clip_starts)
    (out,) = _apply("bigdn", None, (F, S, k_scale, norm_eps, eps, precision, checkpoint, deterministic), inputs)
    return out


def bigdn_cp(comm, qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, F, S, k_scale=1.0, norm_eps=1e-5,
             eps=1e-6, precision="auto", checkpoint="off", clip_starts=None, rope_cos_q=None, rope_sin_q=None,
             exchange="auto", deterministic=False, overlap_exchange=False):
    """The bidirectional CP layer (gdncp/cp.h bigdn_cp) on this rank's F frames.
    Forward and backward are collective over comm; the norm weights' gradients
    are this rank's part (sum them over the group). exchange: how the ranks
    exchange the scan's composites, "auto" | "allgather" | "log" |
    "hierarchical" (gdncp/cp.h Exchange; the node size from
    GDNCP_CP_NODE_SIZE or the MPI shared-memory split). deterministic:
    bitwise the same for every CP degree and frame split (docs/design.md §12).
    overlap_exchange: True runs the all-gather exchange on a communication
    stream beside the sweeps it does not read (gdncp/cp.h
    CpOptions::overlap_exchange; CUDA only, bitwise the same results; the
    log and hierarchical exchanges run as without it); on the CPU it changes
    nothing. A bool; rank-local (ranks may differ)."""
    fn = "gdncp.bigdn_cp"
    comm = _comm_of(comm, fn)
    _capi.flag(fn, "overlap_exchange", overlap_exchange)
    inputs = _layer_inputs(fn, qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, rope_cos_q, rope_sin_q,
                           clip_starts)
    (out,) = _apply("bigdn_cp", comm,
                    (F, S, k_scale, norm_eps, eps, precision, checkpoint, deterministic, exchange, overlap_exchange),
                    inputs)
    return out


def cp_gdn_raw(comm, qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, F, S, k_scale=1.0, norm_eps=1e-5,
               precision="auto", checkpoint="off", reverse_rank_order=False, truncate_to_active=None,
               clip_starts=None, rope_cos_q=None, rope_sin_q=None, exchange="auto", deterministic=False,
               overlap_exchange=False):
    """One direction, raw (gdncp/cp.h cp_gdn_raw): RawResult(num (B, N, H, D),
    den (B, H, N), terminal_M (B·H, D, D) [key][value], terminal_z (B·H, D)),
    the terminal states only with truncate_to_active (else None), identical on
    every rank and differentiable. Collective over comm. exchange and
    overlap_exchange as for bigdn_cp."""
    fn = "gdncp.cp_gdn_raw"
    comm = _comm_of(comm, fn)
    _capi.flag(fn, "overlap_exchange", overlap_exchange)
    inputs = _layer_inputs(fn, qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, rope_cos_q, rope_sin_q,
                           clip_starts)
    outs = _apply("cp_gdn_raw", comm, (F, S, k_scale, norm_eps, 1e-6, precision, checkpoint, deterministic,
                                       bool(reverse_rank_order), _truncate(truncate_to_active), exchange,
                                       overlap_exchange), inputs)
    return RawResult(*outs, *([None] * (4 - len(outs))))


def cp_cam_gdn_num(comm, q, k, v, beta, decay, F, S, reverse_rank_order=False, truncate_to_active=None,
                   checkpoint="off", exchange="auto", overlap_exchange=False):
    """The camera branch, numerator only (gdncp/cp.h cp_cam_gdn_num): q, k, v
    (B, H, D, N) already rotated, beta (B, H, F, S) or (B, H, F), decay (B, H,
    F). CamResult(out (B, H, D, N), terminal_M (B·H, D, D) [key][value] with
    truncate_to_active, else None). Collective over comm; no clip mask.
    exchange and overlap_exchange as for bigdn_cp."""
    fn = "gdncp.cp_cam_gdn_num"
    comm = _comm_of(comm, fn)
    _capi.flag(fn, "overlap_exchange", overlap_exchange)
    if checkpoint not in _capi.CHECKPOINTS:
        raise ValueError("%s: checkpoint must be one of %s, got %r" % (fn, sorted(_capi.CHECKPOINTS), checkpoint))
    outs = _apply("cp_cam_gdn_num", comm,
                  (F, S, bool(reverse_rank_order), _truncate(truncate_to_active), exchange, overlap_exchange,
                   checkpoint),
                  [q, k, v, beta, decay])
    return CamResult(*outs, *([None] * (2 - len(outs))))


def cp_scan(comm, P, A, Pz, bz, decay, clip_starts=None, reverse_rank_order=False, truncate_to_active=None,
            exchange="auto", overlap_exchange=False):
    """The distributed frame scan (gdncp/cp.h cp_scan), left-multiplied:
    M_t = g_t (I − P_t) M_{t−1} + A_t, z_t = g_t (I − Pz_t) z_{t−1} + bz_t.
    P, A, Pz (B·H, F, D, D), bz (B·H, F, D), decay (B, H, F). ScanResult(M, z,
    terminal_M, terminal_z) (terminal states with truncate_to_active, else
    None). Collective over comm. exchange and overlap_exchange as for bigdn_cp."""
    fn = "gdncp.cp_scan"
    comm = _comm_of(comm, fn)
    _capi.flag(fn, "overlap_exchange", overlap_exchange)
    outs = _apply("cp_scan", comm, (bool(reverse_rank_order), _truncate(truncate_to_active), exchange,
                                    overlap_exchange),
                  [P, A, Pz, bz, decay, _clip_mask(clip_starts, fn)])
    return ScanResult(*outs, *([None] * (4 - len(outs))))


class BiGDN(torch.nn.Module):
    """The bidirectional gated-delta-net layer with its RMSNorm weights as parameters.

    forward(qkv (B, F·S, 3, H, D), beta (B, H, F, S), decay (B, H, F),
            rope_cos, rope_sin (F·S, D), F, S, clip_starts=None) -> out (B, F·S, H, D).
    With comm (a gdncp.Communicator), the context-parallel layer: the inputs
    are this rank's F frames, and the weights' gradients are this rank's part
    (sum them over the group before the optimizer step); exchange and
    overlap_exchange choose how the ranks exchange the scan's composites (as
    bigdn_cp takes them; they apply only with comm).
    k_scale None: D^-1/2·S^-1/2 (Sana's production blocks), taken per call.
    """

    def __init__(self, heads, head_dim, comm=None, norm=True, k_scale=None, norm_eps=1e-5, eps=1e-6,
                 precision="auto", checkpoint="off", device=None, dtype=torch.float32, deterministic=False,
                 exchange="auto", overlap_exchange=False):
        super().__init__()
        _capi.exchange_of("gdncp.BiGDN", exchange)
        _capi.flag("gdncp.BiGDN", "overlap_exchange", overlap_exchange)
        if comm is None and (exchange != "auto" or overlap_exchange):
            raise ValueError("gdncp.BiGDN: exchange and overlap_exchange apply only with comm (the CP layer)")
        self.exchange, self.overlap_exchange = exchange, overlap_exchange
        C = heads * head_dim
        self.heads, self.head_dim, self.comm = heads, head_dim, comm
        self.k_scale, self.norm_eps, self.eps = k_scale, norm_eps, eps
        self.precision, self.checkpoint = precision, checkpoint
        if _ops.REGISTERED:
            _ops.register_comm(comm)
        self.deterministic = deterministic
        if norm:
            self.q_norm_w = torch.nn.Parameter(torch.ones(C, device=device, dtype=dtype))
            self.k_norm_w = torch.nn.Parameter(torch.ones(C, device=device, dtype=dtype))
        else:
            self.register_parameter("q_norm_w", None)
            self.register_parameter("k_norm_w", None)

    def forward(self, qkv, beta, decay, rope_cos, rope_sin, F, S, clip_starts=None, rope_cos_q=None,
                rope_sin_q=None):
        if qkv.dim() != 5 or qkv.shape[2] != 3 or qkv.shape[3] != self.heads or qkv.shape[4] != self.head_dim:
            raise ValueError("gdncp.BiGDN(heads=%d, head_dim=%d): qkv must be (B, F·S, 3, %d, %d), got %s"
                             % (self.heads, self.head_dim, self.heads, self.head_dim, tuple(qkv.shape)))
        k_scale = self.k_scale if self.k_scale is not None else 1.0 / math.sqrt(self.head_dim * S)
        kw = dict(k_scale=k_scale, norm_eps=self.norm_eps, eps=self.eps, precision=self.precision,
                  checkpoint=self.checkpoint, clip_starts=clip_starts, rope_cos_q=rope_cos_q, rope_sin_q=rope_sin_q,
                  deterministic=self.deterministic)
        args = (qkv, beta, decay, self.q_norm_w, self.k_norm_w, rope_cos, rope_sin, F, S)
        if self.comm is None:
            return bigdn(*args, **kw)
        return bigdn_cp(self.comm, *args, exchange=self.exchange, overlap_exchange=self.overlap_exchange, **kw)

    def extra_repr(self):
        cp = "off" if self.comm is None else "%d ranks, exchange %s%s" % (
            self.comm.size, self.exchange, ", hidden" if self.overlap_exchange else "")
        return "heads=%d, head_dim=%d, cp=%s" % (self.heads, self.head_dim, cp)


_ops._register_all()

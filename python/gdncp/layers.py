"""The layers as torch.autograd.Functions and nn.Modules over the C ABI.

Each call hands the inputs to the library through DLPack (no copies), runs
on torch's current CUDA stream of the inputs' device, and — when some input
needs a gradient — keeps the library's graph handle in the autograd context;
backward hands the output gradient to that graph and returns the library's
input gradients, again without copies. Math, layouts and dtypes: gdncp/bigdn.h.
"""
import ctypes
import math

import torch
from torch.autograd.function import once_differentiable

from . import _capi, _dlpack
from .comm import Communicator

_DIFF = 5  # qkv, beta, decay, q_norm_w, k_norm_w


class _Graph(_capi.OwnedHandle):
    """Owns a gdncp_graph handle: backward once, destroyed with the context."""

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
        _capi.call("graph_backward", self._h, arr_out, stream, arr_in)
        grads = [_dlpack.take(arr_in[i]) for i in range(self.n_in)]
        self.release()
        return grads


def _mask(needs, tensors):
    m = 0
    for i, (n, t) in enumerate(zip(needs, tensors)):
        if n and t is not None:
            m |= 1 << i
    return m


def _run(entry, comm, inputs, F, S, opts, needs, n_out, extra=()):
    """Calls a layer entry; returns (outputs, graph or None)."""
    mask = _mask(needs, inputs[:_DIFF])
    stream = _dlpack.stream_of(inputs[0])
    ptrs = []
    try:
        for t in inputs:
            ptrs.append(_dlpack.give(t))
    except BaseException:
        for p in ptrs:
            _dlpack.free(p)
        raise
    graph = ctypes.c_void_p()
    out = (ctypes.c_void_p * n_out)()
    head = [comm.handle] if comm is not None else []
    graph_arg = ctypes.byref(graph) if mask else None
    _capi.call(entry, *head, *ptrs, int(F), int(S), ctypes.byref(opts), *extra, stream, mask, out, graph_arg)
    outs = [_dlpack.take(out[k]) for k in range(n_out)]
    g = _Graph(graph.value, n_out, _DIFF) if graph.value else None
    return outs, g


def _graph_backward(ctx, grad_out):
    """The input gradients of a one-output call from the graph kept in ctx (then dropped)."""
    grads = ctx.graph.backward([grad_out], _dlpack.stream_of(grad_out))
    ctx.graph = None
    return grads


class BiGDNFunction(torch.autograd.Function):
    """out = bigdn(...) (one rank; gdncp_bigdn). Arguments after ctx:
    qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, clip_starts (or None), F, S,
    opts (gdncp._capi.LayerOptions)."""

    @staticmethod
    def forward(ctx, qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, clip_starts, F, S, opts):
        (out,), ctx.graph = _run(
            "bigdn", None, [qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, clip_starts], F, S, opts,
            ctx.needs_input_grad[:_DIFF], 1)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        return (*_graph_backward(ctx, grad_out), None, None, None, None, None, None)


class BiGDNCPFunction(torch.autograd.Function):
    """out = bigdn_cp(comm, ...) (this rank's frames of the CP group; gdncp_bigdn_cp).
    Arguments after ctx: comm, then as BiGDNFunction. Forward and backward are
    collective over comm; the norm weights' gradients are this rank's part
    (sum them over the group, e.g. comm.all_reduce_sum_ or torch.distributed)."""

    @staticmethod
    def forward(ctx, comm, qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, clip_starts, F, S, opts):
        (out,), ctx.graph = _run(
            "bigdn_cp", comm, [qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, clip_starts], F, S, opts,
            ctx.needs_input_grad[1:1 + _DIFF], 1)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        return (None, *_graph_backward(ctx, grad_out), None, None, None, None, None, None)


def bigdn(qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, F, S, k_scale=1.0, norm_eps=1e-5, eps=1e-6,
          precision="auto", checkpoint="off", clip_starts=None, deterministic=False):
    """The single-rank layer (gdncp/bigdn.h); differentiable through torch.autograd.
    clip_starts: the (B, F) clip-start mask (docs/design.md §4a), None = one clip per row.
    deterministic: the mode whose results bigdn_cp matches bitwise on any CP group (§12)."""
    opts = _capi.layer_options(k_scale, norm_eps, eps, precision, checkpoint, deterministic)
    return BiGDNFunction.apply(qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, clip_starts, F, S, opts)


def bigdn_cp(comm, qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, F, S, k_scale=1.0, norm_eps=1e-5,
             eps=1e-6, precision="auto", checkpoint="off", clip_starts=None, deterministic=False):
    """The bidirectional CP layer (gdncp/cp.h bigdn_cp) on this rank's F frames.
    deterministic: bitwise the same for every CP degree and frame split (docs/design.md §12)."""
    if not isinstance(comm, Communicator):
        raise TypeError("gdncp.bigdn_cp: comm must be a gdncp.Communicator, got %s" % type(comm).__name__)
    opts = _capi.layer_options(k_scale, norm_eps, eps, precision, checkpoint, deterministic)
    return BiGDNCPFunction.apply(comm, qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, clip_starts, F, S,
                                 opts)


class BiGDN(torch.nn.Module):
    """The bidirectional gated-delta-net layer with its RMSNorm weights as parameters.

    forward(qkv (B, F·S, 3, H, D), beta (B, H, F, S), decay (B, H, F),
            rope_cos, rope_sin (F·S, D), F, S, clip_starts=None) -> out (B, F·S, H, D).
    With comm (a gdncp.Communicator), the context-parallel layer: the inputs
    are this rank's F frames, and the weights' gradients are this rank's part
    (sum them over the group before the optimizer step).
    k_scale None: D^-1/2·S^-1/2 (Sana's production blocks), taken per call.
    """

    def __init__(self, heads, head_dim, comm=None, norm=True, k_scale=None, norm_eps=1e-5, eps=1e-6,
                 precision="auto", checkpoint="off", device=None, dtype=torch.float32, deterministic=False):
        super().__init__()
        C = heads * head_dim
        self.heads, self.head_dim, self.comm = heads, head_dim, comm
        self.k_scale, self.norm_eps, self.eps = k_scale, norm_eps, eps
        self.precision, self.checkpoint = precision, checkpoint
        self.deterministic = deterministic
        if norm:
            self.q_norm_w = torch.nn.Parameter(torch.ones(C, device=device, dtype=dtype))
            self.k_norm_w = torch.nn.Parameter(torch.ones(C, device=device, dtype=dtype))
        else:
            self.register_parameter("q_norm_w", None)
            self.register_parameter("k_norm_w", None)

    def forward(self, qkv, beta, decay, rope_cos, rope_sin, F, S, clip_starts=None):
        k_scale = self.k_scale if self.k_scale is not None else 1.0 / math.sqrt(self.head_dim * S)
        kw = dict(k_scale=k_scale, norm_eps=self.norm_eps, eps=self.eps, precision=self.precision,
                  checkpoint=self.checkpoint, clip_starts=clip_starts, deterministic=self.deterministic)
        args = (qkv, beta, decay, self.q_norm_w, self.k_norm_w, rope_cos, rope_sin, F, S)
        if self.comm is None:
            return bigdn(*args, **kw)
        return bigdn_cp(self.comm, *args, **kw)

    def extra_repr(self):
        return "heads=%d, head_dim=%d, cp=%s" % (
            self.heads, self.head_dim, "off" if self.comm is None else "%d ranks" % self.comm.size)

"""The entries as torch.library custom ops (torch >= 2.4), for torch.compile.

PyTorch's way for a library op to take part in torch.compile: a custom op with
a fake kernel (output shapes without running it) and autograd registered on
it, so that fullgraph tracing sees one opaque node per call. With torch >= 2.4
every entry of gdncp.layers.ENTRIES is registered as gdncp::<entry> (forward)
and gdncp::<entry>_backward; on older torch nothing is registered
(REGISTERED False) and every call takes the autograd.Function path.

The entries call the op while torch.compile traces (is_compiling()); eager
calls keep the autograd.Function path, whose backward reuses the graph the
library recorded in the forward. A custom op cannot carry that graph between
its forward and backward ops, so the traced backward records the call again
from the saved inputs and runs it (the cost of checkpoint="on": one more
forward in backward; the numbers are the same). A CP entry's communicator
travels as an integer key (register_comm); the ranks must trace the same way.
"""
import torch

REGISTERED = False
_comms = {}  # key -> Communicator (kept alive: a compiled graph holds the key)


def is_compiling():
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def register_comm(comm):
    """The op key of a communicator (0 = none); done eagerly, outside tracing."""
    if comm is None:
        return 0
    key = getattr(comm, "_gdncp_op_key", None)
    if key is None:
        key = len(_comms) + 1
        _comms[key] = comm
        comm._gdncp_op_key = key
    return key


def _comm(key):
    return _comms[key] if key else None


_TENSORS = {
    "layer": ("Tensor qkv, Tensor beta, Tensor decay, Tensor? q_norm_w, Tensor? k_norm_w, Tensor rope_cos, "
              "Tensor rope_sin, Tensor? rope_cos_q, Tensor? rope_sin_q, Tensor? clip_starts"),
    "cp_cam_gdn_num": "Tensor q, Tensor k, Tensor v, Tensor beta, Tensor decay",
    "cp_scan": "Tensor P, Tensor A, Tensor Pz, Tensor bz, Tensor decay, Tensor? clip_starts",
}
_SCALAR_TYPES = {"F": "int", "S": "int", "k_scale": "float", "norm_eps": "float", "eps": "float",
                 "precision": "str", "checkpoint": "str", "reverse_rank_order": "bool", "truncate_to_active": "int",
                 "exchange": "str", "deterministic": "bool", "overlap_exchange": "bool"}


def _tuple_of(n):
    return "Tensor" if n == 1 else "(%s)" % ", ".join(["Tensor"] * n)


def _compute_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _fake_outputs(entry, inputs, s):
    """Shapes and dtypes of the n_out outputs (an absent terminal state: an empty tensor)."""
    x0 = inputs[0]
    K = s.get("truncate_to_active", 0)
    if entry in ("bigdn", "bigdn_cp"):
        B, N, _, H, D = x0.shape
        return [x0.new_empty(B, N, H, D)]
    if entry == "cp_gdn_raw":
        B, N, _, H, D = x0.shape
        cd = _compute_dtype(x0)
        return [x0.new_empty(B, N, H, D, dtype=cd), x0.new_empty(B, H, N, dtype=cd),
                x0.new_empty(*((B * H, D, D) if K else (0,)), dtype=cd),
                x0.new_empty(*((B * H, D) if K else (0,)), dtype=cd)]
    if entry == "cp_cam_gdn_num":
        B, H, D, N = x0.shape
        return [x0.new_empty(B, H, D, N), x0.new_empty(*((B * H, D, D) if K else (0,)), dtype=_compute_dtype(x0))]
    P, bz = inputs[0], inputs[3]  # cp_scan
    return [torch.empty_like(P), torch.empty_like(bz), P.new_empty(*(P.shape[:1] + P.shape[2:] if K else (0,))),
            bz.new_empty(*((bz.shape[0], bz.shape[2]) if K else (0,)))]


def _register(entry):
    from . import layers

    n_in, n_diff, n_out, names = layers.ENTRIES[entry]
    tensors = _TENSORS.get(entry, _TENSORS["layer"])
    scalars = ", ".join("%s %s" % (_SCALAR_TYPES[n], n) for n in names)
    grads = ", ".join("Tensor? g%d" % k for k in range(n_out))

    def split(args):
        return list(args[:n_in]), tuple(args[n_in:n_in + len(names)]), args[n_in + len(names)]

    def forward(*args):
        inputs, sc, key = split(args)
        outs, _ = layers._Call(entry, _comm(key), sc).run(inputs, [False] * n_diff, False)
        fake = _fake_outputs(entry, inputs, dict(zip(names, sc)))
        outs = [o if o is not None else f.new_empty(0) for o, f in zip(outs + [None] * n_out, fake)]
        return outs[0] if n_out == 1 else tuple(outs)

    def fake_forward(*args):
        inputs, sc, _ = split(args)
        outs = _fake_outputs(entry, inputs, dict(zip(names, sc)))
        return outs[0] if n_out == 1 else tuple(outs)

    def backward_op(*args):
        inputs, sc, key = split(args)
        needs_mask, gs = args[n_in + len(names) + 1], args[n_in + len(names) + 2:]
        needs = [bool(needs_mask >> i & 1) for i in range(n_diff)]
        call = layers._Call(entry, _comm(key), sc)
        _, graph = call.run(inputs, needs, True)
        got = graph.backward([g if g is not None and g.numel() else None for g in gs[:call.present]],
                             layers._dlpack.stream_of(inputs[0])) if graph is not None else [None] * n_diff
        return tuple(g if g is not None else inputs[0].new_empty(0) for g in got)

    def fake_backward(*args):
        inputs = args[:n_in]
        needs_mask = args[n_in + len(names) + 1]
        return tuple(torch.empty_like(inputs[i]) if (needs_mask >> i & 1) and inputs[i] is not None
                     else inputs[0].new_empty(0) for i in range(n_diff))

    lib = torch.library
    fwd = lib.custom_op("gdncp::%s" % entry, forward, mutates_args=(),
                        schema="(%s, %s, int comm) -> %s" % (tensors, scalars, _tuple_of(n_out)))
    fwd.register_fake(fake_forward)
    bwd = lib.custom_op("gdncp::%s_backward" % entry, backward_op, mutates_args=(),
                        schema="(%s, %s, int comm, int needs, %s) -> %s" % (tensors, scalars, grads,
                                                                             _tuple_of(n_diff)))
    bwd.register_fake(fake_backward)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:n_in])
        ctx.rest = inputs[n_in:]

    def backward(ctx, *grads):
        inputs = ctx.saved_tensors  # torch checks their version counters here
        needs = 0
        for i in range(n_diff):
            if ctx.needs_input_grad[i] and inputs[i] is not None:
                needs |= 1 << i
        got = getattr(torch.ops.gdncp, entry + "_backward").default(*inputs, *ctx.rest, needs, *grads)
        got = got if isinstance(got, tuple) else (got,)
        return tuple(got[i] if needs >> i & 1 else None for i in range(n_diff)) + (None,) * (
            n_in - n_diff + len(ctx.rest))

    fwd.register_autograd(backward, setup_context=setup_context)
    return getattr(torch.ops.gdncp, entry).default  # what tracing calls: the op overload


_OPS = {}


def call(entry, comm, scalars, inputs):
    """The present outputs of one entry call through its custom op (while tracing)."""
    from . import layers

    key = getattr(comm, "_gdncp_op_key", None) if comm is not None else 0
    if key is None:
        raise RuntimeError("gdncp: a communicator used under torch.compile must be registered first "
                           "(gdncp.BiGDN does it; else call gdncp._ops.register_comm(comm) eagerly)")
    outs = _OPS[entry](*inputs, *scalars, key)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return outs[:layers.present(entry, scalars)]


UNAVAILABLE = "torch %s has no torch.library.custom_op (torch < 2.4)" % torch.__version__


def _register_all():
    """Registers every entry; a failure leaves the autograd.Function path in use and says why (UNAVAILABLE)."""
    global REGISTERED, UNAVAILABLE
    lib = torch.library
    if not (hasattr(lib, "custom_op") and hasattr(lib, "register_fake")):
        return
    from . import layers

    try:
        for entry in layers.ENTRIES:
            _OPS[entry] = _register(entry)
    except Exception as e:  # keep the package importable: eager calls do not need the ops
        import warnings

        UNAVAILABLE = "registering the gdncp custom ops failed: %s: %s" % (type(e).__name__, e)
        warnings.warn("gdncp: " + UNAVAILABLE + "; torch.compile will not trace the entries")
        return
    REGISTERED = True
    UNAVAILABLE = ""

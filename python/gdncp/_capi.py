"""ctypes binding of the C ABI (include/gdncp/gdncp_c.h).

Why ctypes: the package needs no compiled extension of its own, so it is tied
to no Python version's ABI and builds nothing beyond libgdncp; one shared
library serves every interpreter (Debian's, a venv's, a container's torch).
The calls are coarse (one per layer call), so ctypes' per-call cost is small
next to a layer step (python/examples/bench_door.py measures it).

The library is found, in order: $GDNCP_LIBRARY (alone, when set); the path the
build wrote into _library.py (build/python/gdncp/_library.py); libgdncp.so
beside the package (pip install); <libdir>/libgdncp.so for the package in
<libdir>/python3/dist-packages/gdncp (cmake --install); the loader's search
path. The ImportError lists every place tried.
"""
import ctypes
import ctypes.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))

OK = 0
STATUS_NAMES = {0: "ok", 1: "argument", 2: "error", 3: "out of memory", 4: "internal"}

PRECISIONS = {"auto": 0, "bf16": 1, "tf32": 2, "ieee": 3}
CHECKPOINTS = {"off": 0, "on": 1, "auto": 2}
EXCHANGES = {"auto": 0, "allgather": 1, "log": 2, "hierarchical": 3}
UNIQUE_ID_BYTES = 128


class GdncpError(RuntimeError):
    """A failed gdncp call: .status is the C status, the message the library's."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class ArgumentError(GdncpError, ValueError):
    """The C API refused an argument (GDNCP_ERROR_ARGUMENT)."""


def _candidates():
    """(path or None, why it was not found) for every place looked at, in order."""
    env = os.environ.get("GDNCP_LIBRARY")
    if env:
        yield env, "$GDNCP_LIBRARY"
        return
    try:
        from ._library import LIBRARY  # written by the build into the build tree's package

        yield LIBRARY, "the build tree's _library.py"
    except ImportError:
        yield None, "no _library.py (not the build tree's package)"
    # Beside the package (pip install), then the libdir of a cmake --install, which puts the package in
    # <libdir>/python3/dist-packages/gdncp.
    for d in (_HERE, os.path.normpath(os.path.join(_HERE, "..", "..", ".."))):
        for name in ("libgdncp.so", "libgdncp.so.0"):
            yield os.path.join(d, name), None
    found = ctypes.util.find_library("gdncp")
    yield found, None if found else "ctypes.util.find_library('gdncp') found nothing"
    yield "libgdncp.so.0", "the loader's search path"


def _load():
    tried = []
    for path, note in _candidates():
        if path is None:
            tried.append(note)
            continue
        if os.sep in path and not os.path.exists(path):
            tried.append("%s (no such file%s)" % (path, ", " + note if note else ""))
            continue
        try:
            # RTLD_GLOBAL: MPI's plugins resolve symbols of libmpi loaded through us.
            return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            tried.append("%s (%s%s)" % (path, note + ": " if note else "", e))
    raise ImportError("gdncp: libgdncp not found; set GDNCP_LIBRARY to its path. Tried: " + "; ".join(tried))


lib = _load()

_p = ctypes.c_void_p
_pp = ctypes.POINTER(ctypes.c_void_p)
_i64 = ctypes.c_int64
_u32 = ctypes.c_uint32
_int = ctypes.c_int


class LayerOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("k_scale", ctypes.c_double),
        ("norm_eps", ctypes.c_double),
        ("eps", ctypes.c_double),
        ("precision", ctypes.c_int),
        ("checkpoint", ctypes.c_int),
        ("deterministic", ctypes.c_int),
    ]


class CpOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("reverse_rank_order", ctypes.c_int),
        ("truncate_to_active", ctypes.c_int64),
        ("exchange", ctypes.c_int),
        ("node_size", ctypes.c_int),
        ("deterministic", ctypes.c_int),
        ("overlap_exchange", ctypes.c_int),
    ]


# gdncp_comm_callbacks: the collectives of a communicator the caller runs (comm.py).
ALL_GATHER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_void_p)
BROADCAST_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                ctypes.c_void_p)
SEND_RECV_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
ERROR_MESSAGE_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)  # const char* (kept alive by the caller)
RELEASE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class CommCallbacks(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("user", ctypes.c_void_p),
        ("all_gather", ALL_GATHER_FN),
        ("broadcast", BROADCAST_FN),
        ("send_recv", SEND_RECV_FN),
        ("error_message", ERROR_MESSAGE_FN),
        ("release", RELEASE_FN),
    ]


def _sig(name, *args):
    f = getattr(lib, name)
    f.restype = ctypes.c_int
    f.argtypes = list(args)
    return f


lib.gdncp_last_error.restype = ctypes.c_char_p
lib.gdncp_last_error.argtypes = []
lib.gdncp_abi_version.restype = ctypes.c_int
lib.gdncp_cuda_available.restype = ctypes.c_int
# qkv, beta, decay, q_norm_w, k_norm_w, rope_cos, rope_sin, rope_cos_q, rope_sin_q, clip_starts, F, S, options
_LAYER_IN = [_p] * 10 + [_i64, _i64, ctypes.POINTER(LayerOptions)]
F = {
    "layer_options_init": _sig("gdncp_layer_options_init", ctypes.POINTER(LayerOptions)),
    "cp_options_init": _sig("gdncp_cp_options_init", ctypes.POINTER(CpOptions)),
    "unique_id": _sig("gdncp_unique_id", ctypes.c_char_p),
    "comm_create_nccl": _sig("gdncp_comm_create_nccl", ctypes.c_char_p, _int, _int, _int, _pp),
    "comm_create_mpi_world": _sig("gdncp_comm_create_mpi_world", _pp),
    "comm_callbacks_init": _sig("gdncp_comm_callbacks_init", ctypes.POINTER(CommCallbacks)),
    "comm_create_callbacks": _sig("gdncp_comm_create_callbacks", ctypes.POINTER(CommCallbacks), _int, _int, _int,
                                  _pp),
    "mpi_finalize": _sig("gdncp_mpi_finalize"),
    "comm_destroy": _sig("gdncp_comm_destroy", _p),
    "comm_rank": _sig("gdncp_comm_rank", _p, ctypes.POINTER(_int)),
    "comm_size": _sig("gdncp_comm_size", _p, ctypes.POINTER(_int)),
    "comm_backend": _sig("gdncp_comm_backend", _p, ctypes.POINTER(ctypes.c_char_p)),
    "comm_set_timeout": _sig("gdncp_comm_set_timeout", _p, ctypes.c_double),
    "comm_timeout": _sig("gdncp_comm_timeout", _p, ctypes.POINTER(ctypes.c_double)),
    "comm_aborted": _sig("gdncp_comm_aborted", _p, ctypes.POINTER(_int)),
    "comm_all_reduce_sum": _sig("gdncp_comm_all_reduce_sum", _p, _p, _p),
    "graph_num_outputs": _sig("gdncp_graph_num_outputs", _p, ctypes.POINTER(_int)),
    "graph_num_inputs": _sig("gdncp_graph_num_inputs", _p, ctypes.POINTER(_int)),
    "graph_backward": _sig("gdncp_graph_backward", _p, _pp, _p, _pp),
    "graph_destroy": _sig("gdncp_graph_destroy", _p),
    "bigdn": _sig("gdncp_bigdn", *_LAYER_IN, _p, _u32, _pp, _pp),
    "bigdn_cp": _sig("gdncp_bigdn_cp", _p, *_LAYER_IN, _p, _u32, _pp, _pp),
    "bigdn_cp_ex": _sig("gdncp_bigdn_cp_ex", _p, *_LAYER_IN, ctypes.POINTER(CpOptions), _p, _u32, _pp, _pp),
    "cp_gdn_raw": _sig("gdncp_cp_gdn_raw", _p, *_LAYER_IN, ctypes.POINTER(CpOptions), _p, _u32, _pp, _pp),
    "cp_scan": _sig("gdncp_cp_scan", _p, _p, _p, _p, _p, _p, _p, ctypes.POINTER(CpOptions), _p, _u32, _pp, _pp),
    "cp_cam_gdn_num": _sig("gdncp_cp_cam_gdn_num", _p, _p, _p, _p, _p, _p, _i64, _i64, ctypes.POINTER(CpOptions), _int,
                           _p, _u32, _pp, _pp),
}


def check(status):
    """Raises the library's error for a failed status (message from this thread)."""
    if status == OK:
        return
    msg = lib.gdncp_last_error().decode("utf-8", "replace")
    cls = ArgumentError if status == 1 else GdncpError
    raise cls(status, "gdncp (%s): %s" % (STATUS_NAMES.get(status, status), msg))


def call(name, *args):
    check(F[name](*args))


def abi_version():
    return lib.gdncp_abi_version()


def cuda_available():
    return bool(lib.gdncp_cuda_available())


def layer_options(k_scale=1.0, norm_eps=1e-5, eps=1e-6, precision="auto", checkpoint="off", deterministic=False):
    o = LayerOptions()
    call("layer_options_init", ctypes.byref(o))
    o.k_scale, o.norm_eps, o.eps = float(k_scale), float(norm_eps), float(eps)
    if precision not in PRECISIONS:
        raise ValueError("gdncp: precision must be one of %s, got %r" % (sorted(PRECISIONS), precision))
    if checkpoint not in CHECKPOINTS:
        raise ValueError("gdncp: checkpoint must be one of %s, got %r" % (sorted(CHECKPOINTS), checkpoint))
    o.precision = PRECISIONS[precision]
    o.checkpoint = CHECKPOINTS[checkpoint]
    o.deterministic = int(bool(deterministic))
    return o


def flag(fn, name, value):
    """value, which must be a bool (True or False): a TypeError naming name otherwise."""
    if not isinstance(value, bool):
        raise TypeError("%s: %s must be True or False, got %r" % (fn, name, value))
    return value


def exchange_of(fn, exchange):
    """The gdncp_exchange code of an exchange name: a ValueError naming the choices otherwise."""
    if exchange not in EXCHANGES:
        raise ValueError("%s: exchange must be one of %s, got %r" % (fn, sorted(EXCHANGES), exchange))
    return EXCHANGES[exchange]


def cp_options(reverse_rank_order=False, truncate_to_active=0, exchange="auto", node_size=0, deterministic=False,
               overlap_exchange=False):
    o = CpOptions()
    call("cp_options_init", ctypes.byref(o))
    o.reverse_rank_order = int(bool(reverse_rank_order))
    o.truncate_to_active = int(truncate_to_active)
    o.exchange = exchange_of("gdncp", exchange)
    o.node_size = int(node_size)
    o.deterministic = int(bool(deterministic))
    o.overlap_exchange = int(flag("gdncp", "overlap_exchange", overlap_exchange))
    return o


class OwnedHandle:
    """Owner of one C handle (self._h): release() frees it through the C
    function named by _destroy_fn, once; collection releases it too."""

    _destroy_fn = None

    def __init__(self, handle):
        self._h = ctypes.c_void_p(handle)

    def release(self):
        if getattr(self, "_h", None) is not None and self._h.value:
            h, self._h = self._h, ctypes.c_void_p()
            call(self._destroy_fn, h)

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass

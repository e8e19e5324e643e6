"""Communicators of the CP layers: NCCL from a unique id (no MPI), MPI's world,
or one made from a torch.distributed process group of any backend (NCCL, or
the group's own collectives through callbacks, e.g. gloo on the CPU)."""
import atexit
import ctypes
import weakref

from . import _capi

_live_mpi = weakref.WeakSet()
_atexit_done = False


def unique_id():
    """A fresh NCCL unique id (bytes). Make it on one rank, move it to the others."""
    buf = ctypes.create_string_buffer(_capi.UNIQUE_ID_BYTES)
    _capi.call("unique_id", buf)
    return buf.raw


def _finalize_mpi():
    for c in list(_live_mpi):
        c.close()
    _capi.call("mpi_finalize")


class Communicator(_capi.OwnedHandle):
    """A CP group. Use unique_id() + Communicator.nccl(...) (CUDA tensors),
    Communicator.mpi_world() (CPU tensors, under mpirun) or from_process_group()
    (any torch.distributed group)."""

    _destroy_fn = "comm_destroy"

    @classmethod
    def nccl(cls, uid, rank, size, device):
        """Collective over the size ranks: each passes the same id, its rank and its CUDA device index."""
        if not isinstance(uid, (bytes, bytearray)) or len(uid) != _capi.UNIQUE_ID_BYTES:
            raise ValueError("gdncp: uid must be %d bytes (from gdncp.unique_id())" % _capi.UNIQUE_ID_BYTES)
        h = ctypes.c_void_p()
        _capi.call("comm_create_nccl", bytes(uid), int(rank), int(size), int(device), ctypes.byref(h))
        return cls(h.value)

    @classmethod
    def mpi_world(cls):
        """MPI_COMM_WORLD (initialising MPI when nobody has; then MPI is
        finalized at exit, after the MPI communicators are closed)."""
        global _atexit_done
        h = ctypes.c_void_p()
        _capi.call("comm_create_mpi_world", ctypes.byref(h))
        c = cls(h.value)
        _live_mpi.add(c)
        if not _atexit_done:
            atexit.register(_finalize_mpi)
            _atexit_done = True
        return c

    @property
    def handle(self):
        if not self._h.value:
            raise ValueError("gdncp: the communicator is closed")
        return self._h

    def _get(self, name, ctype):
        v = ctype()
        _capi.call(name, self.handle, ctypes.byref(v))
        return v.value

    @property
    def rank(self):
        return self._get("comm_rank", ctypes.c_int)

    @property
    def size(self):
        return self._get("comm_size", ctypes.c_int)

    @property
    def backend(self):
        return self._get("comm_backend", ctypes.c_char_p).decode()

    @property
    def timeout(self):
        """Deadline of each collective, seconds (finite, > 0)."""
        return self._get("comm_timeout", ctypes.c_double)

    @timeout.setter
    def timeout(self, seconds):
        _capi.call("comm_set_timeout", self.handle, float(seconds))

    @property
    def aborted(self):
        return bool(self._get("comm_aborted", ctypes.c_int))

    def all_reduce_sum_(self, t):
        """In place sum over the group of a contiguous tensor on the communicator's device."""
        from . import _dlpack

        if not t.is_contiguous():
            raise ValueError("gdncp: all_reduce_sum_ needs a contiguous tensor")
        _capi.call("comm_all_reduce_sum", self.handle, _dlpack.give(t), _dlpack.stream_of(t))
        return t

    def close(self):
        """Frees the handle (layers recorded for backward keep the communicator alive)."""
        self.release()


def _global_rank(group, group_rank):
    import torch.distributed as dist

    if group is None:
        return group_rank
    if hasattr(dist, "get_global_rank"):  # torch >= 2.0
        return dist.get_global_rank(group, group_rank)
    return dist.distributed_c10d._get_global_rank(group, group_rank)


# Tables of the live callback communicators, by id: ctypes keeps a callback
# alive only while its Python object lives, and the library may call them
# until its communicator is freed (after its last graph), when release drops them.
_tables = {}
_next_id = [1]


def _host_bytes(ptr, n):
    """A writable uint8 torch tensor over n bytes of host memory at ptr (no copy)."""
    import torch

    return torch.frombuffer((ctypes.c_char * n).from_address(ptr), dtype=torch.uint8)


class _GroupCollectives:
    """The collectives gdncp needs, run by torch.distributed on `group`'s CPU tensors."""

    def __init__(self, group):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.size = dist.get_world_size(group)
        self.error = None  # bytes of the last failure, read by error_message

    def all_gather(self, out, inp, n):
        src = _host_bytes(inp, n)
        dst = _host_bytes(out, n * self.size)
        self.dist.all_gather(list(dst.view(self.size, n).unbind(0)), src, group=self.group)

    def broadcast(self, data, n, root):
        self.dist.broadcast(_host_bytes(data, n), src=_global_rank(self.group, root), group=self.group)


def _callback_table(impl):
    """A CommCallbacks table over impl's methods (exceptions become status 1 + message) and its key."""
    key = _next_id[0]
    _next_id[0] += 1

    def guard(fn):
        def run(*args):
            try:
                fn(*args)
                return 0
            except BaseException as e:  # nothing may unwind into C
                impl.error = ("%s: %s" % (type(e).__name__, e)).encode("utf-8", "replace")
                return 1

        return run

    cb = _capi.CommCallbacks()
    _capi.call("comm_callbacks_init", ctypes.byref(cb))
    cb.user = key
    keep = [
        _capi.ALL_GATHER_FN(guard(lambda user, out, inp, n, stream: impl.all_gather(out, inp, n))),
        _capi.BROADCAST_FN(guard(lambda user, data, n, root, stream: impl.broadcast(data, n, root))),
        _capi.ERROR_MESSAGE_FN(lambda user: ctypes.cast(ctypes.c_char_p(impl.error), ctypes.c_void_p).value
                               if impl.error else None),
        _capi.RELEASE_FN(lambda user: _tables.pop(user, None)),
    ]
    cb.all_gather, cb.broadcast, cb.error_message, cb.release = keep
    _tables[key] = (impl, keep)
    return cb, key


def _from_callbacks(group):
    """A communicator over the CPU tensors of a torch.distributed group of any backend."""
    import torch.distributed as dist

    impl = _GroupCollectives(group)
    cb, key = _callback_table(impl)
    h = ctypes.c_void_p()
    try:
        _capi.call("comm_create_callbacks", ctypes.byref(cb), dist.get_rank(group), impl.size, -1, ctypes.byref(h))
    except BaseException:
        _tables.pop(key, None)  # not armed: release will not run
        raise
    return Communicator(h.value)


def _under_mpirun(size):
    """Whether this process was started by mpirun with a world of `size` ranks."""
    import os

    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var]) == size
    return False


def _mesh_group(mesh, mesh_dim):
    """The process group of one dimension of a DeviceMesh (torch >= 2.2: get_group; 2.0-2.1: get_dim_groups)."""
    if hasattr(mesh, "get_group"):
        return mesh.get_group(mesh_dim)
    return mesh.get_dim_groups()[mesh_dim if isinstance(mesh_dim, int) else mesh.mesh_dim_names.index(mesh_dim)]


def from_process_group(group=None, device=None, mesh_dim=None, via="auto"):
    """A communicator over the ranks of a torch.distributed group (None = the default group), or of the
    mesh_dim dimension of a DeviceMesh (e.g. the CP dimension of a CP x DP mesh) given as group.

    via="nccl" (auto for NCCL groups; CUDA tensors): rank 0 of the group makes the id, the group broadcasts
    it from that rank (its global rank, so sub-groups work), every rank builds an NCCL communicator on
    `device` (default: the current CUDA device).
    via="callbacks" (auto for other backends, e.g. gloo; CPU tensors): the library's collectives run as the
    group's own all_gather and broadcast, no MPI needed. The group's timeout is the deadline (the library
    cannot interrupt a collective it does not run).
    via="mpi" (auto for the default group of a job started by mpirun whose world is the group's; CPU
    tensors): MPI_COMM_WORLD, which must hold the group's ranks in the same order; it keeps the MPI
    communicator's deadlines and checks.
    """
    import torch
    import torch.distributed as dist

    if mesh_dim is not None or (group is not None and hasattr(group, "mesh") and hasattr(group, "device_type")):
        if mesh_dim is None:
            raise ValueError("gdncp.from_process_group: a DeviceMesh needs mesh_dim (its CP dimension)")
        group = _mesh_group(group, mesh_dim)
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    if via == "auto":
        if dist.get_backend(group) == "nccl":
            via = "nccl"
        elif size == dist.get_world_size() and _under_mpirun(size):
            via = "mpi"
        else:
            via = "callbacks"
    if via == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device() if device is None else int(device))
        buf = torch.zeros(_capi.UNIQUE_ID_BYTES, dtype=torch.uint8, device=dev)
        if rank == 0:
            buf.copy_(torch.frombuffer(bytearray(unique_id()), dtype=torch.uint8))
        dist.broadcast(buf, src=_global_rank(group, 0), group=group)
        return Communicator.nccl(bytes(buf.cpu().tolist()), rank, size, dev.index)
    if via == "callbacks":
        return _from_callbacks(group)
    if via != "mpi":
        raise ValueError("gdncp.from_process_group: via must be auto, nccl, callbacks or mpi, got %r" % (via,))
    c = Communicator.mpi_world()
    if (c.rank, c.size) != (rank, size):
        r, s = c.rank, c.size
        c.close()
        raise ValueError(
            "gdncp: MPI_COMM_WORLD has rank %d of %d but the process group rank %d of %d; "
            "run the CPU path under mpirun with the group spanning the world" % (r, s, rank, size)
        )
    return c

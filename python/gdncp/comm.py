"""Communicators of the CP layers: NCCL from a unique id (no MPI), MPI's world,
or either made from a torch.distributed process group."""
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
    Communicator.mpi_world() (CPU tensors, under mpirun) or from_process_group()."""

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


def from_process_group(group=None, device=None):
    """A communicator over the ranks of a torch.distributed group.

    NCCL groups (CUDA): rank 0 of the group makes the id, the group broadcasts
    it, every rank builds an NCCL communicator on `device` (default: the
    current CUDA device). Other backends (CPU tensors): MPI_COMM_WORLD, which
    must hold exactly the group's ranks in the same order (run under mpirun).
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    if dist.get_backend(group) == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device() if device is None else int(device))
        buf = torch.zeros(_capi.UNIQUE_ID_BYTES, dtype=torch.uint8, device=dev)
        if rank == 0:
            buf.copy_(torch.frombuffer(bytearray(unique_id()), dtype=torch.uint8))
        dist.broadcast(buf, src=_global_rank(group, 0), group=group)
        return Communicator.nccl(bytes(buf.cpu().tolist()), rank, size, dev.index)
    c = Communicator.mpi_world()
    if (c.rank, c.size) != (rank, size):
        r, s = c.rank, c.size
        c.close()
        raise ValueError(
            "gdncp: MPI_COMM_WORLD has rank %d of %d but the process group rank %d of %d; "
            "run the CPU path under mpirun with the group spanning the world" % (r, s, rank, size)
        )
    return c

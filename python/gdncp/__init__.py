"""gdncp: the bidirectional gated-delta-net layer, one GPU or context-parallel,
from PyTorch through gdncp's C ABI (include/gdncp/gdncp_c.h).

    import gdncp
    comm = gdncp.from_process_group()          # under torchrun (NCCL) or mpirun (CPU, MPI)
    layer = gdncp.BiGDN(heads, head_dim, comm=comm).cuda()
    out = layer(qkv, beta, decay, rope_cos, rope_sin, F, S)

Without torch installed only the C ABI binding (gdncp._capi) and the
communicator bootstrap's id (gdncp.unique_id) are usable.
"""
import importlib.util as _util

from ._capi import ArgumentError, GdncpError, abi_version, cuda_available
from .comm import Communicator, from_process_group, unique_id

__version__ = "0.1.0"
__all__ = ["ArgumentError", "GdncpError", "abi_version", "cuda_available", "Communicator", "from_process_group",
           "unique_id"]

if _util.find_spec("torch") is not None:
    from .layers import BiGDN, BiGDNCPFunction, BiGDNFunction, bigdn, bigdn_cp

    __all__ += ["BiGDN", "BiGDNCPFunction", "BiGDNFunction", "bigdn", "bigdn_cp"]

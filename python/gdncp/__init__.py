"""gdncp: the bidirectional gated-delta-net layer, one GPU or context-parallel,
from PyTorch through gdncp's C ABI (include/gdncp/gdncp_c.h).

    import gdncp
    comm = gdncp.from_process_group()          # under torchrun (NCCL) or mpirun (CPU, MPI)
    layer = gdncp.BiGDN(heads, head_dim, comm=comm).cuda()
    out = layer(qkv, beta, decay, rope_cos, rope_sin, F, S)

Entries (each an op with autograd): bigdn, bigdn_cp, cp_gdn_raw, cp_cam_gdn_num,
cp_scan; helpers rope_tables, split_frames, gather_frames; Sana's names in
gdncp.sana.

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
    from . import _ops, sana  # noqa: F401  (_ops: the torch.library registration, torch >= 2.4)
    from .frames import balanced_split, gather_frames, rope_tables, split_frames
    from .layers import (BiGDN, CamResult, RawResult, ScanResult, bigdn, bigdn_cp, cp_cam_gdn_num, cp_gdn_raw,
                         cp_scan)

    __all__ += ["BiGDN", "CamResult", "RawResult", "ScanResult", "balanced_split", "bigdn", "bigdn_cp",
                "cp_cam_gdn_num", "cp_gdn_raw", "cp_scan", "gather_frames", "rope_tables", "sana", "split_frames"]

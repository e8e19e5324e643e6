"""Sana's entry points by their names and signatures, computed by gdncp.

A Sana user swaps one import: the functions below take what Sana's take
(a torch.distributed process group as `group`, `dot_precision` 0/1/2,
`use_checkpoint`) and return what they return, in Sana's conventions:

- norm weights None mean unit weights (Sana applies the RMSNorm anyway; the
  library's own entries read None as "no RMSNorm"), so ones are passed;
- KV states and terminal states are Sana's right-multiplied S = Mᵀ
  ([value][key]); the library's [key][value] states are transposed here;
- `group` is a torch.distributed group (None: the default group) or a
  gdncp.Communicator; the communicator made from a group is kept for the
  group's later calls (making one is collective).

dot_precision: 0 -> the library's "auto" (bf16 operands for bf16 input, IEEE
fp32 for fp32 input), 1 -> "tf32", 2 -> "ieee" (fp32 accumulation and fp32
state in every mode). Arguments taken and not honoured: BLOCK_S (a Triton tile
size; the library picks its own tiles; the numbers do not depend on it),
`eps` of the raw entry and `eps_recurrence` of the camera entry (unused by
Sana too). Anything else outside Sana's contract (e.g. dot_precision 3) is
refused with a ValueError. One difference in dtype: the raw entry's num and
den come in the library's compute dtype (fp32; fp64 for fp64 input) at every
dot_precision, where Sana's are bf16 at dot_precision 0.
"""
import dataclasses
from typing import Optional

import torch

from . import layers
from .comm import Communicator, from_process_group

__all__ = ["CpFrameGdnScanResult", "CpFusedGdnRawResult", "cp_frame_gdn_scan", "cp_fused_cam_gdn_num_autograd",
           "cp_fused_gdn_chunkwise_raw_autograd", "fused_bigdn_chunkwise_autograd"]

_PRECISION = {0: "auto", 1: "tf32", 2: "ieee"}


@dataclasses.dataclass(frozen=True)
class CpFusedGdnRawResult:
    num: torch.Tensor
    den: torch.Tensor
    terminal_state_kv: Optional[torch.Tensor] = None
    terminal_state_z: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True)
class CpFrameGdnScanResult:
    S_kv_all: torch.Tensor
    S_z_all: torch.Tensor
    terminal_state_kv: Optional[torch.Tensor] = None
    terminal_state_z: Optional[torch.Tensor] = None


def _precision(dot_precision, fn):
    if dot_precision not in _PRECISION:
        raise ValueError("gdncp.sana.%s: dot_precision must be 0, 1 or 2, got %r" % (fn, dot_precision))
    return _PRECISION[dot_precision]


def _checkpoint(use_checkpoint):
    return "auto" if use_checkpoint is None else ("on" if use_checkpoint else "off")


def _norm_weight(w, qkv):
    if w is not None:
        return w
    C = qkv.shape[3] * qkv.shape[4]
    return torch.ones(C, dtype=torch.float64 if qkv.dtype == torch.float64 else torch.float32, device=qkv.device)


_comms = {}


def _comm(group):
    """The gdncp communicator of a group (made once per group, collectively)."""
    if isinstance(group, Communicator):
        return group
    import torch.distributed as dist

    key = dist.group.WORLD if group is None else group
    c = _comms.get(key)
    if c is None:
        c = _comms[key] = from_process_group(group)
    return c


def _transpose(t):
    return None if t is None else t.transpose(-1, -2)


def fused_bigdn_chunkwise_autograd(qkv, beta, decay, q_norm_weight, k_norm_weight, rope_cos, rope_sin, F, S,
                                   k_scale=1.0, norm_eps=1e-5, eps=1e-6, dot_precision=0, BLOCK_S=64):
    """The single-GPU bidirectional layer: out (B, N, H, D). BLOCK_S is not used."""
    return layers.bigdn(qkv, beta, decay, _norm_weight(q_norm_weight, qkv), _norm_weight(k_norm_weight, qkv),
                        rope_cos, rope_sin, F, S, k_scale=k_scale, norm_eps=norm_eps, eps=eps,
                        precision=_precision(dot_precision, "fused_bigdn_chunkwise_autograd"))


def cp_fused_gdn_chunkwise_raw_autograd(qkv, beta, decay, q_norm_weight, k_norm_weight, rope_cos, rope_sin, *, F, S,
                                        group, k_scale=1.0, norm_eps=1e-5, eps=1e-6, dot_precision=0,
                                        reverse_rank_order=False, truncate_to_active=None, use_checkpoint=None,
                                        rope_cos_q=None, rope_sin_q=None):
    """One direction, raw, over the CP group: CpFusedGdnRawResult(num (B, N, H,
    D), den (B, H, N), terminal_state_kv (BH, D, D) as S = Mᵀ, terminal_state_z
    (BH, D)), the terminal states only with truncate_to_active. eps is not used
    (the caller divides)."""
    r = layers.cp_gdn_raw(_comm(group), qkv, beta, decay, _norm_weight(q_norm_weight, qkv),
                          _norm_weight(k_norm_weight, qkv), rope_cos, rope_sin, F, S, k_scale=k_scale,
                          norm_eps=norm_eps, precision=_precision(dot_precision, "cp_fused_gdn_chunkwise_raw_autograd"),
                          checkpoint=_checkpoint(use_checkpoint), reverse_rank_order=reverse_rank_order,
                          truncate_to_active=truncate_to_active, rope_cos_q=rope_cos_q, rope_sin_q=rope_sin_q)
    return CpFusedGdnRawResult(r.num, r.den, _transpose(r.terminal_M), r.terminal_z)


def cp_fused_cam_gdn_num_autograd(q, k, v, beta, decay, *, F, S, group, reverse_rank_order=False,
                                  truncate_to_active=None, eps_recurrence=0.0, use_checkpoint=None):
    """The camera branch, numerator only: (out (B, H, D, N), terminal_state_kv
    (BH, D, D) as S = Mᵀ with truncate_to_active, else None). eps_recurrence is
    not used."""
    r = layers.cp_cam_gdn_num(_comm(group), q, k, v, beta, decay, F, S, reverse_rank_order=reverse_rank_order,
                              truncate_to_active=truncate_to_active, checkpoint=_checkpoint(use_checkpoint))
    return r.out, _transpose(r.terminal_M)


def cp_frame_gdn_scan(W_kv, U_kv, W_z, U_z, *, group, reverse=False, truncate_to_active=None):
    """The distributed frame scan on Sana's transitions: S_t = S_{t−1} W_kv,t +
    U_kv,t (right-multiplied, decay folded into W) and z_t = W_z,t z_{t−1} +
    U_z,t; W_kv, U_kv, W_z (BH, F, D, D), U_z (BH, F, D). Returns (S_kv_all,
    S_z_all), or with truncate_to_active a CpFrameGdnScanResult with the
    terminal states. Through the library's scan with decay 1, P = I − W_kvᵀ,
    A = U_kvᵀ, Pz = I − W_z, bz = U_z (differentiable in all four)."""
    BH, F, D = W_kv.shape[0], W_kv.shape[1], W_kv.shape[-1]
    eye = torch.eye(D, dtype=W_kv.dtype, device=W_kv.device)
    ones = torch.ones(1, BH, F, dtype=W_kv.dtype, device=W_kv.device)
    r = layers.cp_scan(_comm(group), (eye - W_kv.transpose(-1, -2)).contiguous(), U_kv.transpose(-1, -2).contiguous(),
                       (eye - W_z).contiguous(), U_z, ones, reverse_rank_order=reverse,
                       truncate_to_active=truncate_to_active)
    S_kv, S_z = r.M.transpose(-1, -2), r.z
    if truncate_to_active is None:
        return S_kv, S_z
    return CpFrameGdnScanResult(S_kv, S_z, _transpose(r.terminal_M), r.terminal_z)

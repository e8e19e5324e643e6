"""RoPE tables and the frames of a video over a CP group.

rope_tables(N, D, offset) gives the (N, D) cos and sin tables the layers take.
split_frames / gather_frames move a video between "every rank holds all of it"
and "rank r holds its frames" with balanced_split's ownership (docs/design.md
§1): of F_total frames over P ranks, the first F_total mod P ranks hold one
frame more, and rank r's first global frame is o_r = Σ_{j<r} F_j.
"""
import torch

from .comm import Communicator


def rope_tables(N, D, offset=0, base=10000.0, dtype=torch.float32, device=None):
    """cos, sin (N, D) for the tokens offset .. offset+N−1 (a CP rank: offset = o_r·S).

    Sign convention: the layers rotate each channel pair (x[2i], x[2i+1]) of q
    and k by the angle θ = (n + offset)·base^(−2i/D) of token n as
        rot[2i]   = x[2i]·cos θ − x[2i+1]·sin θ
        rot[2i+1] = x[2i+1]·cos θ + x[2i]·sin θ,
    written as one formula per channel d: rot[d] = x[d]·cos[d] + x[d^1]·sin[d].
    So cos[n, 2i] = cos[n, 2i+1] = cos θ, and the sign lives in the sin table:
    sin[n, 2i] = −sin θ, sin[n, 2i+1] = +sin θ. Tables of another convention
    (sin without the sign) must be converted: sin[:, 0::2] *= −1.
    Computed in float64, returned in dtype (float32 for the layers; float64
    for float64 inputs)."""
    if D % 2:
        raise ValueError("gdncp.rope_tables: D must be even (RoPE rotates channel pairs), got %d" % D)
    n = torch.arange(N, dtype=torch.float64)[:, None] + offset
    i = torch.arange(D // 2, dtype=torch.float64)[None, :]
    theta = n * base ** (-2.0 * i / D)
    cos = torch.repeat_interleave(torch.cos(theta), 2, dim=1)
    sin = torch.stack([-torch.sin(theta), torch.sin(theta)], dim=-1).reshape(N, D)
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)


def balanced_split(frames, size, rank):
    """(F_r, o_r): the frames rank holds of `frames` over `size` ranks, and its first global frame."""
    if frames < 0 or size < 1 or not 0 <= rank < size:
        raise ValueError("gdncp.balanced_split: need frames >= 0, size >= 1, 0 <= rank < size; got %d, %d, %d"
                         % (frames, size, rank))
    base, extra = divmod(frames, size)
    return base + (1 if rank < extra else 0), rank * base + min(rank, extra)


def _rank_size(group):
    """(rank, size) of a gdncp.Communicator or a torch.distributed group (None = the default group)."""
    if isinstance(group, Communicator):
        return group.rank, group.size
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def _per_frame(x, frames, dim, fn):
    n = x.shape[dim]
    if frames < 1 or n % frames:
        raise ValueError("%s: dim %d has %d entries, not a multiple of frames=%d" % (fn, dim, n, frames))
    return n // frames


def split_frames(x, group, frames, dim=1):
    """This rank's part of x, which holds the whole video: along dim (frames
    entries, or frames·S tokens), the entries of frames [o_r, o_r + F_r)
    (a contiguous copy; a view's gradient flows back to x)."""
    rank, size = _rank_size(group)
    per = _per_frame(x, frames, dim, "gdncp.split_frames")
    F_r, o_r = balanced_split(frames, size, rank)
    return x.narrow(dim, o_r * per, F_r * per).contiguous()


def _all_reduce_sum_(t, group):
    if isinstance(group, Communicator):
        return group.all_reduce_sum_(t)
    import torch.distributed as dist

    dist.all_reduce(t, group=group)
    return t


def gather_frames(x, group, frames, dim=1):
    """The whole video on every rank from every rank's part (the inverse of
    split_frames): x is this rank's part, F_r frames along dim. Collective
    over group (a gdncp.Communicator or a torch.distributed group), exact:
    each rank writes its slice into zeros and one all-reduce sums them (two:
    the first agrees on the entries per frame, which a rank without frames
    cannot know). Not differentiable (the result is detached)."""
    rank, size = _rank_size(group)
    F_r, o_r = balanced_split(frames, size, rank)
    n = x.shape[dim]
    if (F_r == 0 and n != 0) or (F_r and n % F_r):
        raise ValueError("gdncp.gather_frames: rank %d holds %d of %d frames but x has %d entries along dim %d"
                         % (rank, F_r, frames, n, dim))
    per_t = torch.tensor([float(n // F_r if F_r else 0)], dtype=torch.float64, device=x.device)
    holders = sum(1 for r in range(size) if balanced_split(frames, size, r)[0])
    per = int(_all_reduce_sum_(per_t, group).item()) // max(holders, 1)
    if F_r and per != n // F_r:
        raise ValueError("gdncp.gather_frames: the ranks' parts differ in entries per frame")
    shape = list(x.shape)
    shape[dim] = frames * per
    full = torch.zeros(shape, dtype=x.dtype, device=x.device)
    full.narrow(dim, o_r * per, F_r * per).copy_(x.detach())
    return _all_reduce_sum_(full, group)

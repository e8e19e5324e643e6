"""Trains two BiGDN layers, context-parallel over the GPUs of a torchrun job:

    torchrun --nproc_per_node=2 python/examples/train_torchrun.py      # PYTHONPATH=<build>/python

Every rank holds the same parameters and a consecutive block of the frames
(gdncp's CP layer exchanges the scan's O(D²) state, not tokens); the
parameter gradients are partial per rank and summed with torch.distributed.
With one process (plain python3, or --nproc_per_node=1) it trains on one GPU.
Without a GPU, --device cpu trains on CPU ranks under mpirun instead
(MPI_COMM_WORLD is the CP group): mpirun -np 2 python3 train_torchrun.py --device cpu.

--dump DIR writes, at step 0, layer 0's inputs, output gradient, output and
input gradients per rank (DIR/rank<r>), for the comparison with the C++ entry
(python/tests/test_python_torchrun.py runs tests/door_reference on them).
"""
import argparse
import math
import os

import torch
import torch.distributed as dist

import gdncp


def rope_tables(positions, D, device):
    i = torch.arange(D // 2, dtype=torch.float64)
    theta = positions.double()[:, None] * 10000.0 ** (-2.0 * i / D)[None, :]
    cos = torch.repeat_interleave(torch.cos(theta), 2, dim=1)
    sin = torch.stack([-torch.sin(theta), torch.sin(theta)], dim=-1).reshape(len(positions), D)
    return cos.float().to(device), sin.float().to(device)


class Block(torch.nn.Module):
    def __init__(self, dim, heads, head_dim, comm):
        super().__init__()
        self.H, self.D = heads, head_dim
        C = heads * head_dim
        self.qkv = torch.nn.Linear(dim, 3 * C)
        self.gate = torch.nn.Linear(dim, heads)
        self.decay = torch.nn.Linear(dim, heads)
        self.layer = gdncp.BiGDN(heads, head_dim, comm=comm)
        self.proj = torch.nn.Linear(C, dim)
        self.seen = None  # --dump: the layer's inputs of the last call

    def forward(self, x, cos, sin, F, S):
        B, N, _ = x.shape
        H, D = self.H, self.D
        qkv = self.qkv(x).view(B, N, 3, H, D).to(torch.bfloat16)
        beta = torch.sigmoid(self.gate(x)).view(B, F, S, H).permute(0, 3, 1, 2).contiguous().to(torch.bfloat16)
        decay = torch.sigmoid(self.decay(x.view(B, F, S, -1).mean(2)) + 2.0).permute(0, 2, 1).contiguous()
        decay = decay.to(torch.bfloat16)
        for t in (qkv, beta, decay):
            t.retain_grad()
        out = self.layer(qkv, beta, decay, cos, sin, F, S)
        self.seen = dict(qkv=qkv, beta=beta, decay=decay, out=out, rope_cos=cos, rope_sin=sin)
        out.register_hook(lambda g: self.seen.__setitem__("grad_out", g.detach().clone()))
        return x + self.proj(out.float().reshape(B, N, H * D))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--frames", type=int, default=8, help="frames of the whole sequence (split over the ranks)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per frame")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=112)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--dump", default=None)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = p.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    if a.device == "cpu":  # CPU ranks under mpirun: the gradients are summed through gdncp's MPI communicator
        comm = gdncp.Communicator.mpi_world()
        P, r = comm.size, comm.rank
        device = torch.device("cpu")
        distributed = False
    elif distributed:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl")
        comm = gdncp.from_process_group()
        P, r = dist.get_world_size(), dist.get_rank()
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(0)
        comm = gdncp.Communicator.nccl(gdncp.unique_id(), 0, 1, 0)
        P, r = 1, 0
    base, extra = divmod(a.frames, P)
    F = base + (1 if r < extra else 0)
    off = r * base + min(r, extra)
    S = a.tokens

    torch.manual_seed(0)  # the same parameters on every rank
    model = torch.nn.ModuleList([Block(a.dim, a.heads, a.head_dim, comm) for _ in range(2)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)  # the same global data on every rank; each takes its frames
    x_all = torch.randn(a.batch, a.frames * S, a.dim, generator=g)
    x = x_all[:, off * S:(off + F) * S].contiguous().to(device)
    target = torch.roll(x_all, shifts=S, dims=1)[:, off * S:(off + F) * S].contiguous().to(device)
    cos, sin = rope_tables(torch.arange(off * S, (off + F) * S), a.head_dim, device)

    for step in range(a.steps):
        h = x
        for blk in model:
            h = blk(h, cos, sin, F, S)
        loss = torch.nn.functional.mse_loss(h, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.dump and step == 0:
            dump(os.path.join(a.dump, "rank%d" % r), model[0], F, S, a)
        if distributed:  # partial per rank: sum the gradients, average the loss
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
            dist.all_reduce(loss)
            loss = loss / P
        elif P > 1:
            for prm in model.parameters():
                comm.all_reduce_sum_(prm.grad)
            loss = comm.all_reduce_sum_(loss.detach().clone().reshape(1))[0] / P
        opt.step()
        if r == 0 and (step % 5 == 0 or step == a.steps - 1):
            print("step %3d  loss %.6f" % (step, loss.item()), flush=True)
    comm.close()
    if distributed:
        dist.destroy_process_group()


def dump(dir, blk, F, S, a):
    """Layer 0's call of this step, for tests/door_reference (python/tests/door_files.py's layout)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import door_files

    s = blk.seen
    L = blk.layer
    x = dict(qkv=s["qkv"], beta=s["beta"], decay=s["decay"], q_norm_w=L.q_norm_w, k_norm_w=L.k_norm_w,
             rope_cos=s["rope_cos"], rope_sin=s["rope_sin"], grad_out=s["grad_out"])
    door_files.write_call(dir, x, F, S, 1.0 / math.sqrt(a.head_dim * S))
    torch.save({"out": s["out"].detach().cpu(), "qkv": s["qkv"].grad.cpu(), "beta": s["beta"].grad.cpu(),
                "decay": s["decay"].grad.cpu(), "q_norm_w": L.q_norm_w.grad.cpu(),
                "k_norm_w": L.k_norm_w.grad.cpu()}, os.path.join(dir, "door.pt"))


if __name__ == "__main__":
    main()

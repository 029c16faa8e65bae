"""A small mixture of experts made from a dense model, and expert parallelism over it.

`moefy` cuts each layer's SwiGLU MLP into E experts along the intermediate dimension (expert e
owns neurons [e I/E, (e+1) I/E)): since down(silu(gate x) * up x) is a sum over neurons, it is
the sum of the experts' outputs, so with every expert active (top_k = E) the MoE computes the
dense MLP (up to the order of the additions). A router picks top_k experts per token; its score
for expert e is the mean pre-activation of e's gate neurons (untrained), and a chosen expert's
output is added with weight 1, so the dense model is the top_k = E end of a quality/compute dial.
That dial is steep: a SiLU MLP uses nearly all its neurons for every token, so dropping experts
costs a lot even with an oracle router (chapter 07 measures it). MoEfication (Zhang et al. 2022)
works on ReLU models, whose activations are sparse; real MoEs (Mixtral, DeepSeek) are trained as
MoEs. This one is for studying routing and expert placement, with the dense model as its oracle.

Expert parallelism (GShard, Lepikhin et al. 2020): the experts are spread over N ranks. Each rank
routes its share of the tokens, sends each (token, expert) pair to the rank that owns the expert
(all-to-all), runs its experts on what arrives, sends the results back (all-to-all), adds them
up, and the ranks exchange their token shares so that all hold the whole batch (all-gather).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.parallel.comm import Comm


class MoEMLP(nn.Module):
    def __init__(self, mlp, num_experts: int, top_k: int):
        super().__init__()
        gate, up = mlp.gate_up_proj.weight.data.chunk(2)
        inter, hidden = gate.shape
        if inter % num_experts:
            raise ValueError(f"moe_config['num_experts']={num_experts} is invalid for this "
                             f"model: intermediate_size={inter} must split evenly")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moe_config['top_k']={top_k} is invalid: it must be <= "
                             f"num_experts={num_experts}")
        n = inter // num_experts
        self.num_experts, self.top_k = num_experts, top_k
        self.w_gate_up = nn.Parameter(torch.cat([gate.view(num_experts, n, hidden),
                                                 up.view(num_experts, n, hidden)], dim=1),
                                      requires_grad=False)                    # (E, 2n, H)
        down = mlp.down_proj.weight.data                                      # (H, I)
        self.w_down = nn.Parameter(down.view(hidden, num_experts, n).permute(1, 0, 2).contiguous(),
                                   requires_grad=False)                       # (E, H, n)
        self.router = nn.Parameter(gate.view(num_experts, n, hidden).float().mean(1).to(
            gate.dtype), requires_grad=False)                                 # (E, H)
        self.tokens_per_expert = torch.zeros(num_experts, dtype=torch.long)   # since creation
        # "router": the gate-mean scores above. "oracle" (for measuring, not serving): run every
        # expert and keep the k whose outputs are largest, the best any router could pick by size.
        self.routing = "router"

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """(T, top_k) expert ids per token, in ascending order (the order their outputs are
        added, the same in every placement)."""
        if self.routing == "oracle":
            scores = torch.stack([self.expert(e, x).norm(dim=-1)
                                  for e in range(self.num_experts)], dim=-1)
        else:
            scores = F.linear(x, self.router)
        chosen = scores.topk(self.top_k, dim=-1).indices.sort(dim=-1).values
        self.tokens_per_expert += torch.bincount(chosen.flatten().cpu(),
                                                 minlength=self.num_experts)
        return chosen

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w_gate_up[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_down[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.route(x)
        out = torch.zeros_like(x)
        for slot in range(self.top_k):           # slot j holds each token's j-th smallest expert id
            for e in chosen[:, slot].unique().tolist():
                rows = (chosen[:, slot] == e).nonzero().flatten()
                out[rows] += self.expert(e, x[rows])
        return out


class ExpertParallelMoE(nn.Module):
    """The same MoE with experts [rank E/N, (rank + 1) E/N) on this rank, tokens exchanged by
    all-to-all. Gives the single-process MoEMLP's result."""

    def __init__(self, moe: MoEMLP, comm: Comm):
        super().__init__()
        size, rank, E = comm.size, comm.rank, moe.num_experts
        if E % size:
            raise ValueError(f"expert_parallel_size={size} is invalid: moe num_experts={E} must "
                             "split evenly over the ranks")
        self.per_rank = E // size
        own = slice(rank * self.per_rank, (rank + 1) * self.per_rank)
        self.w_gate_up = nn.Parameter(moe.w_gate_up.data[own].clone(), requires_grad=False)
        self.w_down = nn.Parameter(moe.w_down.data[own].clone(), requires_grad=False)
        self.router, self.top_k, self.num_experts = moe.router, moe.top_k, E
        self.comm, self.first = comm, rank * self.per_rank
        self.tokens_per_expert = torch.zeros(E, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm, T = self.comm, x.shape[0]
        share = -(-T // comm.size)
        lo, hi = min(comm.rank * share, T), min((comm.rank + 1) * share, T)
        mine = x[lo:hi]
        chosen = F.linear(mine, self.router).topk(self.top_k, dim=-1).indices.sort(dim=-1).values
        # (token, slot, expert) triples, grouped by the rank that owns the expert.
        token = torch.arange(hi - lo, device=x.device).repeat_interleave(self.top_k)
        slot = torch.arange(self.top_k, device=x.device).repeat(hi - lo)
        expert = chosen.flatten()
        order = torch.argsort(expert // self.per_rank, stable=True)
        token, slot, expert = token[order], slot[order], expert[order]
        send_counts = torch.bincount(expert // self.per_rank, minlength=comm.size)
        recv_counts = comm.all_to_all(send_counts, [1] * comm.size, [1] * comm.size)
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        rows_in = comm.all_to_all(mine[token], sends, recvs)
        experts_in = comm.all_to_all(expert, sends, recvs)
        rows_out = torch.empty_like(rows_in)
        for e in experts_in.unique().tolist():
            at = (experts_in == e).nonzero().flatten()
            local = e - self.first
            gate, up = F.linear(rows_in[at], self.w_gate_up[local]).chunk(2, dim=-1)
            rows_out[at] = F.linear(F.silu(gate) * up, self.w_down[local])
        back = comm.all_to_all(rows_out, recvs, sends)
        out = torch.zeros_like(mine)
        for s in range(self.top_k):              # add in ascending expert order, as MoEMLP does
            at = (slot == s).nonzero().flatten()
            out[token[at]] += back[at]
        padded = torch.zeros(share, x.shape[1], dtype=x.dtype, device=x.device)
        padded[:hi - lo] = out
        return comm.all_gather_cat(padded, dim=0)[:T]


def moefy(model, num_experts: int, top_k: int) -> None:
    """Replace every layer's dense MLP by its MoEMLP with `num_experts` experts, in place."""
    for layer in model.layers:
        layer.mlp = MoEMLP(layer.mlp, num_experts, top_k)


def place_experts(model, comm: Comm) -> None:
    """Keep only this rank's experts in every MoE layer (the rest of the model is replicated)."""
    for layer in model.layers:
        layer.mlp = ExpertParallelMoE(layer.mlp, comm)

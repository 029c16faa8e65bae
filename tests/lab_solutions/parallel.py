"""Reference solutions and typical wrong answers for lab 07 (tests only: never in a lab notebook).

SOLUTIONS: exercise id -> the source of a correct exercise cell.
WRONG: (exercise id, source of a wrong cell, a phrase the checker's message or hint must contain).
"""

SOLUTIONS = {
    "parallel.shard_qkv": '''
import torch

def shard_qkv(qkv_weight, num_heads, num_kv_heads, head_dim, rank, size):
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv_weight.split([q_size, kv_size, kv_size])
    h, g = num_heads // size, num_kv_heads // size
    return torch.cat([q[rank * h * head_dim:(rank + 1) * h * head_dim],
                      k[rank * g * head_dim:(rank + 1) * g * head_dim],
                      v[rank * g * head_dim:(rank + 1) * g * head_dim]])
''',
    "parallel.tp_mlp": '''
import torch.nn.functional as F

def tp_mlp_partials(x, gate_up_weight, down_weight, size):
    gate, up = gate_up_weight.chunk(2)
    n = gate.shape[0] // size
    partials = []
    for r in range(size):
        rows = slice(r * n, (r + 1) * n)
        h = F.silu(x @ gate[rows].T) * (x @ up[rows].T)       # this rank's neurons only
        partials.append(h @ down_weight[:, rows].T)           # its columns of down: a partial sum
    return partials
''',
    "parallel.moe_forward": '''
import torch

def moe_forward(x, router, experts, top_k):
    scores = x @ router.T
    chosen = scores.topk(top_k, dim=-1).indices            # (tokens, top_k)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        rows = (chosen == e).any(dim=-1).nonzero().flatten()
        if len(rows):
            out[rows] += expert(x[rows])
    return out
''',
}

WRONG = [
    ("parallel.shard_qkv", '''
def shard_qkv(qkv_weight, num_heads, num_kv_heads, head_dim, rank, size):
    return qkv_weight.chunk(size)[rank]
''', "Split those three first"),
    ("parallel.shard_qkv", '''
import torch

def shard_qkv(qkv_weight, num_heads, num_kv_heads, head_dim, rank, size):
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv_weight.split([q_size, kv_size, kv_size])
    h = num_heads // size
    return torch.cat([q[rank * h * head_dim:(rank + 1) * h * head_dim], k, v])   # every KV head
''', "only its own KV heads"),
    ("parallel.shard_qkv", '''
import torch

def shard_qkv(qkv_weight, num_heads, num_kv_heads, head_dim, rank, size):
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv_weight.split([q_size, kv_size, kv_size])
    h, g = num_heads // size, num_kv_heads // size
    lo = rank * h * head_dim                               # the query offset, used for K and V too
    return torch.cat([q[lo:lo + h * head_dim], k[lo:lo + g * head_dim], v[lo:lo + g * head_dim]])
''', "not at the query offset"),
    ("parallel.shard_qkv", '''
def shard_qkv(qkv_weight, num_heads, num_kv_heads, head_dim, rank, size):
    cols = qkv_weight.shape[1] // size
    return qkv_weight[:, rank * cols:(rank + 1) * cols]
''', "(out_features, in_features)"),
    ("parallel.shard_qkv", '''
import torch

def shard_qkv(qkv_weight, num_heads, num_kv_heads, head_dim, rank, size):
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv_weight.split([q_size, kv_size, kv_size])
    pick = lambda m, heads: torch.cat([m[j * head_dim:(j + 1) * head_dim]
                                       for j in range(rank, heads, size)])   # every size-th head
    return torch.cat([pick(q, num_heads), pick(k, num_kv_heads), pick(v, num_kv_heads)])
''', "consecutive heads"),
    ("parallel.tp_mlp", '''
import torch.nn.functional as F

def tp_mlp_partials(x, gate_up_weight, down_weight, size):
    n = down_weight.shape[1] // size
    partials = []
    for r, part in enumerate(gate_up_weight.chunk(size)):
        gate, up = part.chunk(2)
        partials.append((F.silu(x @ gate.T) * (x @ up.T)) @ down_weight[:, r * n:(r + 1) * n].T)
    return partials
''', "Split gate and up first"),
    ("parallel.tp_mlp", '''
import torch.nn.functional as F

def tp_mlp_partials(x, gate_up_weight, down_weight, size):
    gate, up = gate_up_weight.chunk(2)
    full = (F.silu(x @ gate.T) * (x @ up.T)) @ down_weight.T
    return [full for _ in range(size)]                      # already all-reduced
''', "before the all-reduce"),
    ("parallel.tp_mlp", '''
import torch.nn.functional as F

def tp_mlp_partials(x, gate_up_weight, down_weight, size):
    gate, up = gate_up_weight.chunk(2)
    n = gate.shape[0] // size
    partials = []
    for r in range(size):
        rows = slice(r * n, (r + 1) * n)
        h = F.silu(x @ gate[rows].T) * (x @ up[rows].T)
        partials.append(h @ down_weight[rows].T)            # rows of down instead of columns
    return partials
''', "(out_features, in_features)"),
    ("parallel.tp_mlp", '''
import torch.nn.functional as F

def tp_mlp_partials(x, gate_up_weight, down_weight, size):
    gate, up = gate_up_weight.chunk(2)
    partials = []
    for r in range(size):
        rows = slice(r, None, size)                         # every size-th neuron
        h = F.silu(x @ gate[rows].T) * (x @ up[rows].T)
        partials.append(h @ down_weight[:, rows].T)
    return partials
''', "contiguous neurons"),
    ("parallel.moe_forward", '''
import torch

def moe_forward(x, router, experts, top_k):
    top = (x @ router.T).topk(top_k, dim=-1)
    weights = top.values.softmax(dim=-1)                   # Mixtral's renormalised weights
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            out[t] += weights[t, j] * experts[int(top.indices[t, j])](x[t:t + 1])[0]
    return out
''', "weight 1"),
    ("parallel.moe_forward", '''
import torch

def moe_forward(x, router, experts, top_k):
    chosen = (x @ router.T).topk(top_k, dim=-1).indices
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        mask = (chosen == e).any(dim=-1, keepdim=True)
        out += mask * expert(x)                            # every expert on every token
    return out
''', "ran every expert on every token"),
    ("parallel.moe_forward", '''
import torch

def moe_forward(x, router, experts, top_k):
    chosen = (x @ router.T).argsort(dim=-1)[:, :top_k]     # ascending: the lowest scores
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        rows = (chosen == e).any(dim=-1).nonzero().flatten()
        if len(rows):
            out[rows] += expert(x[rows])
    return out
''', "lowest scores"),
    ("parallel.moe_forward", '''
def moe_forward(x, router, experts, top_k):
    return sum(expert(x) for expert in experts)            # the dense MLP
''', "every expert's output"),
]

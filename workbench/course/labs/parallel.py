"""Lab 07 (parallelism): a tensor-parallel rank's slice of the attention and the MLP, and the
routing of a mixture-of-experts layer, every rank simulated in one process.

The references are the engine's own: `shard_model` (`workbench/parallel/tensor.py`) applied to a
tiny random Llama for each rank in turn (its `RowParallelLinear` given a Comm whose all-reduce keeps
the rank's partial sum, so the checker can add the partials itself), and `MoEMLP`
(`workbench/parallel/moe.py`). The models are a few hundred parameters: no download, no process
group, milliseconds per case.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from workbench.models.llama import MLP, LlamaArgs, LlamaModel
from workbench.parallel.comm import Comm
from workbench.parallel.moe import MoEMLP
from workbench.parallel.tensor import shard_model
from workbench.course.labs.core import Mismatch, call, exercise

CHAPTER = "07_parallelism"


# ---------------------------------------------------------------------------------- helpers
def _args(heads: int, kv_heads: int, head_dim: int, hidden: int, inter: int) -> LlamaArgs:
    return LlamaArgs(vocab_size=8, hidden_size=hidden, intermediate_size=inter,
                     num_hidden_layers=1, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
                     rope_theta=10000.0, max_position_embeddings=8, tie_word_embeddings=True)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Seeded weights from a private generator (distinct values, so every row is recognisable)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _tiny_model(heads: int, kv_heads: int, head_dim: int, hidden: int, inter: int,
                seed: int) -> LlamaModel:
    # nn.Linear's own init draws from the global generator: fork it, so checking an answer does
    # not change the learner's torch.manual_seed stream.
    with torch.random.fork_rng(devices=[]):
        model = LlamaModel(_args(heads, kv_heads, head_dim, hidden, inter), max_positions=8)
    _randomize(model, seed)
    return model


def _shard(model: LlamaModel, rank: int, size: int) -> LlamaModel:
    """The engine's shard of `model` for one rank. Its row-parallel layers return the rank's
    partial output: in one process there is nobody to all-reduce with, so the checker adds the
    partials of all ranks itself (that sum is what the all-reduce computes)."""
    shard = copy.deepcopy(model)
    comm = Comm.offline(rank, size)
    comm.all_reduce = lambda t: t
    shard_model(shard, rank, size, comm)
    return shard


def _ranges(rows: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> '0-2, 5-6' (row lists stay readable in a message)."""
    out, start = [], None
    for i, r in enumerate(rows):
        if start is None:
            start = r
        if i + 1 == len(rows) or rows[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out) or "none"


def _rows_of(got: torch.Tensor, w: torch.Tensor) -> list[int] | None:
    """Which row of w each row of got is (the weights are random, so rows are unique); None if
    some row of got is not a row of w."""
    if got.dim() != 2 or got.shape[1] != w.shape[1]:
        return None
    eq = (got.to(w.dtype)[:, None, :] == w[None, :, :]).all(-1)       # (rows of got, rows of w)
    if not bool(eq.any(1).all()):
        return None
    return eq.int().argmax(1).tolist()


def _tensor(got, what: str, shape: tuple, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A clear message for an answer that is not a tensor of the right shape and dtype."""
    if not isinstance(got, torch.Tensor):
        raise Mismatch(f"{what}: expected a torch.Tensor of shape {shape}, got "
                       f"{type(got).__name__}" + (" " + " ".join(repr(got).split())[:80]
                                                     if got is not None else ""),
                       "return a tensor (slicing and torch.cat give tensors)." if got is not None
                       else "your function returned None: did you forget `return`?")
    if got.dtype != dtype:
        raise Mismatch(f"{what}: expected dtype {dtype}, got {got.dtype}",
                       "keep the weights' dtype: slicing and matmuls of float32 tensors stay "
                       "float32.")
    if tuple(got.shape) != tuple(shape):
        raise Mismatch(f"{what}: expected shape {tuple(shape)}, got {tuple(got.shape)}")
    return got


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _close(a, b, atol: float = 1e-4) -> bool:
    return (isinstance(a, torch.Tensor) and tuple(a.shape) == tuple(b.shape)
            and _max_diff(a, b) <= atol)


_LAYOUT_HINT = ("nn.Linear keeps its weight as (out_features, in_features) and computes "
                "x @ weight.T. A column-parallel layer keeps some *rows* (output features: heads, "
                "neurons); a row-parallel layer keeps the matching *columns* (input features).")


# ---------------------------------------------------------------------------------- 1. QKV
@exercise("parallel.shard_qkv", CHAPTER, "shard_qkv",
          "a tensor-parallel rank's rows of the fused QKV weight: whole heads",
          hint="split the fused weight into its query rows (num_heads * head_dim), key rows and "
               "value rows (num_kv_heads * head_dim each); rank r keeps query heads "
               "r*h ... (r+1)*h - 1 (h = num_heads // size) and KV heads r*g ... (r+1)*g - 1 "
               "(g = num_kv_heads // size), each head a block of head_dim rows; concatenate "
               "queries, keys, values.")
def check_shard_qkv(shard_qkv) -> None:
    # (num_heads, num_kv_heads, head_dim, hidden, size): grouped-query attention, plain multi-head,
    # one KV head per rank, one rank (nothing to cut), and SmolLM2's own 9 query / 3 KV heads.
    cases = [(4, 2, 2, 8, 2), (4, 4, 2, 6, 4), (6, 3, 2, 8, 3), (4, 1, 3, 8, 1), (8, 4, 2, 8, 4),
             (9, 3, 2, 8, 3), (8, 2, 3, 8, 2), (6, 6, 2, 8, 2)]
    for i, (heads, kv, d, hidden, size) in enumerate(cases):
        model = _tiny_model(heads, kv, d, hidden, 2 * size, seed=100 + i)
        w = model.layers[0].self_attn.qkv_proj.weight.data
        q_size, kv_size = heads * d, kv * d
        h, g = heads // size, kv // size
        for rank in range(size):
            expected = _shard(model, rank, size).layers[0].self_attn.qkv_proj.weight.data
            what = (f"shard_qkv(qkv_weight of shape {tuple(w.shape)}, num_heads={heads}, "
                    f"num_kv_heads={kv}, head_dim={d}, rank={rank}, size={size})")
            got = call(shard_qkv, what, w.clone(), heads, kv, d, rank, size)
            if size > 1 and isinstance(got, torch.Tensor) and got.dim() == 2 \
                    and got.shape[0] == w.shape[0] and got.shape[1] < hidden:
                raise Mismatch(f"{what}: expected shape {tuple(expected.shape)}, got "
                               f"{tuple(got.shape)}: you cut the columns", _LAYOUT_HINT)
            if isinstance(got, torch.Tensor) and got.dim() == 2 and \
                    tuple(got.shape) != tuple(expected.shape) and got.dtype == w.dtype:
                rows = _rows_of(got, w)
                exp_rows = _rows_of(expected, w)
                hint = ""
                if rows == exp_rows[:h * d]:
                    hint = ("only the query rows came back: the key and value slices are missing "
                            "or empty. After its queries, the rank needs its KV heads' key rows, "
                            "then their value rows; its KV heads are r*g ... (r+1)*g - 1 "
                            "(g = num_kv_heads // size), so slice k and v at r*g*head_dim, not at "
                            "the query offset r*h*head_dim.")
                elif rows is not None and rows[:h * d] == exp_rows[:h * d] and \
                        len(rows) == h * d + 2 * kv_size:
                    hint = ("each rank keeps only its own KV heads (num_kv_heads // size of them),"
                            " not all of them: the KV cache is split across the ranks as well.")
                raise Mismatch(f"{what}: expected shape {tuple(expected.shape)} ({h} query and "
                               f"{g} KV heads of {d} rows each, for Q, K and V), got "
                               f"{tuple(got.shape)}", hint)
            got = _tensor(got, what, tuple(expected.shape), w.dtype)
            if torch.equal(got, expected):
                continue
            rows, exp_rows = _rows_of(got, w), _rows_of(expected, w)
            if rows is None:
                diff = _max_diff(got, expected)
                raise Mismatch(f"{what}: your rows are not rows of the weight (largest "
                               f"difference from the expected slice {diff:.3g})",
                               "a shard is a copy of some rows of the weight, unchanged: select "
                               "rows, do not compute anything.")
            per = w.shape[0] // size
            hint = ""
            if rows == list(range(rank * per, (rank + 1) * per)):
                hint = ("equal chunks of the fused matrix mix queries, keys and values: qkv_proj "
                        "stacks all query rows (num_heads * head_dim), then all key rows, then "
                        "all value rows (num_kv_heads * head_dim each). Split those three first, "
                        "then take this rank's heads from each.")
            elif sorted(rows) == sorted(exp_rows):
                hint = ("the right rows in the wrong order: queries first, then keys, then "
                        "values, each in head order (the attention splits them at q_size and "
                        "q_size + kv_size).")
            elif rows[:h * d] == exp_rows[:h * d] and rows[h * d:] != exp_rows[h * d:]:
                hint = (f"the queries are right, the keys or values are not: rank r's KV heads "
                        f"are r*g ... (r+1)*g - 1 with g = num_kv_heads // size, so its key rows "
                        f"start at q_size + r*g*head_dim (here {q_size + rank * g * d}), not at "
                        f"the query offset.")
            elif size > 1 and rows[:d] == list(range(rank * d, (rank + 1) * d)) and h > 1:
                hint = ("take consecutive heads, not every size-th one: query head j reads KV "
                        "head j // (num_heads // num_kv_heads), so rank r's consecutive query "
                        "heads r*h ... (r+1)*h - 1 read exactly its consecutive KV heads.")
            raise Mismatch(f"{what}:\n  expected rows {_ranges(exp_rows)} of the fused weight "
                           f"(queries {_ranges(exp_rows[:h * d])}, keys "
                           f"{_ranges(exp_rows[h * d:h * d + g * d])}, values "
                           f"{_ranges(exp_rows[h * d + g * d:])})\n  got rows      {_ranges(rows)}",
                           hint)


# ---------------------------------------------------------------------------------- 2. MLP
def _naive_chunk_partials(x, gate_up, down, size):
    """The typical mistake: cut the fused gate_up weight into equal chunks."""
    out = []
    n = down.shape[1] // size
    for r, part in enumerate(gate_up.chunk(size)):
        gate, up = part.chunk(2)
        out.append(F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up),
                            down[:, r * n:(r + 1) * n]))
    return out


@exercise("parallel.tp_mlp", CHAPTER, "tp_mlp_partials",
          "each rank's partial output of a tensor-parallel SwiGLU MLP (their sum is the MLP)",
          hint="gate, up = gate_up_weight.chunk(2); with n = intermediate // size, rank r keeps "
               "rows r*n ... (r+1)*n - 1 of gate and of up (column-parallel) and the same "
               "columns of down_weight (row-parallel); its partial output is "
               "(silu(x @ gate_r.T) * (x @ up_r.T)) @ down_r.T.")
def check_tp_mlp(tp_mlp_partials) -> None:
    # (hidden, intermediate, size, tokens): two, three, four and eight ranks, one rank, one token.
    cases = [(8, 8, 2, 3), (8, 12, 3, 1), (6, 16, 4, 5), (8, 8, 1, 2), (4, 8, 8, 4), (8, 24, 2, 6),
             (8, 18, 3, 2)]
    for i, (hidden, inter, size, tokens) in enumerate(cases):
        model = _tiny_model(size, size, 2, hidden, inter, seed=200 + i)
        mlp = model.layers[0].mlp
        gate_up, down = mlp.gate_up_proj.weight.data, mlp.down_proj.weight.data
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(300 + i))
        with torch.no_grad():
            full = mlp(x)
            expected = [_shard(model, r, size).layers[0].mlp(x) for r in range(size)]
        what = (f"tp_mlp_partials(x of shape {tuple(x.shape)}, gate_up_weight of shape "
                f"{tuple(gate_up.shape)}, down_weight of shape {tuple(down.shape)}, size={size})")
        try:
            got = call(tp_mlp_partials, what, x.clone(), gate_up.clone(), down.clone(), size)
        except Mismatch as m:
            if isinstance(m.__cause__, RuntimeError) and any(
                    s in str(m.__cause__) for s in ("shape", "size", "dimension")):
                raise Mismatch(m.message,
                               "a matmul's shapes did not fit. " + _LAYOUT_HINT) from None
            raise
        if not isinstance(got, list):
            raise Mismatch(f"{what}: expected a list of {size} tensors (one partial output per "
                           f"rank), got {type(got).__name__}",
                           "build a Python list: partials = []; partials.append(...) per rank."
                           if got is not None else
                           "your function returned None: did you forget `return`?")
        if len(got) != size:
            raise Mismatch(f"{what}: expected {size} partial outputs (one per rank), got "
                           f"{len(got)}")
        for r, part in enumerate(got):
            _tensor(part, f"{what}: rank {r}'s partial output", tuple(full.shape))
        if all(_close(g, e) for g, e in zip(got, expected)):
            continue
        r = next(r for r, (g, e) in enumerate(zip(got, expected)) if not _close(g, e))
        message = (f"{what}: rank {r}'s partial output: largest difference from the reference is "
                   f"{_max_diff(got[r], expected[r]):.3g} (allowed 0.0001)")
        hint = ""
        total = sum(got)
        if size > 1 and all(_close(g, full) for g in got):
            hint = ("every rank returned the whole MLP output: return each rank's partial sum, "
                    "before the all-reduce. Adding up the list is the all-reduce.")
        elif size > 1 and all(_close(g, full / size) for g in got):
            hint = ("a rank's partial is what its own neurons contribute, not an equal share of "
                    "the output: compute it from its slices of the weights.")
        elif all(_close(g, e) for g, e in zip(got, _naive_chunk_partials(x, gate_up, down, size))):
            hint = ("gate_up_proj stacks all gate rows, then all up rows: chunking it into size "
                    "pieces gives rank 0 only gate rows. Split gate and up first "
                    "(gate_up_weight.chunk(2)), then take rank r's rows of each.")
        elif _close(total, full):
            if all(any(_close(g, e) for e in expected) for g in got):
                hint = ("each partial matches some rank's, but not in order: the list's r-th "
                        "entry is rank r's partial.")
            else:
                hint = ("your partials add up to the MLP's output, but the ranks must hold "
                        "contiguous neurons: rank r owns neurons r*n ... (r+1)*n - 1, as the "
                        "engine's shard does.")
        raise Mismatch(message, hint)


# ---------------------------------------------------------------------------------- 3. MoE
class _CountedExpert:
    """An expert the learner may call; it counts the token rows it computes."""

    def __init__(self, moe: MoEMLP, e: int):
        self.moe, self.e, self.rows, self.calls = moe, e, 0, 0

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"an expert takes a tensor of token rows (n, hidden), got "
                            f"{type(rows).__name__}")
        self.calls += 1
        self.rows += rows.shape[0] if rows.dim() > 1 else 1
        return self.moe.expert(self.e, rows)


@exercise("parallel.moe_forward", CHAPTER, "moe_forward",
          "a mixture-of-experts layer: top-k routing, each token through its experts only",
          hint="scores = x @ router.T (tokens x experts); chosen = scores.topk(top_k, dim=-1)"
               ".indices; for each expert e, find the tokens that chose it, run experts[e] on "
               "those rows only, and add the result into their rows of the output (weight 1).")
def check_moe_forward(moe_forward) -> None:
    # (experts, top_k, tokens): Mixtral's top-2, top-1 (Switch), every expert (the dense model),
    # one token, more experts than tokens.
    cases = [(4, 2, 6), (4, 1, 5), (4, 4, 3), (8, 2, 9), (2, 1, 1), (8, 8, 4), (8, 3, 7),
             (8, 2, 3)]
    hidden = 8
    for i, (E, k, tokens) in enumerate(cases):
        mlp = MLP(_args(2, 2, 2, hidden, 4 * E))
        _randomize(mlp, seed=400 + i)
        moe = MoEMLP(mlp, E, k)
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(500 + i))
        with torch.no_grad():
            expected = moe(x)
            outs = torch.stack([moe.expert(e, x) for e in range(E)])          # (E, T, H)
            scores = F.linear(x, moe.router)
        experts = [_CountedExpert(moe, e) for e in range(E)]
        what = (f"moe_forward(x of shape {tuple(x.shape)}, router of shape "
                f"{tuple(moe.router.shape)}, {E} experts, top_k={k})")
        with torch.no_grad():
            got = call(moe_forward, what, x.clone(), moe.router.detach().clone(), experts, k)
        got = _tensor(got, what, tuple(x.shape))
        if not _close(got, expected):
            top = scores.topk(k, dim=-1)
            rows = torch.arange(tokens)[:, None]

            def combine(ids, weights=None):
                picked = outs[ids.T, rows.T]                                   # (k, T, H)
                if weights is not None:
                    picked = picked * weights.T[..., None]
                return picked.sum(0)

            hint = ""
            if k < E and _close(got, outs.sum(0)):
                hint = ("you added every expert's output: each token goes through its top_k "
                        "experts only (with top_k = num_experts that is the dense MLP).")
            elif _close(got, combine(top.indices, top.values.softmax(-1))) or _close(
                    got, combine(top.indices, scores.softmax(-1).gather(1, top.indices))):
                hint = ("this MoE adds each chosen expert's output with weight 1 (Mixtral "
                        "weights them by a softmax of the router scores; this router is "
                        "untrained and its scores are not probabilities).")
            elif k < E and _close(got, combine(scores.topk(k, dim=-1, largest=False).indices)):
                hint = "you picked the lowest scores: the router's choice is the *largest* top_k."
            elif k > 1 and _close(got, combine(top.indices[:, :1])):
                hint = "each token goes to top_k experts, not only its best one."
            raise Mismatch(f"{what}: largest difference from the engine's MoEMLP is "
                           f"{_max_diff(got, expected):.3g} (allowed 0.0001)", hint)
        ran = sum(ex.rows for ex in experts)
        if ran != tokens * k:
            hint = ("you ran every expert on every token and kept only the chosen outputs: the "
                    "output is right, but the point of an MoE is that a token costs top_k "
                    "experts, not all of them. Run experts[e] only on the rows that chose e."
                    if ran >= tokens * E and k < E else
                    "run each expert once per token routed to it: top_k rows per token in all.")
            raise Mismatch(f"{what}: the output is right, but the experts computed {ran} token "
                           f"rows; routing needs {tokens} x {k} = {tokens * k}", hint)

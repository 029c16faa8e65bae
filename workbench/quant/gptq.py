"""GPTQ (Frantar et al., 2022, arXiv 2210.17323): INT4 group-wise weights chosen column by column,
each column's rounding error pushed onto the columns not yet quantized.

For a linear layer with calibration inputs X (tokens x K), the layer's output error for quantized
weights Q is ||(W - Q) X^T||^2 = sum over rows of (w - q) H (w - q)^T / 2 with H = 2 X^T X: every
row of W is an independent least-squares problem sharing one Hessian H (K x K). Quantizing column j
alone and re-solving for the remaining columns (Optimal Brain Surgeon) gives, for each row,

    error of column j      e_j  = (w_j - q_j) / [H^-1]_jj
    update of columns > j  w_k -= e_j * [H^-1]_jk

where H^-1 is the inverse Hessian of the columns still free. GPTQ's two tricks make this cheap:
the rows of the upper Cholesky factor of H^-1 are exactly the [H^-1]_j, j: rows needed at each step
(no re-inversion), and the updates are applied lazily, within a block of 128 columns first and to
the rest of the matrix once per block (a matmul instead of 128 rank-1 updates).

Groups: the (scale, minimum) of a group are taken from the weights as they are when the first
column of the group is reached, i.e. already updated by all earlier columns (the reference
implementation's `static_groups=False`); a ragged last group (576 = 4 x 128 + 64) spans its real
columns only. With `gptq_act_order=False` columns go in their natural order; the default (True) visits them
by decreasing H_jj instead, with every group's parameters fixed beforehand from the unquantized
weights (the reference's act-order with `static_groups=True`; groups stay contiguous, as the
Int4Weight format requires). On SmolLM2 at group 128 that gives a clearly lower mean KL than the
natural order, and both far below RTN's (`python -m workbench.bench quant --methods int4 gptq`
measures RTN and the default against each other).

Calibration runs *layer by layer* (the reference's sequential mode): the calibration windows pass
through decoder layer i once per projection, with layers 0..i-1 already quantized, so each layer is
fitted to the inputs it will see at run time, and within a layer the projections go in execution
order (qkv_proj, o_proj, gate_up_proj, down_proj; the reference's `--true-sequential`), each fitted
after the ones before it were quantized. Each pass stops at the projection it captures, so the
whole calibration costs about three forward passes of the model over the calibration windows,
plus the column loop. The passes use torch's threads; the column loop runs on one (single_thread).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from workbench.attention.metadata import AttentionMetadata
from workbench.attention.torch_backend import TorchAttention
from workbench.models.llama import LlamaModel
from workbench.layers.formats import INT4_MAX, Int4Weight, check_group_size, int4_codes, int4_params, pack_int4
from workbench.layers.linear import Int4Linear

MAX_TOKENS_PER_CHUNK = 4096   # calibration windows run packed, this many tokens at a time
ORDER = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


# ----------------------------------------------------------------------------- layer-wise runner
class _Stop(Exception):
    """Raised by a capture hook to end a layer's forward once its input was seen."""


class LayerwiseRunner:
    """The calibration windows, packed, stepped through the decoder one layer at a time.

    The hidden state between layers is kept, so calibrating layer i costs one pass of layer i, not
    of layers 0..i. It runs the engine's own DecoderLayer with the plain-PyTorch attention, as
    quant.forward does for whole models: calibration sees exactly the forward pass generation uses.
    """

    def __init__(self, model: LlamaModel, windows: list[list[int]],
                 max_tokens: int = MAX_TOKENS_PER_CHUNK):
        if not windows:
            raise ValueError("calibration=[] is invalid: pass at least one token window")
        self.model = model
        self.backend = TorchAttention()
        device = model.embed_tokens.weight.device
        dtype = model.embed_tokens.weight.dtype
        args = model.args
        chunks: list[list[list[int]]] = []
        for w in windows:
            if chunks and sum(map(len, chunks[-1])) + len(w) <= max_tokens:
                chunks[-1].append(list(w))
            else:
                chunks.append([list(w)])
        self.chunks = []   # per chunk: metadata, rotary inputs, scratch KV, hidden state
        for chunk in chunks:
            lens = [len(c) for c in chunk]
            total = sum(lens)
            starts = torch.tensor([0] + lens, device=device).cumsum(0)
            slots = torch.arange(total, device=device)
            table = torch.zeros(len(lens), max(lens), dtype=torch.long, device=device)
            for i, n in enumerate(lens):
                table[i, :n] = slots[starts[i]:starts[i] + n]
            meta = AttentionMetadata(
                query_start_loc=starts, seq_lens=torch.tensor(lens, device=device),
                slot_mapping=slots, slot_table=table, max_query_len=max(lens),
                max_seq_len=max(lens), query_lens=lens, seq_lens_list=lens)
            positions = torch.cat([torch.arange(n, device=device) for n in lens])
            ids = torch.tensor([t for c in chunk for t in c], device=device)
            with torch.inference_mode():
                x = model.embed_tokens(ids)
                rope = self.backend.ops.rope_inputs(model.rotary, positions, dtype)
            shape = (total, args.num_key_value_heads, args.head_dim)
            kv = (torch.empty(shape, dtype=dtype, device=device),
                  torch.empty(shape, dtype=dtype, device=device))
            self.chunks.append(dict(meta=meta, rope=rope, kv=kv, x=x, residual=None))
        self.num_tokens = sum(len(w) for w in windows)

    @torch.inference_mode()
    def run(self, index: int, hooks: dict[nn.Module, Callable[[torch.Tensor], None]] | None = None,
            stop_after: nn.Module | None = None, advance: bool = False) -> None:
        """Run decoder layer `index` over every chunk. `hooks[m](x)` sees the input of module m as
        (tokens, in_features); if `stop_after` is given, the forward stops once that module's
        input was seen. With `advance`, the layer's outputs become the next layer's inputs."""
        layer = self.model.layers[index]
        handles = []
        for module, fn in (hooks or {}).items():
            def pre_hook(mod, inputs, fn=fn):
                x = inputs[0]
                fn(x.reshape(-1, x.shape[-1]))
                if mod is stop_after:
                    raise _Stop
            handles.append(module.register_forward_pre_hook(pre_hook))
        try:
            for c in self.chunks:
                try:
                    out = layer(c["x"], c["residual"], c["rope"], c["kv"], c["meta"], self.backend)
                except _Stop:
                    continue
                if advance:
                    c["x"], c["residual"] = out
        finally:
            for h in handles:
                h.remove()


def get_module(layer: nn.Module, path: str) -> tuple[nn.Module, str, nn.Module]:
    """(owner, attribute, module) for a dotted path such as 'self_attn.qkv_proj'."""
    owner_name, attr = path.split(".")
    owner = getattr(layer, owner_name)
    return owner, attr, getattr(owner, attr)


# ----------------------------------------------------------------------------- one matrix
@contextmanager
def single_thread():
    """One intra-op thread, restored afterwards (a context manager and a decorator), for GPTQ's
    column loop: hundreds of tiny ops, each of whose parallel regions would wait for a second
    thread, which on a busy machine makes the loop many times slower. The forward passes around
    it are GEMMs and keep torch's threads, which speeds the whole-model calibration up (`python
    -m workbench.bench quant --methods gptq awq smoothquant` times the quantized engines' builds,
    each method's calibration included)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def damped_hessian(w: torch.Tensor, hessian: torch.Tensor, percdamp: float
                   ) -> tuple[torch.Tensor, float]:
    """(H + damp I in float64, damp) for the (N, K) fp32 weight w, which is changed in place: the
    columns of inputs that were always zero (H_jj = 0) are zeroed, any weight will do there, and
    their H_jj set to 1. damp = percdamp times the mean of H's diagonal. (GPTQ and SparseGPT.)"""
    k = w.shape[1]
    if hessian.shape != (k, k):
        raise ValueError(f"hessian of shape {tuple(hessian.shape)} does not match a weight with "
                         f"{k} input features: it must be ({k}, {k})")
    h = hessian.detach().double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    damp = percdamp * torch.diagonal(h).mean().item()
    h.diagonal().add_(damp)
    return h, damp


def upper_inverse_factor(h: torch.Tensor) -> torch.Tensor:
    """U, the upper Cholesky factor of H^-1 (H^-1 = U^T U), in fp32: row j holds [H^-1]_j,j: /
    sqrt([H^-1]_jj) taken over the columns >= j, i.e. the inverse Hessian of the columns still
    free when column j is reached. With J the reversal permutation, J H J = L L^T gives
    U = J L^-1 J: one Cholesky and one triangular inverse, no explicit H^-1 (the same U as
    cholesky(cholesky_inverse(cholesky(H)), upper=True), to 1e-16, and several times faster)."""
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    low = torch.linalg.cholesky(h.flip(0, 1))
    return torch.linalg.solve_triangular(low, eye, upper=False).flip(0, 1).float()


@dataclass
class GPTQResult:
    """One matrix quantized by GPTQ, with what happened to each column."""

    weight: Int4Weight
    column_loss: torch.Tensor     # (K,) error added by quantizing column j, after compensation;
    #                               sums to sum over rows of (w - q) (H + damp I) (w - q)^T / 2,
    #                               i.e. ||(W - Q) X^T||^2 / tokens plus the damping term
    column_error: torch.Tensor    # (K,) RMS over rows of (updated w_j - q_j): its rounding error
    column_drift: torch.Tensor    # (K,) RMS over rows of (updated w_j - original w_j): how far
    #                               compensation moved the column before it was quantized
    damp: float                   # what was added to H's diagonal


def gptq_quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, group_size: int = 128,
                         block_size: int = 128, percdamp: float = 0.01,
                         act_order: bool = False) -> GPTQResult:
    """Quantize one (N, K) weight to INT4 group-wise by GPTQ, given the Hessian 2 X^T X / tokens
    (K, K) of its inputs. `act_order`: visit columns by decreasing H_jj (largest inputs first),
    with each group's (scale, minimum) fixed beforehand from the unquantized weights (the
    reference's act-order with static groups: groups stay contiguous in the stored format)."""
    check_group_size(group_size)
    w = weight.detach().float().clone()
    n, k = w.shape
    h, damp = damped_hessian(w, hessian, percdamp)
    original = w.clone()
    groups = -(-k // group_size)
    perm = None
    if act_order:
        scale, minimum = int4_params(w, group_size)      # static: from the original weights
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w, h = w[:, perm], h[perm][:, perm]
        group_of = (perm // group_size).tolist()
        scale_t, minimum_t = scale.t().contiguous(), minimum.t().contiguous()
    else:
        scale = torch.zeros(n, groups)
        minimum = torch.zeros(n, groups)
    hinv = upper_inverse_factor(h)

    # Groups must start at block starts or inside a block, so that a group's parameters are read
    # from fully updated weights: blocks are a multiple of the group size.
    block_size = max(block_size, group_size)
    # The loop works on W transposed, (K, N): a column of W is then a contiguous row, and each
    # compensation a contiguous rank-1 update (several times faster than strided columns).
    wt = w.t().contiguous()
    errors = torch.zeros(k, n)      # e_j of every column and row, for the report
    before = torch.zeros(k, n)      # each column as it was when quantized
    diag = torch.diagonal(hinv).tolist()
    with single_thread():
        for b1 in range(0, k, block_size):
            b2 = min(b1 + block_size, k)
            w1 = wt[b1:b2].clone()
            err1 = errors[b1:b2]
            hinv1 = hinv[b1:b2, b1:b2]
            for i in range(b2 - b1):
                col = b1 + i
                if perm is not None:
                    s, m = scale_t[group_of[col]], minimum_t[group_of[col]]
                elif col % group_size == 0:
                    g = col // group_size
                    span = w1[i:i + group_size]           # current weights of the whole group
                    lo, hi = span.amin(dim=0), span.amax(dim=0)
                    s = ((hi - lo) / INT4_MAX).clamp(min=1e-12)
                    m = lo
                    scale[:, g], minimum[:, g] = s, m
                wc = w1[i]
                before[col] = wc
                q = torch.round((wc - m) / s).clamp_(0, INT4_MAX).mul_(s).add_(m)
                e = (wc - q).div_(diag[col])
                w1[i:].addr_(hinv1[i, i:], e, alpha=-1)   # compensate the block's columns
                err1[i] = e
            wt[b2:].addmm_(hinv[b1:b2, b2:].t(), err1, alpha=-1)   # ... and, lazily, the rest
    errors, before = errors.t(), before.t()
    d = torch.diagonal(hinv)
    if perm is not None:                                  # back to the original column order
        inverse = torch.argsort(perm)
        errors, before, d = errors[:, inverse], before[:, inverse], d[inverse]
    # The same rounding as in the loop, vectorized: the codes of the columns as they were when
    # quantized (int4_codes divides by the scale exactly as the loop does).
    codes = int4_codes(before, scale, minimum, group_size)
    loss = errors.pow(2).sum(0) / 2
    col_err = (errors * d).pow(2).mean(0).sqrt()
    drift = (before - original).pow(2).mean(0).sqrt()
    packed = pack_int4(codes)
    return GPTQResult(Int4Weight(packed, scale, minimum, group_size, k), loss, col_err, drift,
                      damp)


def hessian_accumulator(k: int) -> tuple[torch.Tensor, Callable[[torch.Tensor], None]]:
    """(H, add): `add(x)` accumulates the (tokens, K) inputs x into H as sum of x^T x (float64);
    the caller scales by 2 / tokens."""
    h = torch.zeros(k, k, dtype=torch.float64)

    def add(x: torch.Tensor) -> None:
        xf = x.float()
        h.add_((xf.t() @ xf).double())
    return h, add


# ----------------------------------------------------------------------------- the model
@torch.no_grad()
def quantize_gptq(model: LlamaModel, cfg, calibration: list[list[int]]) -> None:
    """Replace every decoder projection of `model` by an Int4Linear fitted by GPTQ on the
    calibration windows, layer by layer (see the module docstring). Options (QuantConfig):
    gptq_percdamp, gptq_block_size, gptq_act_order."""
    dtype = model.embed_tokens.weight.dtype
    percdamp, block_size, act_order = cfg.gptq_percdamp, cfg.gptq_block_size, cfg.gptq_act_order
    runner = LayerwiseRunner(model, calibration)
    for index, layer in enumerate(model.layers):
        quantized = {}
        for path in ORDER:
            linear = get_module(layer, path)[2]
            h, add = hessian_accumulator(linear.in_features)
            runner.run(index, {linear: add}, stop_after=linear)
            h.mul_(2 / runner.num_tokens)
            result = gptq_quantize_weight(linear.weight, h, cfg.group_size, block_size, percdamp,
                                          act_order)
            quantized[path] = result.weight
            # Until the layer is done, the nn.Linear holds the dequantized weights: the next
            # passes see exactly the quantized layer's arithmetic (its reference path), without
            # unpacking codes on every pass.
            linear.weight.copy_(result.weight.dequantize())
        runner.run(index, advance=True)
        for path, weight in quantized.items():
            owner, attr, _ = get_module(layer, path)
            setattr(owner, attr, Int4Linear(weight, dtype))

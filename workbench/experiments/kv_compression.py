"""What compressing the KV cache costs: perplexity against bytes per token, for four methods.

Every number comes from one contiguous prefill per window of the engine's own model, layer by
layer, with the plain-PyTorch attention reading a cache built as the engine builds it
(kv/paged_cache.py), so a per-layer format plan here runs exactly the engine's quantized rows:

- per-layer precision: each layer's rows in "auto", "int8" or "int4" (config/kv_plan.py);
  `layer_sensitivity` quantizes one layer at a time, `ranked_plans` keeps the most sensitive
  layers at the higher format, `depth_plans` the shallowest ones (the same bytes);
- cross-layer sharing (CLA without retraining): in each group of g adjacent layers the later
  ones attend to the first one's K/V and compute only their own queries; a shared layer stores
  nothing;
- low-rank keys (ShadowKV): per layer and kv head, keys before rotary are projected on a rank-r
  basis calibrated on other text; the cache would hold r coefficients per key instead of
  head_dim values. Pre-RoPE, because rotary turns each pair of dimensions by a position-dependent
  angle, which spreads a low-rank set of keys over more directions (ShadowKV's observation).
  Values are kept whole.

Perplexity is on the held-out CPython documentation, calibration on the other part
(quant/calibration.py). Bytes per token count the cache rows (codes and scales); a low-rank
method's bases (layers x kv heads x head_dim x r values, once) are not per token and not counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workbench.attention.metadata import AttentionMetadata
from workbench.attention.torch_backend import TorchAttention
from workbench.layers.ops import TorchOps
from workbench.quant.calibration import calibration_windows, heldout_windows
from workbench.layers.kv_formats import row_bytes
from workbench.kv.paged_cache import PagedKVCache, layer_formats


@dataclass
class KVTransform:
    """How each layer's keys and values reach the cache (defaults: as the engine stores them)."""

    kv_cache_dtype: str | list[str] = "auto"   # a format or a per-layer plan (config/kv_plan.py)
    share_from: list[int] | None = None        # layer i reads the K/V of layer share_from[i]
    key_bases: list[torch.Tensor] | None = None  # per layer (kv_heads, head_dim, r), pre-RoPE


def sharing_map(num_layers: int, group: int, first_layer: int = 0) -> list[int]:
    """share_from for groups of `group` adjacent layers from `first_layer` on: each later layer of
    a group reads its group's first layer; layers before first_layer (and a short tail) keep
    their own."""
    if group < 1 or not 0 <= first_layer < num_layers:
        raise ValueError(f"group={group}, first_layer={first_layer} is invalid: group must be >= 1 "
                         f"and first_layer in [0, {num_layers - 1}]")
    out = list(range(num_layers))
    for start in range(first_layer, num_layers - group + 1, group):
        for i in range(start + 1, start + group):
            out[i] = start
    return out


def bytes_per_token(args, dtype: torch.dtype, t: KVTransform) -> int:
    """K and V bytes one token stores, summed over the layers that store their own."""
    fmts = layer_formats(args, t.kv_cache_dtype)
    total = 0
    for i, fmt in enumerate(fmts):
        if t.share_from is not None and t.share_from[i] != i:
            continue
        v_row = row_bytes(args.head_dim, fmt, dtype)
        k_row = v_row
        if t.key_bases is not None:     # r coefficients in the model's dtype
            k_row = t.key_bases[i].shape[-1] * torch.empty((), dtype=dtype).element_size()
        total += args.num_key_value_heads * (k_row + v_row)
    return total


class _LowRankKeys(TorchOps):
    """TorchOps whose rotary first replaces keys by their projection on a rank-r basis, rounded
    through the model's dtype as stored coefficients would be."""

    def __init__(self, basis: torch.Tensor):
        self.basis = basis                              # (kv_heads, head_dim, r)

    def rotary(self, q, k, rope):
        b = self.basis.to(k.dtype)
        coeffs = torch.einsum("thd,hdr->thr", k, b)
        return TorchOps.rotary(q, torch.einsum("thr,hdr->thd", coeffs, b), rope)


class _KeyRecorder(TorchOps):
    """TorchOps that keeps the keys it rotates, before rotary (for calibration)."""

    def __init__(self, store: list):
        self.store = store

    def rotary(self, q, k, rope):
        self.store.append(k.float())
        return TorchOps.rotary(q, k, rope)


@torch.inference_mode()
def window_nll(model, token_ids: list[int], t: KVTransform | None = None,
               key_store: list[list[torch.Tensor]] | None = None) -> torch.Tensor:
    """Negative log-likelihoods (float64) of token_ids[1:] after one prefill under `t`.
    key_store: a list per layer receiving that layer's pre-RoPE keys."""
    t = t or KVTransform()
    args, n = model.args, len(token_ids)
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    cache = PagedKVCache(args, 1, n, dtype, device, kv_cache_dtype=t.kv_cache_dtype)
    slots = torch.arange(n, device=device)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], device=device), seq_lens=torch.tensor([n], device=device),
        slot_mapping=slots, slot_table=slots[None, :], max_query_len=n, max_seq_len=n,
        query_lens=[n], seq_lens_list=[n], block_tables=torch.zeros(1, 1, dtype=torch.long,
                                                                    device=device),
        block_size=n, kv_cache_dtype=cache.kv_cache_dtype)
    backend, ids = TorchAttention(), torch.tensor(token_ids, device=device)
    x = model.embed_tokens(ids)
    rope = TorchOps.rope_inputs(model.rotary, slots, x.dtype)
    residual, kept = None, {}
    for i, layer in enumerate(model.layers):
        ops = TorchOps()
        if t.key_bases is not None:
            ops = _LowRankKeys(t.key_bases[i])
        elif key_store is not None:
            ops = _KeyRecorder(key_store[i])
        q, k, v, residual = layer.pre_attention(x, residual, rope, ops)
        source = i if t.share_from is None else t.share_from[i]
        if source != i:      # attend to the group's first layer's keys and values
            k, v = kept[source]
        kept[i] = (k, v)
        k_cache, v_cache = cache.kv_caches[i]
        attn = backend.forward(q, k, v, k_cache, v_cache, meta.for_layer(i), layer.self_attn.scale)
        x, residual = layer.post_attention(attn, residual, ops)
    hidden = TorchOps.rms_norm(x, model.norm.weight, model.norm.eps, residual)[0]
    logprobs = torch.log_softmax(model.compute_logits(hidden[:-1]), dim=-1)
    return -logprobs.double().gather(1, ids[1:, None])[:, 0].cpu()


def perplexity(model, windows: list[list[int]], t: KVTransform | None = None) -> float:
    return math.exp(torch.cat([window_nll(model, w, t) for w in windows]).mean().item())


def calibrate_key_bases(model, windows: list[list[int]],
                        ranks: list[int]) -> dict[int, list[torch.Tensor]]:
    """For each rank r, per layer (kv_heads, head_dim, r): the top right singular vectors of the
    pre-RoPE keys each kv head produced on `windows` (the basis minimizing their squared
    projection error). One calibration pass and one SVD per head serve every rank."""
    args = model.args
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= args.head_dim:
            raise ValueError(f"rank={r!r} is invalid: it must be an integer in "
                             f"[1, head_dim={args.head_dim}]")
    store: list[list[torch.Tensor]] = [[] for _ in model.layers]
    for w in windows:
        window_nll(model, w, key_store=store)
    full = []
    for keys in store:
        k = torch.cat(keys)                              # (tokens, kv_heads, head_dim)
        full.append(torch.stack([torch.linalg.svd(k[:, h], full_matrices=False)[2].T
                                 for h in range(k.shape[1])]))   # (kv_heads, head_dim, head_dim)
    return {r: [b[..., :r].contiguous() for b in full] for r in ranks}


def layer_sensitivity(model, windows: list[list[int]], fmt: str = "int4",
                      reference: float | None = None) -> list[float]:
    """Perplexity increase when only layer i's K/V are stored in `fmt`, for every layer i."""
    n = model.args.num_hidden_layers
    reference = perplexity(model, windows) if reference is None else reference
    return [perplexity(model, windows, KVTransform(
        ["auto"] * i + [fmt] + ["auto"] * (n - i - 1))) - reference for i in range(n)]


def _check_counts(counts: list[int], num_layers: int) -> None:
    bad = [c for c in counts if isinstance(c, bool) or not isinstance(c, int)
           or not 0 <= c <= num_layers]
    if bad:
        raise ValueError(f"counts={counts!r} is invalid: each count of layers kept at the higher "
                         f"format must be an integer in [0, {num_layers}]; {bad} are not")


def ranked_plans(sensitivity: list[float], counts: list[int], high: str = "int8",
                 low: str = "int4") -> dict[int, list[str]]:
    """For each count c: the c most sensitive layers in `high`, the others in `low`."""
    _check_counts(counts, len(sensitivity))
    order = sorted(range(len(sensitivity)), key=lambda i: -sensitivity[i])
    return {c: [high if i in set(order[:c]) else low for i in range(len(sensitivity))]
            for c in counts}


def depth_plans(num_layers: int, counts: list[int], high: str = "int8",
                low: str = "int4") -> dict[int, list[str]]:
    """For each count c: the first c layers in `high`, the deeper ones in `low`."""
    _check_counts(counts, num_layers)
    return {c: [high] * c + [low] * (num_layers - c) for c in counts}


def compression_table(llm, num_windows: int = 2, window_len: int = 128,
                      sensitivity_windows: int = 1, calibration_windows_count: int = 4,
                      counts: tuple[int, ...] = (6, 12), ranks: tuple[int, ...] = (16, 32, 48),
                      groups: tuple[int, ...] = (2,),
                      sensitivity: list[float] | None = None) -> list[dict]:
    """One row per (method, setting): KV bytes per token, ratio to the model-dtype cache,
    perplexity on `num_windows` held-out windows and its increase over the model-dtype cache.
    Layer sensitivities and key bases are measured on calibration text, never on the held-out
    windows that score the plans: sensitivities on the first `sensitivity_windows` calibration
    windows (one forward per layer and window: the expensive part), unless `sensitivity` gives
    them (layer_sensitivity's list, measured by the caller on calibration text)."""
    if not 1 <= sensitivity_windows <= calibration_windows_count:
        raise ValueError(f"sensitivity_windows={sensitivity_windows} is invalid: it must be between "
                         f"1 and calibration_windows_count={calibration_windows_count}")
    engine = llm.engine if hasattr(llm, "engine") else llm
    model, tok, args = engine.model, engine.tokenizer, engine.model_args
    dtype, n = model.embed_tokens.weight.dtype, args.num_hidden_layers
    windows = heldout_windows(tok, num_windows, window_len)
    calib = calibration_windows(tok, calibration_windows_count, window_len)
    settings: list[tuple[str, str, KVTransform]] = [("model dtype", str(dtype), KVTransform())]
    for fmt in ("fp8", "int8", "int4"):
        settings.append(("uniform", fmt, KVTransform(fmt)))
    sens = sensitivity if sensitivity is not None else layer_sensitivity(
        model, calib[:sensitivity_windows], "int4")
    if len(sens) != n:
        raise ValueError(f"sensitivity has {len(sens)} entries: one per layer ({n}) is required")
    for c, plan in depth_plans(n, list(counts)).items():
        settings.append(("per-layer, by depth", f"int8 x{c} shallowest, int4 rest",
                         KVTransform(plan)))
    for c, plan in ranked_plans(sens, list(counts)).items():
        settings.append(("per-layer, by sensitivity", f"int8 x{c} most sensitive, int4 rest",
                         KVTransform(plan)))
    for g in groups:
        settings.append(("cross-layer sharing", f"groups of {g}, all layers",
                         KVTransform(share_from=sharing_map(n, g))))
        settings.append(("cross-layer sharing", f"groups of {g}, layers {n // 2}+",
                         KVTransform(share_from=sharing_map(n, g, n // 2))))
    for r, bases in calibrate_key_bases(model, calib, list(ranks)).items():
        settings.append(("low-rank keys", f"rank {r} of {args.head_dim}, pre-RoPE",
                         KVTransform(key_bases=bases)))
    rows = []
    for method, setting, t in settings:
        rows.append({"method": method, "setting": setting,
                     "kv_bytes_per_token": bytes_per_token(args, dtype, t),
                     "perplexity": perplexity(model, windows, t)})
    for r in rows:
        r["ratio"] = r["kv_bytes_per_token"] / rows[0]["kv_bytes_per_token"]
        r["delta"] = r["perplexity"] - rows[0]["perplexity"]
    return rows


def format_table(rows: list[dict]) -> str:
    w = max([34] + [len(r["setting"]) for r in rows])
    lines = [f"{'method':28} {'setting':{w}} {'bytes/tok':>9} {'ratio':>6} {'ppl':>8} {'delta':>8}"]
    for r in rows:
        lines.append(f"{r['method']:28} {r['setting']:{w}} {r['kv_bytes_per_token']:9d} "
                     f"{r['ratio']:6.3f} {r['perplexity']:8.3f} {r['delta']:+8.3f}")
    return "\n".join(lines)

"""Lab 00 (the tour): the distribution a token is drawn from, what one token costs in the KV cache,
and the decode speed that memory bandwidth allows.

The references are the engine's own: the sampler (`workbench/sample/sampler.py`: greedy rows take the
argmax, sampled rows go through `apply_top_k_top_p` after the temperature), the bytes the paged KV
cache allocates for one token slot (`workbench/kv/paged_cache.py`, from the model's config read by
`LlamaArgs.from_hf_config`), and the chapter's roofline (`workbench.bench.decode_bytes_per_token`).
"""
from __future__ import annotations

import math
import numbers
import random

import torch

from workbench.bench import decode_bytes_per_token
from workbench.kv.paged_cache import PagedKVCache
from workbench.models.llama import LlamaArgs
from workbench.sample.sampler import Sampler, apply_top_k_top_p
from workbench.sampling_params import SamplingParams
from workbench.course.labs.core import Mismatch, call, exercise, expect_equal

CHAPTER = "00_tour"


def _fmt(t: torch.Tensor, digits: int = 4) -> str:
    return "[" + ", ".join(f"{x:.{digits}g}" for x in t.tolist()) + "]"


# ----------------------------------------------------------------------------- next_token_probs
def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int,
                     top_p: float) -> torch.Tensor:
    """What the engine's Sampler draws from, as a vector: a greedy row is one-hot at the token the
    Sampler returns; a sampled row is softmax of the row after temperature, top-k and top-p."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if params.greedy:
        token = Sampler(seed=0)(logits[None].float(), [params], [None]).token_ids[0]
        probs = torch.zeros(logits.shape[0])
        probs[token] = 1.0
        return probs
    # The Sampler's own two lines for a sampled row.
    return apply_top_k_top_p(logits.float() / temperature, top_k, top_p).softmax(-1)


def _variant(logits, temperature, top_k, top_p, *, temp_mul=False, topk_exact=False,
             topp_inclusive=False, temp_last=False, topp_unrenormalized=False, no_renorm=False):
    """Typical wrong versions, only to recognise a learner's mistake (never the reference)."""
    x = logits.double()
    if temperature == 0:
        return None
    scaled = x * temperature if temp_mul else x / temperature
    work = x if temp_last else scaled
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.shape[0]:
        if topk_exact:
            keep = torch.zeros_like(keep)
            keep[torch.topk(work, top_k).indices] = True
        else:
            keep = work >= torch.topk(work, top_k).values[-1]
    if top_p < 1.0:
        base = work if topp_unrenormalized else work.masked_fill(~keep, float("-inf"))
        probs = base.softmax(-1)
        sorted_p, order = torch.sort(probs, descending=True)
        cum = sorted_p.cumsum(-1)
        remove_sorted = cum > top_p if topp_inclusive else (cum - sorted_p) >= top_p
        remove = torch.zeros_like(keep)
        remove[order] = remove_sorted
        keep = keep & ~remove
    if no_renorm:
        return scaled.softmax(-1) * keep
    return scaled.masked_fill(~keep, float("-inf")).softmax(-1)


def _top_p_margin(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> float:
    """How close the mass before any token comes to top_p: random cases too close to the boundary
    are skipped, since an equally correct float computation could land on either side."""
    if temperature == 0 or top_p >= 1.0:
        return math.inf
    row = apply_top_k_top_p(logits.double() / temperature, top_k, 1.0)
    sorted_p = torch.sort(row.softmax(-1), descending=True).values
    before = sorted_p.cumsum(-1) - sorted_p
    return (before - top_p).abs().min().item()


def _probs_hint(got: torch.Tensor, logits, temperature, top_k, top_p) -> str:
    close = lambda v: v is not None and torch.allclose(got.double(), v.double(), atol=1e-5)
    if temperature == 0:
        if torch.isnan(got).any():
            return ("temperature 0 means greedy: do not divide by it. Return a vector that is 1 at "
                    "the argmax and 0 elsewhere.")
        if int(got.argmax()) != int(logits.argmax()):
            return ("greedy picks the largest logit; when several are equal, the first of them "
                    "(torch.argmax does).")
        return ("temperature 0 means greedy: a one-hot vector at the argmax, whatever top_k and "
                "top_p say.")
    if torch.isnan(got).any() or torch.isinf(got).any():
        if (logits / temperature).abs().max() > 80:       # exp(89) overflows float32
            return ("NaN or inf: exp of a large logit overflows. Subtract the row's max before "
                    "exp, or use torch.softmax, which does.")
        if top_k <= 0:
            return "top_k of -1 or 0 means no top-k at all, not 'keep no tokens'."
        if top_p < 1.0:
            return ("top-p removed every token: the most likely token always stays (the mass "
                    "before it is 0), and a token stays while the mass before it is below top_p.")
        return ("NaN or inf: look for a division by zero, or a softmax over a row whose logits "
                "are all -inf (every token removed).")
    v = dict(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p)
    if close(_variant(**v, temp_mul=True)):
        return "divide the logits by the temperature (a low temperature sharpens), do not multiply."
    if close(_variant(**v, topk_exact=True)):
        return ("ties: keep every token whose logit is at least the k-th largest one (the engine "
                "compares with that value), so tied tokens all stay, even if that is more than k.")
    if close(_variant(**v, topp_inclusive=True)):
        return ("top-p keeps a token while the mass of the tokens *before* it is below top_p: the "
                "token that crosses top_p stays (cumsum - p < top_p, not cumsum <= top_p).")
    if close(_variant(**v, temp_last=True)):
        return ("order: divide by the temperature first, then apply top-k and top-p to the "
                "tempered distribution.")
    if close(_variant(**v, topp_unrenormalized=True)):
        return ("top-p runs after top-k, on the distribution of the tokens top-k kept "
                "(renormalized), not on the original one.")
    if close(_variant(**v, no_renorm=True)) or abs(got.double().sum().item() - 1) > 1e-4:
        return ("the result must sum to 1: after removing tokens, renormalize over the kept ones "
                "(softmax of the logits with the removed ones set to -inf).")
    return ""


@exercise("tour.next_token_probs", CHAPTER, "next_token_probs",
          "the distribution the sampler draws the next token from",
          hint="temperature 0: one-hot at the argmax. Otherwise: logits / temperature; top-k keeps "
               "logits >= the k-th largest (off when top_k <= 0 or >= vocab); top-p sorts the "
               "remaining probabilities and drops a token once the mass before it reaches top_p; "
               "then softmax with the dropped tokens at -inf.")
def check_next_token_probs(next_token_probs) -> None:
    log = lambda *p: torch.tensor(p).log()
    cases = [  # (logits, temperature, top_k, top_p)
        (torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0]), 1.0, -1, 1.0),      # plain softmax
        (torch.tensor([1000.0, 999.0, 990.0, 998.5]), 1.0, -1, 1.0),   # large logits
        (torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0]), 0.0, -1, 1.0),      # greedy
        (torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0]), 0.5, -1, 1.0),      # sharper
        (torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0]), 2.0, -1, 1.0),      # flatter
        (torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0]), 1.0, 2, 1.0),       # top-k
        (torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0]), 1.0, 2, 1.0),        # top-k with a tie at k
        (log(0.15, 0.5, 0.05, 0.3), 1.0, -1, 0.6),                     # top-p: keeps 0.5 and 0.3
        (log(0.15, 0.5, 0.05, 0.3), 1.0, -1, 0.4),                     # top-p below the first
        (log(0.1, 0.2, 0.3, 0.4), 1.0, 3, 0.5),                        # top-k, then top-p
        (torch.tensor([0.5, 2.0, -1.0, 1.5, 1.0, 0.0]), 0.7, 4, 0.8),  # all three
        (torch.tensor([0.5, 2.0, -1.0, 1.5]), 1.0, 0, 1.0),            # top_k 0 = off
        (torch.tensor([0.5, 2.0, -1.0, 1.5]), 1.0, 4, 1.0),            # top_k = vocab = off
        (torch.tensor([0.5, 2.0, -1.0, 1.5]), 1.0, 1, 1.0),            # top_k 1
        (torch.tensor([1.0, 3.0, 3.0, 0.0]), 0.0, -1, 1.0),            # greedy tie: the first
        (torch.tensor([1.0, 3.0, 2.5, 0.0]), 0.0, 1, 0.1),             # greedy ignores k and p
    ]
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    while len(cases) < 40:
        vocab = rng.randint(5, 64)
        logits = torch.randn(vocab, generator=gen) * 3
        t = rng.choice([0.0, 0.3, 0.7, 1.0, 1.5])
        k = rng.choice([-1, 0, 1, 3, 10])
        p = rng.choice([1.0, 0.95, 0.9, 0.5])
        if _top_p_margin(logits, t, k, p) > 1e-4:
            cases.append((logits, t, k, p))
    for logits, t, k, p in cases:
        what = (f"next_token_probs(logits={_fmt(logits)}, temperature={t}, top_k={k}, top_p={p})")
        got = call(next_token_probs, what, logits.clone(), t, k, p)
        expected = _reference_probs(logits, t, k, p)
        if not isinstance(got, torch.Tensor):
            hint = ("return the whole distribution as a tensor: for greedy, a one-hot vector."
                    if isinstance(got, numbers.Number) else "return a torch.Tensor.")
            raise Mismatch(f"{what} returned {type(got).__name__} {got!r}: expected a "
                           f"torch.Tensor of {logits.shape[0]} probabilities", hint)
        if tuple(got.shape) != tuple(expected.shape):
            raise Mismatch(f"{what}: expected shape {tuple(expected.shape)} (one probability per "
                           f"token), got {tuple(got.shape)}")
        if not got.is_floating_point():
            raise Mismatch(f"{what}: returned a {got.dtype} tensor; probabilities are floats",
                           "build the one-hot vector with torch.zeros(vocab) (float), not "
                           "zeros_like of an integer tensor." if t == 0 else "")
        got = got.detach().cpu()
        finite = torch.isfinite(got).all()
        if finite and torch.allclose(got.double(), expected.double(), atol=1e-5):
            continue
        err = (got.double() - expected.double()).abs().max().item() if finite else float("nan")
        raise Mismatch(f"{what}:\n  expected {_fmt(expected)}\n  got      {_fmt(got)}\n"
                       f"  (largest difference {err:.3g})",
                       _probs_hint(got, logits, t, k, p))


# ---------------------------------------------------------------------------- kv_bytes_per_token
CONFIGS = {  # the fields of each model's config.json that matter here (from the published files)
    "SmolLM2-135M": dict(model_type="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3),
    "Llama-3-8B": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8),
    "Llama-2-7B": dict(model_type="llama", vocab_size=32000, hidden_size=4096,
                       intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32),
    "TinyLlama-1.1B": dict(model_type="llama", vocab_size=32000, hidden_size=2048,
                           intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4),
    # head_dim given explicitly, and not hidden_size / heads (5120 / 32 = 160)
    "Mistral-Nemo-12B": dict(model_type="mistral", vocab_size=131072, hidden_size=5120,
                             intermediate_size=14336, num_hidden_layers=40, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128),
    # an older Llama config: no num_key_value_heads field, so every head has its own K and V
    "LLaMA-7B (2023 config)": dict(model_type="llama", vocab_size=32000, hidden_size=4096,
                                   intermediate_size=11008, num_hidden_layers=32,
                                   num_attention_heads=32),
}


def _allocated_bytes_per_token(config: dict, dtype: torch.dtype) -> int:
    """The bytes the engine's paged KV cache allocates for one token slot: build a cache of one
    block of one slot from the config, as the engine does, and count its tensors."""
    args = LlamaArgs.from_hf_config(config)
    cache = PagedKVCache(args, num_blocks=1, block_size=1, dtype=dtype, device=torch.device("cpu"))
    allocated = sum(t.numel() * t.element_size() for kv in cache.kv_caches for t in kv)
    assert allocated == cache.bytes_per_token     # the engine's accounting agrees with itself
    return allocated


@exercise("tour.kv_bytes_per_token", CHAPTER, "kv_bytes_per_token",
          "bytes one token occupies in the KV cache, from the model's config",
          hint="every layer stores a key and a value vector of head_dim numbers for each KV head: "
               "2 * layers * kv_heads * head_dim * bytes per number.")
def check_kv_bytes_per_token(kv_bytes_per_token) -> None:
    dtypes = [torch.bfloat16, torch.float32, torch.float16]
    cases = [(name, dtype) for name in CONFIGS for dtype in dtypes[:1]]
    cases += [("SmolLM2-135M", torch.float32), ("Llama-3-8B", torch.float16),
              ("Mistral-Nemo-12B", torch.float32), ("TinyLlama-1.1B", torch.float32)]
    for name, dtype in cases:
        cfg = CONFIGS[name]
        what = f"kv_bytes_per_token(config, {dtype}) for {name}, config = {cfg}"
        try:
            got = call(kv_bytes_per_token, what, dict(cfg), dtype)
        except Mismatch as m:
            if "num_key_value_heads" in m.message or "head_dim" in m.message:
                raise Mismatch(m.message,
                               "not every config has every field: without num_key_value_heads each "
                               "attention head has its own K and V (num_attention_heads); without "
                               "head_dim it is hidden_size // num_attention_heads. dict.get helps."
                               ) from None
            raise
        expected = _allocated_bytes_per_token(cfg, dtype)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if not isinstance(got, numbers.Real) or isinstance(got, bool):
            raise Mismatch(f"{what} returned {type(got).__name__} {got!r}: expected a number of "
                           "bytes (an int)")
        if got == expected:
            continue
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        layers, elem = cfg["num_hidden_layers"], torch.empty((), dtype=dtype).element_size()
        full = 2 * layers * kv_heads * head_dim * elem
        hint = ""
        if elem != 2 and got == full // elem * 2:
            hint = "a number takes dtype's element size: 4 bytes in float32, 2 in bf16/fp16."
        elif got * 2 == full:
            hint = "every token stores a key *and* a value: count both (the factor 2)."
        elif got == 2 * layers * heads * head_dim * elem:
            hint = ("grouped-query attention: K and V exist once per *KV* head "
                    "(num_key_value_heads), which several query heads share.")
        elif got * layers == full:
            hint = "every layer has its own K and V cache: multiply by num_hidden_layers."
        elif got == 2 * layers * kv_heads * (cfg["hidden_size"] // heads) * elem:
            hint = ("when the config gives head_dim, use it: Mistral-Nemo's 5120 / 32 = 160 is not "
                    "its head size (128).")
        elif got == full * 8:
            hint = "bytes, not bits: a bf16 number is 2 bytes."
        expect_equal(got, expected, what, hint)


# --------------------------------------------------------------------------------- decode_ceiling
@exercise("tour.decode_ceiling", CHAPTER, "decode_ceiling",
          "the most tokens per second batch-1 decode can reach at a given memory bandwidth",
          hint="a decode step reads every weight byte once plus the K and V of every context "
               "token; tokens/s <= bandwidth (bytes/s) / bytes per step, with 1 GB/s = 1e9 "
               "bytes/s.")
def check_decode_ceiling(decode_ceiling) -> None:
    smol_bf16 = 269_030_016          # SmolLM2-135M's weight_bytes() in bf16 (the tied table once)
    cases = [  # (weight_bytes, kv_bytes_per_token, context_len, bandwidth_gbs)
        (smol_bf16, 23040, 64, 20.0),                 # SmolLM2 bf16 on a CPU
        (smol_bf16, 23040, 0, 20.0),                  # no context yet
        (smol_bf16, 23040, 8192, 20.0),               # a long context: KV is 70% of the weights
        (2 * smol_bf16, 46080, 1024, 12.5),           # fp32
        (95_000_000, 23040, 300, 20.0),               # INT4 weights
        (16_060_522_496, 131072, 4096, 4800.0),       # about Llama-3-8B in bf16, on an H200
        (16_060_522_496, 131072, 131072, 4800.0),     # ... at its longest context
    ]
    for w, kv, ctx, bw in cases:
        what = (f"decode_ceiling(weight_bytes={w}, kv_bytes_per_token={kv}, context_len={ctx}, "
                f"bandwidth_gbs={bw})")
        got = call(decode_ceiling, what, w, kv, ctx, bw)
        nbytes = decode_bytes_per_token(w, kv, ctx)
        expected = bw * 1e9 / nbytes
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if not isinstance(got, numbers.Real) or isinstance(got, bool):
            raise Mismatch(f"{what} returned {type(got).__name__} {got!r}: expected a number of "
                           "tokens per second")
        if math.isclose(got, expected, rel_tol=1e-9):
            continue
        near = lambda v: v != 0 and math.isclose(got, v, rel_tol=1e-6)
        hint = ""
        if ctx and near(bw * 1e9 / w):
            hint = ("the step also reads the K and V of every context token: add "
                    "kv_bytes_per_token * context_len to the weight bytes.")
        elif near(bw * 2**30 / nbytes):
            hint = "GB/s counts 1e9 bytes per second (as copy_bandwidth reports it), not 2**30."
        elif near(nbytes / (bw * 1e9)):
            hint = "that is seconds per token; the ceiling is its inverse, tokens per second."
        elif near(bw / nbytes):
            hint = "bandwidth_gbs is in GB/s: multiply by 1e9 to get bytes per second."
        elif near(bw * 1e9 / (w + kv)):
            hint = "K and V are read for every token of the context: multiply by context_len."
        raise Mismatch(f"{what}:\n  expected {expected:.6g} tokens/s ({bw:g} GB/s over {nbytes:,} "
                       f"bytes per step)\n  got      {got!r}", hint)

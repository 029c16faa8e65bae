"""What quantization costs: a candidate engine against the unquantized reference on held-out text.

For every position of every held-out window, both engines give a full next-token distribution, taken
from the engine's own forward path (scheduler, runner, model, KV cache; one prefill step per
window), not from a separate model. From them:

- perplexity of each engine: exp(mean negative log-likelihood of the window's next tokens);
- mean KL(reference || candidate) = sum_v p_ref(v) * (log p_ref(v) - log p_cand(v)): how much
  probability mass the candidate moves, at every position, not only at the chosen token;
- top-1 agreement: the fraction of positions where both engines' most likely tokens agree (what
  greedy decoding would notice);
- the bytes the candidate stores for its weights, the bytes a decode step reads, and the KV cache
  bytes per token, counted from the engine's tensors.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from workbench.engine.step_inputs import plan_step
from workbench.quant.metrics import kl_divergence, nll
from workbench.sampling_params import SamplingParams


@dataclass
class EvalResult:
    """Candidate vs reference on `num_windows` windows of `window_len` tokens."""

    num_windows: int
    window_len: int
    num_positions: int           # next-token distributions compared (window_len per window)
    ppl_reference: float         # over window_len - 1 predicted tokens per window
    ppl_candidate: float
    mean_kl: float               # nats, mean over positions of KL(reference || candidate)
    max_kl: float                # the worst single position
    top1_agreement: float        # fraction of positions whose argmax tokens agree
    weight_bytes: int            # the candidate's stored weights
    decode_read_bytes: int       # weight bytes one batch-1 decode step reads
    kv_bytes_per_token: float    # the candidate's KV cache, per token slot


def _engine(llm):
    return llm.engine if hasattr(llm, "engine") else llm


@torch.inference_mode()
def window_logprobs(llm, window: Sequence[int]) -> torch.Tensor:
    """(len(window), vocab) fp32 log-probabilities: row t is the engine's next-token distribution
    after window[:t + 1]. One prefill step through the engine's scheduler, runner and model; the
    rows 0..n-2 are the runner's prompt logprobs, row n-1 the logits it samples from."""
    engine = _engine(llm)
    n, budget = len(window), engine.plan.max_num_batched_tokens
    if n < 2:
        raise ValueError(f"window of {n} tokens is invalid: it needs at least 2")
    if n > budget:
        raise ValueError(f"max_num_batched_tokens={budget} is too small for a window of {n} "
                         f"tokens: the window must run as one step; build the LLM with "
                         f"max_num_batched_tokens >= {n}")
    if engine.has_unfinished_requests():
        raise ValueError("the engine has unfinished requests: evaluate on an idle engine, so that "
                         "the window runs alone in its step")
    # prompt_logprobs=0 makes the runner compute the full log-softmax row of every prompt position.
    request_id = engine.add_request(list(window), SamplingParams(temperature=0, max_tokens=1,
                                                                 prompt_logprobs=0))
    try:
        batch = engine.scheduler.schedule()
        if [s.request_id for s in batch.seqs] != [request_id] or batch.num_new_tokens != [n]:
            raise RuntimeError(f"the scheduler split the window: {batch.num_new_tokens} tokens "
                               f"scheduled of {n} (is the KV pool too small?)")
        out = engine.runner.execute(plan_step(batch, engine.blocks, engine.blocks.take_ops()))
        first, rows = out.prompt_logprobs[0]
        assert first == 0 and rows.shape[0] == n - 1, (first, rows.shape)
        last = torch.log_softmax(out.logits[0].float(), dim=-1)
        return torch.cat([rows.float(), last[None]])
    finally:
        engine.abort_request(request_id)   # frees the window's KV blocks


# --------------------------------------------------------------------------------- sizes
def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight tensor the model holds (parameters and buffers, such as quantized
    codes and scales), each shared tensor once; the rotary cos/sin tables are not weights."""
    seen, total = set(), 0
    tensors = [p for _, p in model.named_parameters()] + \
              [b for n, b in model.named_buffers() if not n.startswith("rotary.")]
    for t in tensors:
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def decode_read_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one batch-1 decode step reads: all of them, except that of an embedding table
    not shared with the LM head only one row is read (as LlamaModel.weight_bytes counts)."""
    total = model_bytes(model)
    embed = model.embed_tokens.weight
    if getattr(model.lm_head, "weight", None) is not embed:
        total -= embed.numel() * embed.element_size()
        total += embed.shape[1] * embed.element_size()
    return total


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    if dataclasses.is_dataclass(obj):
        return sum(_tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


def kv_bytes_per_token(llm) -> float:
    """KV cache bytes per token slot, counted from the tensors the model is handed as its cache
    (values and any scales: whatever attention reads lives there), over the pool's slots."""
    cache = _engine(llm).cache
    return _tensor_bytes(cache.kv_caches) / cache.num_slots


# --------------------------------------------------------------------------------- compare
def compare_many(reference, candidates: Mapping[str, object],
                 windows: Sequence[Sequence[int]]) -> dict[str, EvalResult]:
    """Evaluate several candidates against one reference; the reference runs once per window."""
    if not windows:
        raise ValueError("windows=[] is invalid: pass at least one window")
    if not candidates:
        raise ValueError("candidates is empty: pass at least one engine to compare")
    lengths = {len(w) for w in windows}
    if len(lengths) != 1:
        raise ValueError(f"windows have lengths {sorted(lengths)}: they must all be equal")
    nll_ref = []
    acc = {name: {"nll": [], "kl": [], "agree": 0} for name in candidates}
    for window in windows:
        ref = window_logprobs(reference, window)
        nll_ref.append(nll(ref, window))
        ref_top = ref.argmax(-1)
        for name, cand_llm in candidates.items():
            cand = window_logprobs(cand_llm, window)
            a = acc[name]
            a["nll"].append(nll(cand, window))
            a["kl"].append(kl_divergence(ref, cand))
            a["agree"] += int((cand.argmax(-1) == ref_top).sum())
            del cand
    ppl_ref = math.exp(torch.cat(nll_ref).mean().item())
    results = {}
    for name, cand_llm in candidates.items():
        a, kl = acc[name], torch.cat(acc[name]["kl"])
        model = _engine(cand_llm).model
        results[name] = EvalResult(
            num_windows=len(windows), window_len=len(windows[0]), num_positions=kl.numel(),
            ppl_reference=ppl_ref, ppl_candidate=math.exp(torch.cat(a["nll"]).mean().item()),
            mean_kl=kl.mean().item(), max_kl=kl.max().item(),
            top1_agreement=a["agree"] / kl.numel(), weight_bytes=model_bytes(model),
            decode_read_bytes=decode_read_bytes(model),
            kv_bytes_per_token=kv_bytes_per_token(cand_llm))
    return results


def compare(reference, candidate, windows: Sequence[Sequence[int]]) -> EvalResult:
    """Evaluate one candidate engine (an LLM) against the reference engine on `windows`."""
    return compare_many(reference, {"candidate": candidate}, windows)["candidate"]

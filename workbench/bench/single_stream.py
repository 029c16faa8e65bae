"""The single-stream workload: one ~32-token prompt, 128 new tokens, greedy, batch 1.

The engine and transformers' `generate()` run on the same weights and dtype in one process,
alternating, several repetitions; the headline is the median of the per-pair ratios (a shared
2-core machine is too noisy for absolute times to mean much on their own).

Reported per dtype:
- tok/s end to end (new tokens / wall time, prefill included) for both: the ratio uses these;
- the engine's decode tok/s (1 / time per output token) and the bandwidth it achieves:
  (weight bytes + KV bytes of the context) x decode tok/s, against the measured copy bandwidth.
"""
from __future__ import annotations

import statistics
import time

import torch

from workbench.llm import LLM
from workbench.sampling_params import SamplingParams
from workbench.bench.bandwidth import copy_bandwidth, decode_bytes_per_token

PROMPT = ("The history of computing is a story of people who turned ideas about numbers into "
          "machines. Write a short overview of the most important steps, from the abacus to")
NEW_TOKENS = 128


def engine_once(llm: LLM, prompt_ids: list[int], new_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate([prompt_ids], params)[0]
    wall = time.perf_counter() - t
    assert len(out.outputs[0].token_ids) == new_tokens
    return {"wall_s": wall, "tok_s": new_tokens / wall, "ttft_s": out.metrics.ttft,
            "decode_tok_s": 1.0 / out.metrics.tpot, "tokens": out.outputs[0].token_ids}


@torch.inference_mode()
def hf_once(model, prompt_ids: list[int], new_tokens: int) -> dict:
    """transformers' generate(); its end-of-sequence check is switched off (our `ignore_eos`).
    `min_new_tokens` would not do: it bans the EOS token, which changes the greedy tokens."""
    ids = torch.tensor([prompt_ids])
    model.generation_config.eos_token_id = None
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - t
    return {"wall_s": wall, "tok_s": new_tokens / wall, "tokens": out[0, len(prompt_ids):].tolist()}


def run(dtypes=("float32", "bfloat16"), repeats: int = 3, new_tokens: int = NEW_TOKENS,
        model: str = "smollm2-135m", **_) -> dict:
    from transformers import AutoModelForCausalLM
    bandwidth = copy_bandwidth()
    results = {"workload": "single-stream", "new_tokens": new_tokens, "repeats": repeats,
               "threads": torch.get_num_threads(), "copy_bandwidth_gbs": bandwidth, "dtypes": {}}
    for dtype in dtypes:
        llm = LLM(model=model, dtype=dtype, device="cpu", verbose=False)
        tok = llm.get_tokenizer()
        prompt_ids = tok.encode(PROMPT)
        results["prompt_tokens"] = len(prompt_ids)
        hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.checkpoint),
                                                  dtype=llm.engine.dtype).eval()
        engine_once(llm, prompt_ids, 8)  # warm-up both: first calls allocate and pick kernels
        hf_once(hf, prompt_ids, 8)
        pairs = []
        for _ in range(repeats):
            e = engine_once(llm, prompt_ids, new_tokens)
            h = hf_once(hf, prompt_ids, new_tokens)
            pairs.append((e, h))
        ratios = [e["tok_s"] / h["tok_s"] for e, h in pairs]
        decode = statistics.median(e["decode_tok_s"] for e, _ in pairs)
        per_token = decode_bytes_per_token(llm.engine.model.weight_bytes(),
                                           llm.engine.model_args.kv_bytes_per_token(llm.engine.dtype),
                                           len(prompt_ids) + new_tokens // 2)
        achieved = per_token * decode / 1e9
        results["dtypes"][dtype] = {
            "engine_tok_s": statistics.median(e["tok_s"] for e, _ in pairs),
            "transformers_tok_s": statistics.median(h["tok_s"] for _, h in pairs),
            "ratio_median": statistics.median(ratios), "ratios": ratios,
            "engine_decode_tok_s": decode,
            "engine_ttft_s": statistics.median(e["ttft_s"] for e, _ in pairs),
            "bytes_per_token": per_token, "achieved_gbs": achieved,
            "fraction_of_copy_bandwidth": achieved / bandwidth,
            "same_tokens": all(e["tokens"] == h["tokens"] for e, h in pairs),
        }
        del llm, hf
    return results


def format_table(r: dict) -> str:
    lines = [f"single-stream: {r['prompt_tokens']}-token prompt, {r['new_tokens']} new tokens, "
             f"greedy, batch 1, {r['threads']} threads, {r['repeats']} alternating pairs",
             f"measured copy bandwidth: {r['copy_bandwidth_gbs']:.1f} GB/s (read + write)", "",
             f"{'dtype':<10}{'engine tok/s':>14}{'HF tok/s':>10}{'ratio':>8}{'decode tok/s':>14}"
             f"{'GB/s':>7}{'of copy BW':>12}{'same tokens':>13}"]
    for dtype, d in r["dtypes"].items():
        lines.append(f"{dtype:<10}{d['engine_tok_s']:>14.1f}{d['transformers_tok_s']:>10.1f}"
                     f"{d['ratio_median']:>7.2f}x{d['engine_decode_tok_s']:>14.1f}"
                     f"{d['achieved_gbs']:>7.1f}{d['fraction_of_copy_bandwidth']:>11.0%}"
                     f"{str(d['same_tokens']):>13}")
    lines.append("")
    lines.append("ratio = median over pairs of engine tok/s / transformers tok/s (end to end, "
                 "prefill included); GB/s = (weights + KV) bytes per token x engine decode tok/s")
    return "\n".join(lines)

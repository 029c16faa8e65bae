"""The offline-mixed workload: 64 requests, prompt and output lengths uniform in [16, 256],
`ignore_eos`, fixed seed; throughput = requested output tokens / wall time.

Peer: transformers' `generate()` in static batches of 8 with left padding, the way a user without an
inference engine batches. A static batch runs until its longest request is done, so the shorter
requests' extra tokens are wasted work (they are not counted). The engine takes all 64 at once and
schedules them with continuous batching. Both run the same weights and dtype in one process; with
`repeats > 1` they alternate and the ratio is the median of the pairs.

Also here: KV capacity, how many of these requests fit at once in one fixed KV budget with paging
versus with contiguous max-length reservation (counted by the engine's own block manager).
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from workbench.kv.block_manager import BlockManager
from workbench.llm import LLM
from workbench.sampling_params import SamplingParams


def make_requests(num: int = 64, low: int = 16, high: int = 256, seed: int = 0,
                  vocab: int = 49152) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs; prompts are random ids (content does not matter
    for speed, and random ids avoid accidental prefix sharing)."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(low, high))],
             rng.randint(low, high)) for _ in range(num)]


def engine_run(llm: LLM, requests) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=out, ignore_eos=True) for _, out in requests]
    start_step = len(llm.trace)
    t = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == sum(out for _, out in requests)
    steps = llm.trace[start_step:]
    return {"wall_s": wall, "tok_s": tokens / wall, "tokens": tokens, "steps": len(steps),
            "mean_batch": statistics.mean(r.num_seqs for r in steps),
            "preemptions": sum(r.num_preempted for r in steps)}


@torch.inference_mode()
def hf_static_run(model, requests, batch_size: int = 8, pad_id: int = 0) -> dict:
    model.generation_config.eos_token_id = None   # the equivalent of ignore_eos
    useful, computed = 0, 0
    t = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        chunk = requests[i:i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in chunk],
                           device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk],
                            device=model.device)
        longest = max(out for _, out in chunk)
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, do_sample=False,
                       pad_token_id=pad_id)
        useful += sum(out for _, out in chunk)
        computed += longest * len(chunk)
    wall = time.perf_counter() - t
    return {"wall_s": wall, "tok_s": useful / wall, "tokens": useful,
            "wasted_fraction": 1 - useful / computed}


def kv_capacity(requests, budget_tokens: int, block_size: int, max_model_len: int) -> dict:
    """How many requests (at their final length) fit in `budget_tokens` of KV at once."""
    def count(reserve: int | None) -> int:
        bm = BlockManager(budget_tokens // block_size, block_size, reserve_tokens=reserve)
        n = 0
        for i, (prompt, out) in enumerate(requests):
            if not bm.allocate(str(i), 0, len(prompt) + out):
                break
            n += 1
        return n
    paged, contiguous = count(None), count(max_model_len)
    used = sum(len(p) + o for p, o in requests[:paged])
    return {"budget_tokens": budget_tokens, "block_size": block_size,
            "max_model_len": max_model_len, "paged_seqs": paged, "contiguous_seqs": contiguous,
            "ratio": paged / max(contiguous, 1),
            "paged_utilization": used / (budget_tokens - budget_tokens % block_size),
            "contiguous_utilization": sum(len(p) + o for p, o in requests[:contiguous])
            / budget_tokens}


def alternating_pairs(llm: LLM, hf, requests, pairs: int,
                      batch_size: int = 8) -> list[tuple[dict, dict]]:
    """`pairs` (engine run, transformers run) pairs, the engine first in even pairs and second in
    odd ones. A shared cloud machine's speed drifts from one minute to the next (`python -m
    workbench.bench speed` measures the copy bandwidth before every row and saves its range as
    copy_bandwidth_range_gbs), so only the ratio within a pair means anything, and alternating the
    order cancels a drift inside a pair."""
    out = []
    for i in range(pairs):
        if i % 2 == 0:
            e = engine_run(llm, requests)
            h = hf_static_run(hf, requests, batch_size)
        else:
            h = hf_static_run(hf, requests, batch_size)
            e = engine_run(llm, requests)
        out.append((e, h))
    return out


def run(dtypes=("bfloat16",), repeats: int = 1, num_requests: int = 64, batch_size: int = 8,
        max_num_seqs: int = 64, model: str = "smollm2-135m", **_) -> dict:
    from transformers import AutoModelForCausalLM
    requests = make_requests(num_requests)
    results = {"workload": "offline-mixed", "num_requests": num_requests,
               "hf_batch_size": batch_size, "max_num_seqs": max_num_seqs, "repeats": repeats,
               "threads": torch.get_num_threads(), "dtypes": {},
               "kv_capacity": kv_capacity(requests, budget_tokens=4096, block_size=16,
                                          max_model_len=512)}
    for dtype in dtypes:
        llm = LLM(model=model, dtype=dtype, device="cpu", verbose=False, max_model_len=512,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=1024)
        hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.checkpoint),
                                                  dtype=llm.engine.dtype).eval()
        pairs = alternating_pairs(llm, hf, requests, repeats, batch_size)
        results["dtypes"][dtype] = {
            "engine_tok_s": statistics.median(e["tok_s"] for e, _ in pairs),
            "transformers_tok_s": statistics.median(h["tok_s"] for _, h in pairs),
            "ratio_median": statistics.median(e["tok_s"] / h["tok_s"] for e, h in pairs),
            "engine_mean_batch": pairs[-1][0]["mean_batch"],
            "engine_steps": pairs[-1][0]["steps"],
            "hf_wasted_fraction": pairs[-1][1]["wasted_fraction"],
            "tokens": pairs[-1][0]["tokens"]}
        del llm, hf
    return results


def format_table(r: dict) -> str:
    lines = [f"offline-mixed: {r['num_requests']} requests, prompt and output lengths uniform in "
             f"[16, 256], ignore_eos; transformers in static batches of {r['hf_batch_size']}, "
             f"the engine with max_num_seqs={r['max_num_seqs']}; {r['threads']} threads", "",
             f"{'dtype':<10}{'engine tok/s':>14}{'HF tok/s':>10}{'ratio':>8}"
             f"{'mean batch':>12}{'HF padding waste':>18}"]
    for dtype, d in r["dtypes"].items():
        lines.append(f"{dtype:<10}{d['engine_tok_s']:>14.1f}{d['transformers_tok_s']:>10.1f}"
                     f"{d['ratio_median']:>7.2f}x{d['engine_mean_batch']:>12.1f}"
                     f"{d['hf_wasted_fraction']:>17.0%}")
    c = r["kv_capacity"]
    lines += ["", f"KV capacity in {c['budget_tokens']} token slots (max_model_len "
              f"{c['max_model_len']}, block size {c['block_size']}): paged fits "
              f"{c['paged_seqs']} of these requests at once, contiguous reservation "
              f"{c['contiguous_seqs']}: {c['ratio']:.1f}x; memory holding real tokens "
              f"{c['paged_utilization']:.0%} vs {c['contiguous_utilization']:.0%}"]
    return "\n".join(lines)

"""FlexGen's cost model for offloaded weights, and the measured curve it predicts.

A decode step runs the layers in order. Layer i costs compute_i, the larger of its FLOPs over the
machine's FLOP/s and the bytes it reads (weights, and the batch's K/V) over the fast memory's
bandwidth (a roofline); an offloaded layer also costs transfer_i, its bytes over the slow tier's
bandwidth. With the prefetcher overlapping the next layer's copy with this layer's compute, a step
is sum_i max(compute_i, transfer_i) (plus the LM head); without overlap, sum_i (compute_i +
transfer_i). Tokens/s at batch B is B over the step time: transfers cost the same at every batch,
so offloading hurts least at large batches, FlexGen's argument for throughput-oriented offload.

    machine = measure_machine(device, dtype, "disk")          # three timed loops, a few seconds
    predict_tokens_per_s(layer_costs(model), head_cost(model), offloaded, batch, context, machine)
    rows = measure_offload_curve(llm_factory, [1, 4, 16, 64])  # measured against predicted
    predict_from_resident(resident_step_s, ...)   # the roofline's compute scaled to a measured step
    python -m workbench.experiments.offload_cost --cpu-offload-gb 0.15 --batch-sizes 1,4,16,64 --num-threads 1
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch
from torch import nn

from workbench import LLM
from workbench.offload.tiers import make_tier
from workbench.sampling_params import SamplingParams


@dataclass(frozen=True)
class Machine:
    flops: float               # FLOP/s of the fast device's matmuls
    memory_bandwidth: float    # bytes/s the fast memory streams to the compute
    slow_bandwidth: float      # bytes/s from the slow tier into the fast memory


@dataclass(frozen=True)
class LayerCost:
    weight_bytes: int          # bytes of the layer's parameters (what offload moves)
    matmul_params: int         # multiply-adds per token in its projections
    attention_width: int       # query heads x head_dim: QK^T and PV are 4 x this FLOPs per
    #                            token of context
    kv_bytes_per_token: int    # K and V bytes one context token holds in this layer


def _params(layer: nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in layer.modules()
               if isinstance(m, nn.Linear))


def layer_costs(model, kv_element_size: int | None = None) -> list[LayerCost]:
    """Each decoder layer's sizes, read from a model whose weights are resident."""
    elem = kv_element_size or model.norm.weight.element_size()
    out = []
    for layer in model.layers:
        attn = layer.self_attn
        out.append(LayerCost(
            weight_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
            matmul_params=_params(layer), attention_width=attn.num_heads * attn.head_dim,
            kv_bytes_per_token=2 * attn.num_kv_heads * attn.head_dim * elem))
    return out


def head_cost(model) -> LayerCost:
    """The LM head, one row per sequence per decode step (never offloaded)."""
    w = model.lm_head.weight
    return LayerCost(w.numel() * w.element_size(), w.numel(), 0, 0)


def compute_time(cost: LayerCost, batch: int, context: int, machine: Machine) -> float:
    """One decode step of `batch` sequences with `context` tokens each: the roofline's larger."""
    flops = 2 * batch * cost.matmul_params + 4 * batch * context * cost.attention_width
    read = cost.weight_bytes + batch * context * cost.kv_bytes_per_token
    return max(flops / machine.flops, read / machine.memory_bandwidth)


def predict_step_time(layers: list[LayerCost], head: LayerCost, offloaded, batch: int,
                      context: int, machine: Machine, overlap: bool = True) -> float:
    offloaded = set(offloaded)
    total = compute_time(head, batch, 0, machine)
    for i, cost in enumerate(layers):
        compute = compute_time(cost, batch, context, machine)
        transfer = cost.weight_bytes / machine.slow_bandwidth if i in offloaded else 0.0
        total += max(compute, transfer) if overlap else compute + transfer
    return total


def predict_from_resident(resident_step_s: float, layers: list[LayerCost], head: LayerCost,
                          offloaded, batch: int, context: int, machine: Machine,
                          overlap: bool = True) -> float:
    """The offloaded step predicted from a measured resident step (FlexGen profiles compute the
    same way): each layer's roofline compute is scaled by one factor so that the resident
    prediction equals the measurement, which folds in what the roofline leaves out (small matmuls
    below peak, Python, sampling), and only the transfers come from the model."""
    factor = resident_step_s / predict_step_time(layers, head, [], batch, context, machine)
    offloaded = set(offloaded)
    total = factor * compute_time(head, batch, 0, machine)
    for i, cost in enumerate(layers):
        compute = factor * compute_time(cost, batch, context, machine)
        transfer = cost.weight_bytes / machine.slow_bandwidth if i in offloaded else 0.0
        total += max(compute, transfer) if overlap else compute + transfer
    return total


def predict_tokens_per_s(layers, head, offloaded, batch: int, context: int, machine: Machine,
                         overlap: bool = True) -> float:
    return batch / predict_step_time(layers, head, offloaded, batch, context, machine, overlap)


# ------------------------------------------------------------------------- the machine's numbers
def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_flops(device: torch.device, dtype: torch.dtype, n: int = 1024,
                  repeats: int = 3) -> float:
    """FLOP/s of an n x n x n matmul (best of `repeats`)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def run():
        a @ b
        _sync(device)
    run()
    return 2 * n ** 3 / _best_of(run, repeats)


def measure_memory_bandwidth(device: torch.device, nbytes: int = 2**27, repeats: int = 3) -> float:
    """Bytes/s of a read-only pass (a sum) over `nbytes` of fast memory."""
    x = torch.ones(nbytes // 4, device=device)

    def run():
        x.sum()
        _sync(device)
    run()
    return nbytes / _best_of(run, repeats)


def measure_slow_bandwidth(tier: str, device: torch.device, nbytes: int = 2**27,
                           chunk_bytes: int | None = None, directory: str | None = None,
                           keep_page_cache: bool = False, repeats: int = 2) -> float:
    """Bytes/s from the slow tier ("disk" or "cpu") into the fast memory, through the same tier
    code the offload uses (tiers.py): `nbytes` stored as pieces of `chunk_bytes` (a layer's size:
    small files read slower than one large one), read one after another with the page cache
    dropped, or copied from CPU memory; on CUDA the host-to-device copy is included."""
    chunk = min(chunk_bytes or nbytes, nbytes)
    pieces = max(1, nbytes // chunk)
    store = make_tier(tier, device, directory, keep_page_cache)
    try:
        for i in range(pieces):
            store.store(i, torch.ones(chunk, dtype=torch.uint8))
        pinned = device.type == "cuda"
        host = torch.empty(chunk, dtype=torch.uint8, pin_memory=pinned)
        fast = torch.empty(chunk, dtype=torch.uint8, device=device) if pinned else None

        def run():
            for i in range(pieces):
                if pinned and tier == "cpu":
                    fast.copy_(store.tensors[i], non_blocking=True)
                else:
                    store.read_into(i, host)
                    if pinned:
                        fast.copy_(host, non_blocking=True)
            _sync(device)
        run()
        return pieces * chunk / _best_of(run, repeats)
    finally:
        store.close()


def measure_machine(device: torch.device, dtype: torch.dtype, tier: str,
                    directory: str | None = None, keep_page_cache: bool = False,
                    chunk_bytes: int | None = None) -> Machine:
    return Machine(measure_flops(device, dtype), measure_memory_bandwidth(device),
                   measure_slow_bandwidth(tier, device, chunk_bytes=chunk_bytes,
                                          directory=directory, keep_page_cache=keep_page_cache))


# -------------------------------------------------------------------------- the measured curve
def _decode_run(llm, batch: int, prompt_len: int, decode_tokens: int, seed: int) -> dict:
    """Greedy decode of `batch` random prompts; the decode-only steps' times and offload deltas."""
    rng = random.Random(seed)
    vocab = llm.engine.model_args.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    offload = llm.engine.offload
    before = offload.stats() if offload is not None else None
    first = len(llm.trace)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=decode_tokens,
                                         ignore_eos=True))
    steps = [r for r in llm.trace[first:] if r.num_prefill_tokens == 0 and r.num_seqs == batch]
    if not steps:
        raise ValueError(f"batch_size={batch} is invalid here: no decode step ran all {batch} "
                         "sequences together; raise max_num_seqs or lower the batch size")
    out = {"steps": len(steps), "step_s": sum(r.total_s for r in steps) / len(steps),
           "forward_s": sum(r.forward_s for r in steps) / len(steps)}
    if offload is not None:
        after = offload.stats()
        out["stall_s"] = after["offload_stall_s"] - before["offload_stall_s"]
    return out


def measure_offload_curve(llm_factory, batch_sizes, prompt_len: int = 32, decode_tokens: int = 8,
                          machine: Machine | None = None, overlap: bool = True,
                          seed: int = 0) -> list[dict]:
    """Tokens/s against batch size for resident and offloaded weights, in one process, the two
    engines alternating at each batch size so that the machine's load hits both alike.

    llm_factory(offload: bool) builds an LLM (offload=True: with cpu_offload_gb > 0) whose
    max_num_seqs holds the largest batch. Returns one row per (batch size, weights) with the
    measured and predicted step time and tokens/s (decode-only steps; the prediction at the
    mean context of the decode)."""
    resident, offloaded = llm_factory(False), llm_factory(True)
    try:
        if offloaded.engine.offload is None:
            raise ValueError("llm_factory(True) built an engine without weight offload: pass "
                             "cpu_offload_gb > 0 when offload=True")
        config, k = offloaded.engine.config, offloaded.engine.plan.kernels
        if machine is None:
            spans = offloaded.engine.offload.layouts.values()
            machine = measure_machine(k.device, k.dtype, k.offload_tier, config.offload_dir,
                                      config.offload_keep_page_cache,
                                      chunk_bytes=max(lay.span for lay in spans))
        costs, head = layer_costs(resident.engine.model), head_cost(resident.engine.model)
        context = prompt_len + decode_tokens // 2
        for llm in (resident, offloaded):       # first steps pay one-time costs: not measured
            _decode_run(llm, 1, prompt_len, 2, seed)
        rows = []
        for batch in batch_sizes:
            for name, llm in (("resident", resident), ("offloaded", offloaded)):
                placement = llm.engine.offload.layers if llm.engine.offload is not None else []
                run = _decode_run(llm, batch, prompt_len, decode_tokens, seed)
                predicted = predict_step_time(costs, head, placement, batch, context, machine,
                                              overlap)
                if name == "resident":
                    resident_step = run["step_s"]
                calibrated = predict_from_resident(resident_step, costs, head, placement, batch,
                                                   context, machine, overlap)
                rows.append({
                    "batch_size": batch, "weights": name, "offloaded_layers": len(placement),
                    "measured_step_s": run["step_s"], "measured_forward_s": run["forward_s"],
                    "measured_tokens_per_s": batch / run["step_s"],
                    "predicted_step_s": predicted, "predicted_tokens_per_s": batch / predicted,
                    "relative_error": (predicted - run["step_s"]) / run["step_s"],
                    "calibrated_step_s": calibrated,
                    "calibrated_tokens_per_s": batch / calibrated,
                    "calibrated_error": (calibrated - run["step_s"]) / run["step_s"],
                    "stall_s_per_step": run.get("stall_s", 0.0) / run["steps"],
                    "decode_steps": run["steps"], "flops": machine.flops,
                    "memory_bandwidth": machine.memory_bandwidth,
                    "slow_bandwidth": machine.slow_bandwidth})
        return rows
    finally:
        resident.close()
        offloaded.close()


def format_rows(rows: list[dict], machine_line: str = "") -> str:
    lines = [machine_line] if machine_line else []
    lines.append("batch  weights    layers off  measured tok/s  roofline tok/s  error  "
                 "from resident  error  stall/step")
    for r in rows:
        lines.append(f"{r['batch_size']:>5}  {r['weights']:<9}  {r['offloaded_layers']:>10}  "
                     f"{r['measured_tokens_per_s']:>14.1f}  {r['predicted_tokens_per_s']:>14.1f}"
                     f"  {r['relative_error']:>+5.0%}  {r['calibrated_tokens_per_s']:>13.1f}"
                     f"  {r['calibrated_error']:>+5.0%}  {r['stall_s_per_step'] * 1e3:>7.1f} ms")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--cpu-offload-gb", type=float, default=0.25)
    p.add_argument("--weight-offload", default="auto")
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=8)
    # one thread: a 2-thread step on a shared 2-core machine waits on whichever core is taken
    p.add_argument("--num-threads", type=int, default=None)
    a = p.parse_args(argv)
    sizes = [int(b) for b in a.batch_sizes.split(",")]

    def factory(offload: bool):
        extra = {"cpu_offload_gb": a.cpu_offload_gb, "weight_offload": a.weight_offload} \
            if offload else {"fused_decode": False}   # both layer by layer: only offload differs
        return LLM(model=a.model, verbose=False, max_num_seqs=max(sizes),
                   max_model_len=a.prompt_len + a.decode_tokens + 16,
                   num_threads=a.num_threads, **extra)
    rows = measure_offload_curve(factory, sizes, a.prompt_len, a.decode_tokens)
    r = rows[0]
    print(format_rows(rows, f"machine: {r['flops'] / 1e9:.1f} GFLOP/s, memory "
                            f"{r['memory_bandwidth'] / 1e9:.1f} GB/s, slow tier "
                            f"{r['slow_bandwidth'] / 1e9:.2f} GB/s"))


if __name__ == "__main__":
    main()

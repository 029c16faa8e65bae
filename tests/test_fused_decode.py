"""fused_decode: a decode-only step as one C++ call (kernels/cpu/decode_step.cpp).

The fused step rounds to bf16 where the eager model does and runs the layers' own GEMV functions
(bf16, INT8, INT4 weights), so against the same engine without it (GEMV kernels and C++ attention
in both) one decode step gives the same hidden states and writes the same K/V, bit for bit (tiny
models, 1 and 3 sequences, every weight kind; SmolLM2), and generation gives the same
greedy tokens in batches that mix prefills and decodes. The operator must really run in every
decode-only step, and in no other; a speculative verification (k + 1 tokens per sequence) and a
model drafter's rounds run it too, with the tokens of plain decoding. With fp32 activations (fp32, bf16, INT8 and INT4 weights) one
step agrees with the unfused step to fp32 rounding.
"""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from workbench.kernels.cpu import available
from workbench import LLM, SamplingParams
from workbench.config import EngineConfig, plan_kernels

OK, WHY = available()
needs_kernels = pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable: {WHY}")
FUSED_OP = "workbench_cpu::decode_step"


def engines(model, **extra):
    kwargs = {**dict(model=str(model), dtype="bfloat16", device="cpu", verbose=False,
                     cpu_gemv=True, attention_backend="cpu"), **extra}
    return LLM(fused_decode=True, **kwargs), LLM(fused_decode=False, **kwargs)


def op_calls(llm, prompts, params) -> tuple[int, list]:
    """How many times the fused operator ran while generating, and the outputs."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outs = llm.generate(prompts, params)
    calls = sum(e.count for e in prof.key_averages() if e.key == FUSED_OP)
    return calls, outs


def same_tokens_as(fused, other, prompts, params) -> tuple[int, list]:
    """Generate with `fused` (counting operator calls) and with `other`; assert equal greedy
    tokens. Returns the call count and `fused`'s step records of this generation."""
    start = len(fused.trace)
    calls, outs = op_calls(fused, prompts, params)
    expected = other.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    return calls, fused.trace[start:]


@needs_kernels
@pytest.mark.parametrize("preset, quantization", [("tiny", None), ("tiny-mha", None),
                                                  ("tiny", "int8"), ("tiny-mha", "int4")])
def test_fused_steps_give_the_unfused_tokens(preset, quantization):
    """Prompts of different lengths, four sequences at once, chunked prefill: steps that mix a
    prefill chunk with decodes run the unfused forward, pure decode steps the fused one."""
    from workbench.models import make_random_checkpoint
    folder = make_random_checkpoint(preset, seed=0)
    fused, plain = engines(folder, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
                           quantization=quantization)
    prompts = [[5, 6, 7, 8, 9], list(range(100, 140)), [11, 12], list(range(300, 323))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    calls, steps = same_tokens_as(fused, plain, prompts, params)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)   # mixed steps ran
    assert calls == sum(s.num_prefill_tokens == 0 for s in steps) >= 8


@needs_kernels
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int4_projections_of_different_group_sizes_run_fused(tiny_folder, dtype):
    """A mixed-precision plan (quant/mixed.py) of INT4 groups 32, 128 and 256: one fused step,
    each projection at its own group size, the unfused engine's tokens."""
    plan = {"layers.0.mlp.down_proj": "int4-g32", "layers.1.self_attn.qkv_proj": "int4-g256",
            "layers.1.mlp.gate_up_proj": "int4-g64"}
    fused, plain = engines(tiny_folder, dtype=dtype, max_model_len=128, max_num_seqs=4,
                           quantization="mixed", quantization_config={"mixed_plan": plan})
    groups = {m.group_size for m in fused.engine.model.modules() if hasattr(m, "group_size")}
    assert {32, 64, 128, 256} <= groups
    prompts = [[5, 6, 7, 8, 9], list(range(100, 130))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    calls, steps = same_tokens_as(fused, plain, prompts, params)
    assert calls == sum(s.num_prefill_tokens == 0 for s in steps) >= 8


@needs_kernels
def test_the_operator_runs_in_decode_only_steps_and_nowhere_else(tiny_folder):
    fused, _ = engines(tiny_folder, max_model_len=64)
    start = len(fused.trace)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    calls, _ = op_calls(fused, [[5, 6, 7, 8, 9]], params)
    steps = fused.trace[start:]
    assert [s.num_prefill_tokens for s in steps] == [5, 0, 0, 0, 0, 0]
    assert calls == 5                       # one per decode step; the prefill is unfused
    assert "decode steps: one C++ call" in fused.describe()
    auto = LLM(model=str(tiny_folder), dtype="bfloat16", device="cpu", verbose=False,
               max_model_len=64, cpu_gemv=None, attention_backend="cpu", fused_decode=True)
    assert "matmuls: kernels/cpu" in auto.describe() and "cpu_gemv off" not in auto.describe()
    from workbench.models.fused_decode import FusedDecodeForward
    assert isinstance(fused.engine.runner.forward_fn, FusedDecodeForward)


@needs_kernels
@pytest.mark.parametrize("method", ["ngram", "quantized_self"])
def test_verifications_and_drafts_run_fused_with_the_plain_tokens(tiny_folder, method):
    """fp32 (the loops give a row the same sums in a step of 1 or k + 1 rows): each token of a
    verification is a row of its own, attending to its prefix, so greedy speculation emits the
    tokens of plain decoding, and every step without prompt tokens is one operator call (the
    INT8 draft's rounds are more calls)."""
    spec = {"method": method, "num_speculative_tokens": 3,
            **({"draft_quantization": "int8"} if method == "quantized_self" else {})}
    common = dict(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
                  max_model_len=128, max_num_seqs=2, cpu_gemv=True, attention_backend="cpu",
                  fused_decode=True)
    spec_llm, plain = LLM(speculative_config=spec, **common), LLM(**common)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    calls, steps = same_tokens_as(spec_llm, plain, prompts, params)
    assert max(s.num_draft_tokens for s in steps) >= 2          # verifications of 3+ tokens ran
    without_prompt = sum(s.num_prefill_tokens == 0 for s in steps)
    if method == "ngram":
        assert calls == without_prompt
    else:
        assert calls > without_prompt + sum(s.num_draft_tokens > 0 for s in steps)


def one_step_both_ways(model, num_seqs: int, quantization=None, llm=None, dtype="bfloat16"):
    """Prefill `num_seqs` prompts, then run one decode step through the fused operator and, from
    the same cache contents, through the unfused forward: (hidden states, caches after) of each."""
    fused = llm or engines(model, max_model_len=128, quantization=quantization, dtype=dtype)[0]
    runner = fused.engine.runner
    step = runner.forward_fn
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (7, 20, 33)[:num_seqs]]
    tables = [[4 * i + j for j in range(4)] for i in range(num_seqs)]
    caches = runner.cache.kv_caches
    results = []
    with torch.inference_mode():
        ids, pos, meta = runner.pack([(p, 0) for p in prompts], tables)
        step.inner(ids, pos, caches, meta, runner.backend)
        before = [(k.clone(), v.clone()) for k, v in caches]
        for forward in (step, step.inner):
            for (k, v), (k0, v0) in zip(caches, before):
                k.copy_(k0)
                v.copy_(v0)
            ids, pos, meta = runner.pack([([5], len(p)) for p in prompts], tables)
            assert step.takes(meta, runner.backend)
            hidden = forward(ids, pos, caches, meta, runner.backend)
            results.append((hidden, [(k.clone(), v.clone()) for k, v in caches]))
    return results


def assert_same_step(model, num_seqs, quantization=None, dtype="bfloat16"):
    (hidden, caches), (hidden_ref, caches_ref) = one_step_both_ways(model, num_seqs, quantization,
                                                                    dtype=dtype)
    assert torch.equal(hidden, hidden_ref), (hidden - hidden_ref).abs().max()
    for (k, v), (k_ref, v_ref) in zip(caches, caches_ref):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@needs_kernels
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("num_seqs", [1, 3])
@pytest.mark.parametrize("preset", ["tiny", "tiny-mha"])
def test_a_fused_step_is_bit_equal_to_the_unfused_step(preset, num_seqs, quantization):
    """The same hidden states and the same K/V written, bit for bit: the fused loop rounds where
    eager PyTorch rounds and calls the layers' own GEMV code (measured: equal on these models
    and, in native bf16, on SmolLM2). 3 sequences take torch's (aten's INT8/INT4) matmul inside the operator, as
    they do outside it; INT4 inputs are zero-padded to whole groups inside it, as outside."""
    from workbench.models import make_random_checkpoint
    assert_same_step(make_random_checkpoint(preset, seed=0), num_seqs, quantization)


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_fused_smollm2_step_matches_the_unfused_step(quantization):
    """Bit-equal in bf16 where the CPU has it natively. With fp32 activations (dtype="auto" on
    other CPUs) the fused loop's norms sum in another order than torch's, and the fp32 rounding
    that differs grows over 30 layers: measured 8e-6 at most with bf16 weights and 0.011 with
    INT4 (2-core AMD EPYC, AVX2), bounded here at 0.05."""
    from workbench.config import cpu_has_native_bf16
    if cpu_has_native_bf16():
        assert_same_step("smollm2-135m", 1, quantization)
        return
    (hidden, caches), (hidden_ref, caches_ref) = one_step_both_ways("smollm2-135m", 1, quantization,
                                                                    dtype="auto")
    assert hidden.dtype == torch.float32
    torch.testing.assert_close(hidden, hidden_ref, rtol=0, atol=0.05)
    for (k, v), (k_ref, v_ref) in zip(caches, caches_ref):
        torch.testing.assert_close(k, k_ref, rtol=0, atol=0.05)
        torch.testing.assert_close(v, v_ref, rtol=0, atol=0.05)


def test_fused_decode_setting_is_validated():
    with pytest.raises(ValueError, match=r"fused_decode='yes' is invalid: allowed are None \(auto\), "
                                         r"True, False"):
        EngineConfig(device="cpu", fused_decode="yes")
    with pytest.raises(ValueError, match=r"fused_decode=True is invalid here: the GEMV kernels it "
                                         r"runs are off \(cpu_gemv: switched off\)"):
        EngineConfig(device="cpu", dtype="bfloat16", fused_decode=True, cpu_gemv=False,
                     attention_backend="cpu")
    if not OK:
        return
    with pytest.raises(ValueError, match=r"it runs the C\+\+ paged attention, and "
                                         r"attention_backend='torch'"):
        EngineConfig(device="cpu", dtype="bfloat16", cpu_gemv=True, fused_decode=True,
                     attention_backend="torch")
    with pytest.raises(ValueError, match=r"it takes bf16, INT8 or INT4 weight-only layers "
                                         r"without experts, and quantization='smoothquant'"):
        EngineConfig(device="cpu", dtype="bfloat16", cpu_gemv=True, fused_decode=True,
                     attention_backend="cpu", quantization="smoothquant")
    for method in ("gptq", "awq"):       # their layers are INT4 ones: the model check decides
        assert plan_kernels(EngineConfig(device="cpu", dtype="bfloat16",
                                         quantization=method)).fused_decode
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8'; use 'auto'"):
        EngineConfig(device="cpu", dtype="bfloat16", cpu_gemv=True, fused_decode=True,
                     attention_backend="cpu", kv_cache_dtype="fp8")


@needs_kernels
def test_bad_operator_inputs_are_named(tiny_folder):
    fused, _ = engines(tiny_folder, max_model_len=64)
    f = fused.engine.runner.forward_fn
    m = fused.engine.model
    x = torch.zeros(1, m.args.hidden_size, dtype=torch.bfloat16)
    ks, vs = f._split(fused.engine.cache.kv_caches)
    args = lambda positions, in_norms: (
        x, positions, in_norms, f.post_norms, f.qkv, f.o, f.gate_up, f.down, m.norm.weight,
        m.rotary.cos, m.rotary.sin, ks, vs, torch.zeros(1, dtype=torch.long),
        torch.zeros(1, 4, dtype=torch.long), torch.ones(1, dtype=torch.long), 16, 1e-5, 0.25,
        f.num_heads, f.num_kv_heads)
    zero = torch.zeros(1, dtype=torch.long)
    far = torch.tensor([m.rotary.cos.shape[0]])
    step = torch.ops.workbench_cpu.decode_step
    with pytest.raises(RuntimeError, match=r"positions\[0\]=\d+ is outside the rotary tables"):
        step(*args(far, f.in_norms), 0)
    with pytest.raises(RuntimeError, match=r"every per-layer list must have 1 tensors"):
        step(*args(zero, f.in_norms[:1]), 0)
    with pytest.raises(RuntimeError, match=r"weight_kind=4 is invalid: 0 \(bf16\), 1 \(INT8\), "
                                           r"2 \(INT4\) or 3 \(fp32\)"):
        step(*args(zero, f.in_norms), 4)
    with pytest.raises(RuntimeError, match=r"weight_kind 3 takes fp32 weights and fp32 x"):
        step(*args(zero, f.in_norms), 3)     # bf16 weights and x, called fp32
    with pytest.raises(RuntimeError, match=r"qkv must hold 2 tensors per layer for weight_kind 1 "
                                           r"\(4 in all\), got 2"):
        step(*args(zero, f.in_norms), 1)     # bf16 weights, one per layer, called INT8


@needs_kernels
def test_speculative_decoding_runs_fused_and_unfused_steps_alike(tiny_folder):
    """With n-gram speculation, verify steps (1 + k tokens per sequence) and steps where no draft
    was found both take the fused step; the tokens are the unfused engine's."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    fused, plain = engines(tiny_folder, max_model_len=128, speculative_config=spec)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [11, 12, 13, 14]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    calls, steps = same_tokens_as(fused, plain, prompts, params)
    verifying = [s for s in steps if s.spec]
    assert verifying and len(verifying) < calls == sum(s.num_prefill_tokens == 0 for s in steps)


def fp32_engine(preset: str, weights: str):
    """An fp32 engine (C++ attention) whose projections hold `weights` ("fp32", "bf16", "int8",
    "int4") as the GEMV layers, its forward wrapped in FusedDecodeForward. Built unfused and then
    switched, so that bf16 weights can be put into an fp32 model first (the config does that only for
    dtype="auto" on CPUs without native bf16); fp32, INT8 and INT4 are what LLM(dtype="float32")
    builds by default."""
    from workbench.models import make_random_checkpoint
    from workbench.models.cpu_gemv import use_cpu_gemv
    from workbench.models.fused_decode import FusedDecodeForward
    quantization = weights if weights in ("int8", "int4") else None
    llm = LLM(model=str(make_random_checkpoint(preset, seed=0)), dtype="float32", device="cpu",
              verbose=False, attention_backend="cpu", max_model_len=128,
              quantization=quantization, cpu_gemv=False, fused_decode=False)
    model, runner = llm.engine.model, llm.engine.runner
    if weights == "bf16":
        for layer in model.layers:
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                      layer.mlp.down_proj):
                m.weight.data = m.weight.data.bfloat16()
    use_cpu_gemv(model)
    runner.forward_fn = FusedDecodeForward(model, runner.forward_fn)
    return llm


@needs_kernels
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("num_seqs", [1, 3])
@pytest.mark.parametrize("preset", ["tiny", "tiny-mha"])
def test_an_fp32_fused_step_matches_the_unfused_step(preset, num_seqs, weights):
    """fp32 activations round nowhere, so the fused and unfused steps differ only in the order of
    fp32 sums (RMSNorm mean, attention, GEMV) and the exp polynomial of silu (< 1e-7 relative):
    hidden states of size ~3 agree to 5e-7 here with fp32, bf16 and INT8 weights. 1e-5 leaves
    room for another ISA's sum order and stays far below what a wrong rounding, rotation or
    weight would give (>= 1e-3). INT4: gemv.cpp's loop rounds x to 16 bits per chunk (|error| <=
    max|x| / 65534), while the unfused layer dequantizes for fp32 x (QuantLinear._use_fast takes
    bf16/fp16 only): 1.3e-4 measured, so 1e-3 there."""
    llm = fp32_engine(preset, weights)
    assert llm.engine.runner.forward_fn.weight_kind == {"bf16": 0, "int8": 1, "int4": 2,
                                                        "fp32": 3}[weights]
    (hidden, caches), (hidden_ref, caches_ref) = one_step_both_ways(None, num_seqs, llm=llm)
    assert hidden.dtype == torch.float32
    tol = 1e-3 if weights == "int4" else 1e-5
    torch.testing.assert_close(hidden, hidden_ref, rtol=tol, atol=tol)
    for (k, v), (k_ref, v_ref) in zip(caches, caches_ref):
        torch.testing.assert_close(k, k_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(v, v_ref, rtol=tol, atol=tol)

"""kernels/cpu: the hand-written AVX-512 BF16 matmul for small batches.

The kernel sums in fp32 and rounds once to bf16, as torch's does; only the order of the fp32 sums
differs. So every output must be within one bf16 step of the exact product (computed in fp64 from
the same bf16 inputs), and almost every output must equal torch's own bf16 result.
Then the engine: the same greedy tokens with and without the kernels, eager and compiled.
"""
import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import MAX_ROWS, available
from workbench import LLM, SamplingParams
from workbench.config import EngineConfig

OK, WHY = available()
needs_kernels = pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable: {WHY}")
SHAPES = [(960, 576), (577, 1536), (13, 40), (4, 33), (7, 130)]   # real layers, odd N, K tails


def assert_within_one_bf16_step(out: torch.Tensor, exact: torch.Tensor) -> None:
    """|out - exact| <= one bf16 ulp of |exact| (+ an fp32 sum-order allowance near zero)."""
    exact = exact.double()
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) - 7)
    err = (out.double() - exact).abs()
    allowance = ulp + 1e-6 * exact.abs().max()
    worst = (err / allowance).max().item()
    assert worst <= 1.0, f"an output is {worst:.2f} allowances away from the exact product"


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, MAX_ROWS])
@pytest.mark.parametrize("n,k", SHAPES)
def test_bf16_kernel_matches_the_exact_product(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    out = torch.ops.workbench_cpu.linear_bf16(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    assert_within_one_bf16_step(out, x.double() @ w.double().t())
    same_as_torch = (out == F.linear(x, w)).float().mean().item()
    assert same_as_torch > 0.95


@needs_kernels
def test_batches_above_the_small_path_are_torchs_own_result():
    x = torch.randn(MAX_ROWS + 1, 576).bfloat16()
    w = (torch.randn(64, 576) * 0.05).bfloat16()
    assert torch.equal(torch.ops.workbench_cpu.linear_bf16(x, w), F.linear(x, w))


@needs_kernels
def test_bad_inputs_are_named():
    w = torch.randn(8, 64).bfloat16()
    with pytest.raises(RuntimeError, match=r"x must be a contiguous \(M, 64\) bf16"):
        torch.ops.workbench_cpu.linear_bf16(torch.randn(1, 64), w)          # fp32 x


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_kernel_matches_the_exact_product(rows, n, k):
    """Weight-only INT8, one scale per output row: fp32 sums rounded once to bf16, as aten's
    _weight_int8pack_mm computes (which crashes on 2+ rows when K % 16 != 0, so K=33/40/130 are
    checked against the exact product only)."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) * 0.01 + 1e-3).bfloat16()
    out = torch.ops.workbench_cpu.linear_int8(x, w, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # exact: the fp64 sum, times the scale; rounding the sum to fp32 and the product to bf16
    # stays within one bf16 step of it
    assert_within_one_bf16_step(out, (x.double() @ w.double().t()) * scale.double())
    if k % 16 == 0:
        aten = torch.ops.aten._weight_int8pack_mm(x, w, scale)
        assert (out == aten).float().mean().item() > 0.95


@needs_kernels
def test_int8_bad_inputs_are_named():
    w = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match=r"scale must be a contiguous \(8,\) bf16"):
        torch.ops.workbench_cpu.linear_int8(x, w, torch.ones(8))           # fp32 scale
    with pytest.raises(RuntimeError, match=r"w must be contiguous int8"):
        torch.ops.workbench_cpu.linear_int8(x, w.float(), torch.ones(8).bfloat16())


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("n,k,group", [(960, 576, 128), (576, 1536, 128), (48, 130, 128),
                                       (64, 1024, 256)])
def test_int4_kernel_gives_atens_product(rows, n, k, group):
    """Group-wise INT4 (codes as bf16 128 + q, the offset taken out per group): within one bf16
    step of the exact product of x and the layer's weight (q * scale + minimum, in fp64), no
    further from it than aten's, and almost always aten's very result (3 rows: aten's kernel runs,
    so exactly aten's)."""
    from workbench.quant.formats import quantize_int4
    from workbench.quant.linear import Int4Linear
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    layer = Int4Linear(quantize_int4(torch.randn(n, k, generator=g) * 0.05, group), torch.bfloat16)
    x = layer._pad(torch.randn(rows, k, generator=g).bfloat16()).contiguous()
    aten_packed, _, aten_scale_zero = layer._aten_pack(torch.bfloat16)
    out = torch.ops.workbench_cpu.linear_int4(x, layer.packed, layer.scale, layer.minimum, group,
                                              aten_packed, aten_scale_zero)
    aten = torch.ops.aten._weight_int4pack_mm_for_cpu(x, aten_packed, group, aten_scale_zero)
    codes = layer.as_weight().codes().double().view(n, -1, group)
    w = (codes * layer.scale.double()[..., None] + layer.minimum.double()[..., None]).view(n, -1)
    exact = x.double() @ w.t()
    if rows == 3:
        assert torch.equal(out, aten)
    else:
        assert_within_one_bf16_step(out, exact)
        assert (out - exact).abs().max() <= (aten - exact).abs().max()
        assert (out == aten).float().mean().item() > 0.95


@needs_kernels
def test_int4_bad_group_size_is_named():
    from workbench.quant.formats import quantize_int4
    from workbench.quant.linear import Int4Linear
    layer = Int4Linear(quantize_int4(torch.randn(32, 128), 64), torch.bfloat16)
    p, _, sz = layer._aten_pack(torch.bfloat16)
    with pytest.raises(RuntimeError, match="group_size must be a multiple of 128 dividing 128, got 64"):
        torch.ops.workbench_cpu.linear_int4(torch.randn(1, 128).bfloat16(), layer.packed,
                                            layer.scale, layer.minimum, 64, p, sz)


@needs_kernels
@pytest.mark.parametrize("method, group", [("int8", None), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_quantized_engines_give_the_same_tokens_with_the_kernels(tiny_folder, method, group,
                                                                 compile):
    """INT8 layers (all of an INT8 model, the LM head of an INT4 one) and INT4 layers of group
    size 128 switch to the kernels and give aten's greedy tokens on the tiny model (group 32
    keeps aten's INT4 kernel)."""
    from workbench.models.cpu_gemv import Int4GemvLinear, Int8GemvLinear
    kwargs = dict(model=str(tiny_folder), dtype="bfloat16", device="cpu", verbose=False,
                  max_model_len=64, quantization=method, compile=compile,
                  quantization_config={"group_size": group} if group else None)
    on, off = LLM(cpu_gemv=True, **kwargs), LLM(cpu_gemv=False, **kwargs)
    assert isinstance(on.engine.model.lm_head, Int8GemvLinear)
    assert not isinstance(off.engine.model.lm_head, Int8GemvLinear)
    int4_layers = isinstance(on.engine.model.layers[0].mlp.down_proj, Int4GemvLinear)
    assert int4_layers == (group == 128)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42]]
    params = SamplingParams(temperature=0, max_tokens=8)
    assert ([o.outputs[0].token_ids for o in on.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in off.generate(prompts, params)])


BF16_LOGIT_STEPS = 0.3


def decode_step_logprobs(llm, prompt_ids):
    """Top-5 logprobs of one batch-1 decode step: the second generated token's. The first comes
    from the prefill (len(prompt) > MAX_ROWS rows: torch's kernels in both engines, so the same token)."""
    out = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=2, logprobs=5))
    first, second = out[0].outputs[0].logprobs
    return {t: lp.logprob for t, lp in second.items()}


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{}, {"compile": True}], ids=["eager", "compiled"])
def test_decode_steps_agree_with_torchs_kernels(kwargs):
    """SmolLM2 in bf16, teacher-forced along a 16-token greedy continuation: at every position
    the batch-1 decode step with cpu_gemv gives the same top token as torch's kernels (unless
    torch's top two are within 0.3 nats: the LM head rounds logits to bf16, whose step is 0.0625
    to 0.125 at this model's logit sizes, so 0.3 is two or three steps), and log-probabilities
    within that rounding. (Free-running greedy text may part at a near-tie, as any change of bf16
    summation order can, e.g. another batch size.)"""
    llms = {on: LLM(model="smollm2-135m", dtype="bfloat16", device="cpu", verbose=False,
                    max_model_len=256, cpu_gemv=on, **kwargs) for on in (True, False)}
    tok = llms[False].get_tokenizer()
    prompt = tok.encode("In painting and in printing, the three primary colors are")
    assert len(prompt) > MAX_ROWS           # so the prefill (and the first token) is torch's
    params = SamplingParams(temperature=0, max_tokens=16)
    continuation = llms[False].generate([prompt], params)[0].outputs[0].token_ids
    worst, near_ties = 0.0, 0
    for i in range(len(continuation)):
        ids = prompt + continuation[:i]
        ours, torchs = (decode_step_logprobs(llms[on], ids) for on in (True, False))
        ranked = sorted(torchs, key=torchs.get, reverse=True)
        if torchs[ranked[0]] - torchs[ranked[1]] < BF16_LOGIT_STEPS:
            near_ties += 1
            continue
        assert max(ours, key=ours.get) == ranked[0], f"position {i}"
        worst = max(worst, abs(ours[ranked[0]] - torchs[ranked[0]]))
    assert near_ties <= 6 and worst < BF16_LOGIT_STEPS, (near_ties, worst)


def test_cpu_gemv_setting_is_validated():
    with pytest.raises(ValueError, match=r"cpu_gemv='yes' is invalid: allowed are None"):
        EngineConfig(cpu_gemv="yes", device="cpu")
    with pytest.raises(ValueError, match=r"cpu_gemv=True is invalid here: they take bf16 "
                                         r"activations and dtype is torch.float32"):
        EngineConfig(cpu_gemv=True, device="cpu", dtype="float32")
    auto_fp32 = EngineConfig(device="cpu", dtype="float32")
    assert not auto_fp32.use_cpu_gemv and "dtype is torch.float32" in auto_fp32.cpu_gemv_reason
    assert EngineConfig(device="cpu", dtype="bfloat16", cpu_gemv=None).use_cpu_gemv == OK
    assert not EngineConfig(device="cpu", dtype="bfloat16").use_cpu_gemv      # off by default


@needs_kernels
def test_the_engine_says_which_matmuls_it_runs(tiny_folder):
    llm = LLM(model=str(tiny_folder), dtype="bfloat16", device="cpu", verbose=False,
              max_model_len=64, cpu_gemv=True)
    from workbench.models.cpu_gemv import GemvLinear
    assert all(isinstance(layer.mlp.down_proj, GemvLinear) for layer in llm.engine.model.layers)
    assert "matmuls: AVX-512 GEMV" in llm.describe()
    off = LLM(model=str(tiny_folder), dtype="bfloat16", device="cpu", verbose=False,
              max_model_len=64)
    assert not any(isinstance(layer.mlp.down_proj, GemvLinear) for layer in off.engine.model.layers)
    assert "GEMV" not in off.describe()
    fp32 = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
               max_model_len=64, cpu_gemv=None)
    assert "matmuls: torch (no GEMV: they take bf16 activations" in fp32.describe()

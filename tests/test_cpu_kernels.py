"""kernels/cpu: the hand-written matmuls for small batches, on whichever build runs here
(WORKBENCH_ISA=avx2 or default runs the lower builds on an AVX-512 machine).

Every op is checked against the exact product of the same inputs (fp64, so each bound below is
the kernel's error alone) for x bf16 and fp32, every weight format, and row counts on both sides
of the loops' limits (torch's kernels above them). The bounds:
- fp32 y: the worst case of a K-term fp32 sum (Higham's gamma_K), K 2^-24 (|x| @ |w|.T), plus a
  few roundings for the scale, aten's dequantization and its zero point ((K + 4) 2^-24 in all);
- INT4 adds x rounded to 16 bits per 128-element chunk on the integer loops (int4_chunk in
  gemv.cpp): |error| <= max|x_chunk| / 65534 per element, times |scale q| summed;
- bf16 y: that, plus one bf16 step of the exact value (a single rounding of the fp32 sum).
Then the engine: the same greedy tokens with and without the kernels, eager and compiled.
"""
import pytest
import torch
import torch.nn.functional as F

from workbench.kernels.cpu import MAX_ROWS, available
from workbench import LLM, SamplingParams
from workbench.config import EngineConfig, plan_kernels

OK, WHY = available()
needs_kernels = pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable: {WHY}")
SHAPES = [(960, 576), (577, 1536), (13, 40), (4, 33), (7, 130)]   # real layers, odd N, K tails
ROWS = [1, 2, 3, 8, 13, 64, 80, 400]  # 13: tiles of 5 + 4 + 4; 80, 400: above the fp32 loops
X_DTYPES = [torch.bfloat16, torch.float32]
U = 2.0 ** -24                                                    # fp32 unit roundoff


def fp32_sum_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(K + 4) u (|x| @ |w|.T): a K-term fp32 dot product's worst error, plus a few roundings."""
    return (x.shape[1] + 4) * U * (x.double().abs() @ w.double().abs().t())


def assert_close(out: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    """|out - exact| <= bound, plus one bf16 step of |exact| when out is bf16."""
    exact = exact.double()
    allowance = bound.double() + 1e-30
    if out.dtype == torch.bfloat16:
        allowance = allowance + torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) - 7)
    worst = ((out.double() - exact).abs() / allowance).max().item()
    assert worst <= 1.0, f"an output is {worst:.2f} allowances away from the exact product"


def inputs(rows, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g).to(dtype), g


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=["x_bf16", "x_fp32"])
def test_bf16_weights_give_the_exact_product(x_dtype, rows, n, k):
    x, g = inputs(rows, n, k, x_dtype, rows * 1000 + n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    out = torch.ops.workbench_cpu.linear_bf16(x, w)
    assert out.dtype == x_dtype and out.shape == (rows, n)
    assert_close(out, x.double() @ w.double().t(), fp32_sum_bound(x, w))
    if x_dtype == torch.bfloat16:
        same_as_torch = (out == F.linear(x, w)).float().mean().item()
        assert same_as_torch > 0.95 if rows <= MAX_ROWS else same_as_torch == 1.0


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_fp32_weights_give_the_exact_product(rows, n, k):
    x, g = inputs(rows, n, k, torch.float32, rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    for out in (torch.ops.workbench_cpu.linear_fp32(x, w), torch.ops.workbench_cpu.linear_bf16(x, w)):
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        assert_close(out, x.double() @ w.double().t(), fp32_sum_bound(x, w))


@needs_kernels
def test_bf16_batches_above_the_small_path_are_torchs_own_result():
    x = torch.randn(MAX_ROWS + 1, 576).bfloat16()
    w = (torch.randn(64, 576) * 0.05).bfloat16()
    assert torch.equal(torch.ops.workbench_cpu.linear_bf16(x, w), F.linear(x, w))


@needs_kernels
def test_bad_inputs_are_named():
    w = torch.randn(8, 64).bfloat16()
    with pytest.raises(RuntimeError, match=r"x must be a contiguous \(M, 64\) bf16 or fp32"):
        torch.ops.workbench_cpu.linear_bf16(torch.randn(1, 64).double(), w)
    with pytest.raises(RuntimeError, match=r"x must be a contiguous \(M, 64\) bf16 or fp32"):
        torch.ops.workbench_cpu.linear_bf16(torch.randn(1, 63).bfloat16(), w)
    with pytest.raises(RuntimeError, match=r"x and w must be 2-D"):
        torch.ops.workbench_cpu.linear_bf16(torch.randn(64).bfloat16(), w)
    with pytest.raises(RuntimeError, match=r"fp32 w needs fp32 x"):
        torch.ops.workbench_cpu.linear_bf16(torch.randn(1, 64).bfloat16(), w.float())
    with pytest.raises(RuntimeError, match=r"w must be contiguous fp32"):
        torch.ops.workbench_cpu.linear_fp32(torch.randn(1, 64), w)
    with pytest.raises(RuntimeError, match=r"w must be contiguous bf16"):
        torch.ops.workbench_cpu.linear_bf16(torch.randn(1, 64), w.half())


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=["x_bf16", "x_fp32"])
def test_int8_weights_give_the_exact_product(x_dtype, rows, n, k):
    """Weight-only INT8, one scale per output row (in x's dtype, as Int8Linear keeps it): fp32
    sums times the scale, rounded once, as aten's _weight_int8pack_mm computes (which crashes on
    2+ rows when K % 16 != 0, so those shapes run the loop at every row count)."""
    x, g = inputs(rows, n, k, x_dtype, rows * 1000 + n + k)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) * 0.01 + 1e-3).to(x_dtype)
    out = torch.ops.workbench_cpu.linear_int8(x, w, scale)
    assert out.dtype == x_dtype and out.shape == (rows, n)
    w_exact = w.double() * scale.double()[:, None]
    assert_close(out, x.double() @ w_exact.t(), fp32_sum_bound(x, w_exact))
    if k % 16 == 0 and x_dtype == torch.bfloat16:
        aten = torch.ops.aten._weight_int8pack_mm(x, w, scale)
        assert (out == aten).float().mean().item() > 0.95


@needs_kernels
def test_int8_bad_inputs_are_named():
    w = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match=r"scale must be a contiguous \(8,\) bf16 or fp32"):
        torch.ops.workbench_cpu.linear_int8(x, w, torch.ones(8).double())
    with pytest.raises(RuntimeError, match=r"scale must be a contiguous \(8,\) bf16 or fp32"):
        torch.ops.workbench_cpu.linear_int8(x, w, torch.ones(7).bfloat16())
    with pytest.raises(RuntimeError, match=r"w must be contiguous int8"):
        torch.ops.workbench_cpu.linear_int8(x, w.float(), torch.ones(8).bfloat16())


def int4_layer(n, k, group, dtype, g):
    from workbench.layers.formats import quantize_int4
    from workbench.layers.linear import Int4Linear
    return Int4Linear(quantize_int4(torch.randn(n, k, generator=g) * 0.05, group), dtype)


def int4_exact_and_bound(layer, x, group, loops):
    """The exact product with the layer's weight (q * scale + minimum, fp64) and its bound: fp32
    sums, plus where the loops ran, x rounded to 16 bits per chunk of 128 columns."""
    n = layer.packed.shape[0]
    codes = layer.as_weight().codes().double().view(n, -1, group)
    scale = layer.scale.double()[..., None]
    w = (codes * scale + layer.minimum.double()[..., None]).view(n, -1)
    xd = x.double()
    if not loops:                 # the weight widened to fp32 (or aten's kernel): x not rounded
        return xd @ w.t(), fp32_sum_bound(x, w)
    rows, k = x.shape
    kp = -(-k // 128) * 128       # small groups leave a partial last chunk
    chunk_max = F.pad(xd.abs(), (0, kp - k)).view(rows, -1, 128).amax(-1, keepdim=True)
    chunk_max = chunk_max.expand(-1, -1, 128).reshape(rows, kp)[:, :k]
    x_rounding = chunk_max / 65534 @ (codes * scale).view(n, -1).abs().t()
    return xd @ w.t(), fp32_sum_bound(x, w) + x_rounding


INT4_SHAPES = [(960, 576, 128), (576, 1536, 128), (48, 130, 128), (64, 1024, 256),
               (960, 576, 32), (64, 1024, 64), (32, 200, 8)]   # groups below 128: lane scales
MAX_ROWS_FP32_INT4 = 64           # fp32 x: the loops up to this many rows, a GEMM above


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k,group", INT4_SHAPES)
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.bfloat16),
                                              (torch.float32, torch.float32),
                                              (torch.float32, torch.bfloat16)],
                         ids=["x_bf16", "x_fp32", "x_fp32-scale_bf16"])
def test_int4_weights_give_the_exact_product(x_dtype, w_dtype, rows, n, k, group):
    """Group-wise INT4 (scale and minimum in w_dtype): within the bound of the exact product of x
    and the layer's weight; bf16 x above the loop's rows is aten's very result. x may come
    unpadded (k columns) or padded to whole groups, with the same result."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    layer = int4_layer(n, k, group, w_dtype, g)
    unpadded = torch.randn(rows, k, generator=g).to(x_dtype)
    x = layer._pad(unpadded).contiguous()
    aten_packed, _, aten_scale_zero = layer._aten_pack(w_dtype)
    out = torch.ops.workbench_cpu.linear_int4(x, layer.packed, layer.scale, layer.minimum, group,
                                              aten_packed, aten_scale_zero)
    assert out.dtype == x_dtype and out.shape == (rows, n)
    out_unpadded = torch.ops.workbench_cpu.linear_int4(unpadded, layer.packed, layer.scale,
                                                       layer.minimum, group, aten_packed,
                                                       aten_scale_zero)
    aten_runs = x_dtype == torch.bfloat16 and rows > MAX_ROWS and group in (32, 64, 128, 256)
    loops = rows <= (MAX_ROWS if x_dtype == torch.bfloat16 else MAX_ROWS_FP32_INT4)
    exact, bound = int4_exact_and_bound(layer, x, group, loops)
    if aten_runs:
        aten = torch.ops.aten._weight_int4pack_mm_for_cpu(x, aten_packed, group, aten_scale_zero)
        assert torch.equal(out, aten) and torch.equal(out_unpadded, aten)
    else:
        assert_close(out, exact, bound)
        assert_close(out_unpadded, exact, bound)      # fp32 GEMM above 64 rows: another K


class RowInvariant:
    """The kernels' row-invariant mode on this thread, restored on exit."""

    def __enter__(self):
        self.previous = torch.ops.workbench_cpu.set_row_invariant(True)

    def __exit__(self, *exc):
        torch.ops.workbench_cpu.set_row_invariant(self.previous)


def row_invariant_ops(x_dtype, n, k, g):
    """(name, f(x) -> y) for every weight format the loops take with x_dtype."""
    w = torch.randn(n, k, generator=g) * 0.05
    q = (w / (w.abs().amax(1, keepdim=True) / 127)).round().to(torch.int8)
    scale = (w.abs().amax(1) / 127).to(x_dtype)
    layer = int4_layer(n, k, 128, torch.bfloat16 if x_dtype == torch.bfloat16 else torch.float32, g)
    aten_packed, _, aten_scale_zero = layer._aten_pack(layer.scale.dtype)
    ops = [("bf16 w", lambda x: torch.ops.workbench_cpu.linear_bf16(x, w.bfloat16())),
           ("int8 w", lambda x: torch.ops.workbench_cpu.linear_int8(x, q, scale)),
           ("int4 w", lambda x: torch.ops.workbench_cpu.linear_int4(
               x, layer.packed, layer.scale, layer.minimum, 128, aten_packed, aten_scale_zero))]
    if x_dtype == torch.float32:
        ops.append(("fp32 w", lambda x: torch.ops.workbench_cpu.linear_fp32(x, w)))
    return ops


@needs_kernels
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=["x_bf16", "x_fp32"])
def test_row_invariant_mode_gives_each_row_the_same_bits_at_every_row_count(x_dtype):
    """batch_invariant=True's kernels: a row's output is bit for bit the same alone and inside
    batches of every size, on both sides of every switch to torch's GEMM (2, 16, 64 rows); and
    outside the mode it is not always (else the mode would be a no-op and this test could not
    fail)."""
    n, k = 592, 1536                  # N % 16 == 0: aten's INT4 layout needs it
    g = torch.Generator().manual_seed(7)
    batch = torch.randn(96, k, generator=g).to(x_dtype)
    for name, op in row_invariant_ops(x_dtype, n, k, g):
        with RowInvariant():
            alone = torch.cat([op(batch[i:i + 1]) for i in range(96)])
            for rows in (2, 3, 5, 16, 17, 64, 65, 96):
                assert torch.equal(op(batch[:rows]), alone[:rows]), (name, rows)
        assert torch.ops.workbench_cpu.set_row_invariant(False) is False   # restored
        default_alone = torch.cat([op(batch[i:i + 1]) for i in range(96)])
        assert not torch.equal(op(batch), default_alone), (
            name, "the default mode gives every row the same bits alone and among 96")


@needs_kernels
def test_int4_bad_inputs_are_named():
    g = torch.Generator().manual_seed(0)
    layer = int4_layer(32, 128, 64, torch.bfloat16, g)
    p, _, sz = layer._aten_pack(torch.bfloat16)
    with pytest.raises(RuntimeError, match="group_size must be even and divide 128, got 48"):
        torch.ops.workbench_cpu.linear_int4(torch.randn(1, 128).bfloat16(), layer.packed,
                                            layer.scale, layer.minimum, 48, p, sz)
    layer = int4_layer(32, 128, 128, torch.bfloat16, g)
    p, _, sz = layer._aten_pack(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"scale and minimum must be contiguous \(32, 1\) "
                                           r"tensors, both bf16 or both fp32"):
        torch.ops.workbench_cpu.linear_int4(torch.randn(1, 128), layer.packed, layer.scale,
                                            layer.minimum.float(), 128, p, sz)
    with pytest.raises(RuntimeError, match=r"x must be a contiguous \(M, K\) bf16 or fp32 tensor "
                                           r"with K <= 128 \(zero-padded to it\), got \[1, 136\]"):
        torch.ops.workbench_cpu.linear_int4(torch.randn(1, 136), layer.packed, layer.scale,
                                            layer.minimum, 128, p, sz)


@needs_kernels
@pytest.mark.parametrize("method, group", [("int8", None), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_quantized_engines_give_the_same_tokens_with_the_kernels(tiny_folder, method, group,
                                                                 compile):
    """INT8 layers (all of an INT8 model, the LM head of an INT4 one) and INT4 layers switch to
    the kernels and give aten's greedy tokens on the tiny model (group 128 on the INT4 loop;
    group 32 on aten's INT4 kernel there too, bf16 x)."""
    from workbench.models.cpu_gemv import Int4GemvLinear, Int8GemvLinear
    kwargs = dict(model=str(tiny_folder), dtype="bfloat16", device="cpu", verbose=False,
                  max_model_len=64, quantization=method, compile=compile,
                  quantization_config={"group_size": group} if group else None)
    on, off = LLM(cpu_gemv=True, **kwargs), LLM(cpu_gemv=False, **kwargs)
    assert isinstance(on.engine.model.lm_head, Int8GemvLinear)
    assert not isinstance(off.engine.model.lm_head, Int8GemvLinear)
    int4_layers = isinstance(on.engine.model.layers[0].mlp.down_proj, Int4GemvLinear)
    assert int4_layers == (method == "int4")
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
    summation order can, e.g. another batch size.) Compiled, the kernels run inside the graph and
    are compared with torch's eager kernels (a second compilation would add a minute, no coverage)."""
    llms = {on: LLM(model="smollm2-135m", dtype="bfloat16", device="cpu", verbose=False,
                    max_model_len=256, cpu_gemv=on, **(kwargs if on else {})) for on in (True, False)}
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
    with pytest.raises(ValueError, match=r"fused_decode=True is invalid here: batch_invariant"):
        EngineConfig(fused_decode=True, device="cpu", batch_invariant=True)
    # batch_invariant keeps the loops (in their row-invariant mode), not the fused step
    inv = plan_kernels(EngineConfig(device="cpu", batch_invariant=True))
    assert inv.cpu_gemv == OK and not inv.fused_decode
    for dtype in ("float32", "bfloat16"):                 # on by default where the kernels build
        assert plan_kernels(EngineConfig(device="cpu", dtype=dtype)).cpu_gemv == OK
    off = plan_kernels(EngineConfig(device="cpu", cpu_gemv=False))
    assert not off.cpu_gemv and off.reasons["cpu_gemv"] == "switched off"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zero_rows_give_an_empty_result(dtype):
    """A step that samples no row calls the LM head on zero rows."""
    x = torch.empty(0, 576, dtype=dtype)
    assert torch.ops.workbench_cpu.linear_bf16(x, torch.randn(64, 576).bfloat16()).shape == (0, 64)
    w8, s8 = torch.randint(-9, 9, (64, 576), dtype=torch.int8), torch.rand(64).bfloat16()
    assert torch.ops.workbench_cpu.linear_int8(x, w8, s8).shape == (0, 64)


@needs_kernels
def test_the_engine_says_which_matmuls_it_runs(tiny_folder):
    from workbench.kernels.cpu import best_isa
    from workbench.models.cpu_gemv import GemvLinear
    for dtype in ("bfloat16", "float32"):
        llm = LLM(model=str(tiny_folder), dtype=dtype, device="cpu", verbose=False, max_model_len=64)
        assert all(isinstance(layer.mlp.down_proj, GemvLinear) for layer in llm.engine.model.layers)
        assert f"matmuls: kernels/cpu {best_isa()} loops" in llm.describe()
    off = LLM(model=str(tiny_folder), dtype="bfloat16", device="cpu", verbose=False,
              max_model_len=64, cpu_gemv=False)
    assert not any(isinstance(layer.mlp.down_proj, GemvLinear) for layer in off.engine.model.layers)
    assert "matmuls: torch (cpu_gemv off: switched off)" in off.describe()


def test_auto_dtype_reads_bf16_weights_on_every_cpu():
    """dtype="auto" reads bf16 weights on CPU whatever the CPU: with bf16 activations where bf16
    is native, with fp32 activations elsewhere; an explicit dtype keeps its own weights."""
    from workbench.config import cpu_has_native_bf16
    auto = plan_kernels(EngineConfig(device="cpu", dtype="auto"))
    assert auto.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    assert auto.weight_dtype == (torch.bfloat16 if auto.cpu_gemv else auto.dtype)
    assert plan_kernels(EngineConfig(device="cpu", dtype="float32")).weight_dtype == torch.float32
    no_loops = plan_kernels(EngineConfig(device="cpu", dtype="auto", cpu_gemv=False))
    assert no_loops.weight_dtype == auto.dtype


@needs_kernels
def test_bf16_weights_with_fp32_activations_match_a_bf16_rounded_fp32_model(tiny_folder):
    """store_weights_bf16 rounds the projections and the (untied) head to bf16 and leaves the
    embedding table fp32: the greedy tokens are those of the fp32 model with the same rounded
    weights on torch's kernels, and a decode step reads half the projection bytes."""
    from workbench.models.cpu_gemv import GemvLinear, store_weights_bf16
    kwargs = dict(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
                  max_model_len=64)
    ours, ref = LLM(**kwargs), LLM(cpu_gemv=False, **kwargs)
    model = ours.engine.model
    before = model.weight_bytes()
    n = store_weights_bf16(model)
    gemv = [m for m in model.modules() if isinstance(m, GemvLinear)]
    assert n == len(gemv) > 0 and all(m.weight.dtype == torch.bfloat16 for m in gemv)
    assert model.embed_tokens.weight.dtype == torch.float32 and model.norm.weight.dtype == torch.float32
    assert model.weight_bytes() < 0.6 * before
    for m in list(ref.engine.model.modules()):
        if type(m) is torch.nn.Linear:
            m.weight = torch.nn.Parameter(m.weight.detach().bfloat16().float(), requires_grad=False)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42]]
    params = SamplingParams(temperature=0, max_tokens=8)
    assert ([o.outputs[0].token_ids for o in ours.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in ref.generate(prompts, params)])


@needs_kernels
def test_num_parameters_counts_a_tied_head_once_whatever_copy_the_kernels_keep(tiny_folder):
    """An fp32 engine over bf16 weights (store_weights_bf16) gives the tied LM head its own bf16
    copy; the model still has the parameters of its checkpoint, as transformers counts them."""
    from conftest import hf_model

    from workbench.models.cpu_gemv import store_weights_bf16
    published = hf_model(tiny_folder).num_parameters()
    llm = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False, max_model_len=64)
    model = llm.engine.model
    assert model.args.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight
    assert model.num_parameters() == published
    store_weights_bf16(model)
    assert model.lm_head.weight is not model.embed_tokens.weight               # the head's copy
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.num_parameters() == published


@needs_kernels
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_products_autograd_records_take_torchs_linear(w_dtype):
    """The kernels have no backward: with x or the weight requiring grad (training through a
    frozen engine layer, experiments/cla_distill.py) a GemvLinear computes torch's linear in x's dtype,
    and the gradients are those of F.linear."""
    from workbench.models.cpu_gemv import GemvLinear
    g = torch.Generator().manual_seed(0)
    layer = GemvLinear(64, 32, bias=False)
    layer.weight = torch.nn.Parameter(torch.randn(32, 64, generator=g).to(w_dtype),
                                      requires_grad=False)
    x = torch.randn(3, 64, generator=g, requires_grad=True)
    assert not layer.runs_loops(x)
    out = layer(x)
    out.square().sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    F.linear(x_ref, layer.weight.float()).square().sum().backward()
    assert out.dtype == torch.float32 and torch.equal(x.grad, x_ref.grad)
    with torch.no_grad():            # inference keeps the kernels
        assert layer.runs_loops(x)
    layer.weight.requires_grad_(True)
    assert not layer.runs_loops(x.detach())


@needs_kernels
def test_auto_dtype_engine_says_what_it_stores(tiny_folder):
    from workbench.config import cpu_has_native_bf16
    llm = LLM(model=str(tiny_folder), device="cpu", verbose=False, max_model_len=64)
    text = llm.describe()
    if cpu_has_native_bf16():
        assert llm.engine.weights_stored_bf16 == 0 and "bfloat16 (auto" in text
    else:
        assert llm.engine.dtype == torch.float32 and llm.engine.weights_stored_bf16 > 0
        assert "layers' weights in bf16" in text

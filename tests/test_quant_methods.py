"""GPTQ, AWQ and SmoothQuant: unit checks of their math on small matrices, folding checks on the
real model in fp32, and SmoothQuant's W8A8 on the real SmolLM2 in the machine's dtype (bf16 where
native, else fp32): close to the reference, and closer than the same format without smoothing.
That GPTQ and AWQ move SmolLM2's next-token distributions less than round-to-nearest INT4 is
chapter 02's claim (its table of every method, asserted at SMOKE and full size); their engines
generate under continuous batching in tests/test_quant_engine.py.

Quality is mean KL(reference || candidate) over every position of held-out windows (pydoc topics
disjoint from the calibration topics, quant/calibration.py), from one prefill per window through
quant.forward.prefill_logprobs, plus top-1 agreement. The LM head is INT8 by round-to-nearest in
every method (quant/apply.py). The SmoothQuant model is built with the engine's own plumbing,
LLM(quantization=...), and the numbers are printed (pytest -s).
"""
from __future__ import annotations

import copy

import pytest
import torch

from workbench.kernels.reference import rms_norm_reference
from workbench import LLM
from workbench.models.loader import load_model, resolve_checkpoint
from workbench.quant.apply import QuantConfig, quantize_model
from workbench.quant.awq import search_scale
from workbench.quant.calibration import calibration_windows, heldout_windows
from workbench.layers.formats import quantize_int4
from workbench.quant.forward import prefill_hidden, prefill_logprobs
from workbench.quant.gptq import LayerwiseRunner, gptq_quantize_weight
from workbench.layers.linear import W8A8Linear
from workbench.quant.smoothquant import (LayerWeights, collect_input_stats, fold_scales,
                                         gqa_shared, input_channel_max,
                                         previous_op_weight_absmax, smoothing_scales)

GROUP_SIZE = 128
WINDOW_LEN = 128
NUM_CALIBRATION = 16     # 2048 calibration tokens
NUM_HELDOUT = 6          # 768 held-out positions
QUANT_CONFIG = {"group_size": GROUP_SIZE, "num_calibration_windows": NUM_CALIBRATION,
                "calibration_window_len": WINDOW_LEN}
# "auto": bf16 where native, fp32 where the CPU would emulate bf16 (slow).
ENGINE = dict(dtype="auto", device="cpu", verbose=False, max_model_len=512, max_num_seqs=4)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for this module. On a shared, oversubscribed 2-core machine a prefill
    with 2 threads runs many times slower than with 1, and unevenly: every small op's parallel
    region waits for a descheduled thread (`python -m pytest tests/test_quant_methods.py
    --durations=5` times the tests). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- small matrices
def correlated_inputs(tokens: int, k: int, seed: int) -> torch.Tensor:
    """Inputs with correlated channels and a spread of channel magnitudes (a few large), the
    structure that makes the Hessian matter."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    magnitude = torch.rand(k, generator=g) * 2 + 0.1
    magnitude[torch.randperm(k, generator=g)[:4]] *= 20
    return (torch.randn(tokens, k, generator=g) @ mix) * magnitude


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_a_random_matrix(act_order):
    torch.manual_seed(0)
    n, k, tokens = 96, 320, 2048          # 320 = 2 x 128 + 64: a ragged last group
    w = torch.randn(n, k)
    x = correlated_inputs(tokens, k, seed=1)
    h = 2 * x.double().t() @ x.double() / tokens
    result = gptq_quantize_weight(w, h, group_size=GROUP_SIZE, act_order=act_order)
    q = result.weight.dequantize()
    assert q.shape == w.shape and result.weight.scale.shape == (n, 3)
    gptq_err = ((w - q) @ x.t()).pow(2).sum().item()
    rtn_err = ((w - quantize_int4(w, GROUP_SIZE).dequantize()) @ x.t()).pow(2).sum().item()
    print(f"\nrandom {n}x{k}, act_order={act_order}: output error GPTQ {gptq_err:.4g}, "
          f"RTN {rtn_err:.4g} ({gptq_err / rtn_err:.2f}x)")
    assert gptq_err < 0.8 * rtn_err
    # Each column's loss is its share of the final error: together they are the layer's error
    # under the (damped) Hessian, sum over rows of e (H + damp I) e^T / 2.
    e = (w - q).double()
    hd = h.clone()
    hd.diagonal().add_(result.damp)
    total = 0.5 * ((e @ hd) * e).sum().item()
    assert result.column_loss.sum().item() == pytest.approx(total, rel=1e-4)
    first = h.diagonal().argmax() if act_order else 0     # the first column quantized
    assert result.column_drift[first] == 0 and result.column_drift.gt(0).sum() == k - 1


def test_gptq_with_uncorrelated_inputs_is_rtn():
    """With a diagonal Hessian there is nothing to compensate: GPTQ rounds each weight to
    nearest on the same group grid as RTN."""
    torch.manual_seed(0)
    w = torch.randn(32, 256)
    h = torch.diag(torch.rand(256) + 0.5).double()
    gptq = gptq_quantize_weight(w, h, group_size=64)
    rtn = quantize_int4(w, 64)
    assert torch.equal(gptq.weight.packed, rtn.packed)
    assert torch.allclose(gptq.weight.scale, rtn.scale) and torch.equal(gptq.weight.minimum,
                                                                        rtn.minimum)


def test_gptq_rejects_a_hessian_of_the_wrong_size():
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize_weight(torch.randn(8, 64), torch.eye(32))


def test_awq_search_protects_large_channels():
    torch.manual_seed(0)
    w = torch.randn(128, 256)
    x = correlated_inputs(1024, 256, seed=2)
    found = search_scale(w, x, x.abs().mean(dim=0), group_size=GROUP_SIZE)
    assert found.alphas[0] == 0 and found.alphas[-1] == 1 and len(found.alphas) == 21
    print(f"\nAWQ search: alpha {found.alpha}, error {min(found.errors):.4g} vs RTN "
          f"{found.errors[0]:.4g}")
    assert found.alpha > 0 and min(found.errors) < 0.9 * found.errors[0]   # alpha 0 is RTN
    assert found.scale.argmax() == x.abs().mean(dim=0).argmax()


# ----------------------------------------------------------------------------- folding, fp32
@pytest.fixture(scope="module")
def smollm2_fp32():
    return load_model(resolve_checkpoint("smollm2-135m"), torch.float32, torch.device("cpu"), 512)


@pytest.fixture(scope="module")
def short_windows(smollm2_reference):
    return calibration_windows(smollm2_reference.engine.tokenizer, 2, 64)


def test_layerwise_runner_matches_the_model(smollm2_fp32, short_windows):
    """Calibration steps packed windows through the layers one at a time: the final hidden
    states are the model's own, window by window."""
    runner = LayerwiseRunner(smollm2_fp32, short_windows, max_tokens=100)  # one window per chunk
    assert len(runner.chunks) == 2 and runner.num_tokens == 128
    for i in range(len(smollm2_fp32.layers)):
        runner.run(i, advance=True)
    packed = LayerwiseRunner(smollm2_fp32, short_windows)                  # both in one chunk
    for i in range(len(smollm2_fp32.layers)):
        packed.run(i, advance=True)
    norm = smollm2_fp32.norm
    for chunks in (runner.chunks, packed.chunks):
        hidden = torch.cat([rms_norm_reference(c["x"], norm.weight, norm.eps, c["residual"])[0]
                            for c in chunks])
        expected = torch.cat([prefill_hidden(smollm2_fp32, w) for w in short_windows])
        torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind, pruned", [("random", None), ("smoothquant", None),
                                          ("random", "channels"), ("smoothquant", "heads")])
def test_folding_keeps_the_function(smollm2_fp32, short_windows, kind, pruned):
    """Scales folded into the previous ops (norms, v rows, up rows), weights left in float: the
    model computes the same logits, for random scales (AWQ's are such) and SmoothQuant's, also
    when MLP channels or query heads were pruned first (each layer's own width and head count)."""
    model = copy.deepcopy(smollm2_fp32)
    if pruned:
        from workbench.compress.structured import prune_structured
        prune_structured(model, pruned, 0.3, short_windows)
        a = model.args            # the config keeps the unpruned sizes; the layers do not
        if pruned == "channels":
            assert all(l.mlp.down_proj.in_features < a.intermediate_size for l in model.layers)
        else:
            assert any(l.self_attn.num_heads < a.num_attention_heads for l in model.layers)
        smollm2_fp32 = copy.deepcopy(model)        # the pruned model is the reference
    args = model.args
    stats = collect_input_stats(model, short_windows) if kind == "smoothquant" else None
    g = torch.Generator().manual_seed(0)
    for i, layer in enumerate(model.layers):
        w = LayerWeights.from_layer(layer)
        for target in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            k = getattr(w, target).shape[1]
            if kind == "random":
                s = torch.exp(torch.randn(k, generator=g) * 0.5)
                if target == "o_proj":
                    s = gqa_shared(s, args)
            else:
                path = ("self_attn." if target in ("qkv_proj", "o_proj") else "mlp.") + target
                s = smoothing_scales(stats[f"layers.{i}.{path}"],
                                     previous_op_weight_absmax(w, target), 0.5, target, args)
            fold_scales(w, target, s, args)
        w.write_float(layer)
    window = short_windows[0]
    before = prefill_logprobs(smollm2_fp32, window)
    after = prefill_logprobs(model, window)
    diff = (before - after).abs().max().item()
    print(f"\nfolding ({kind} scales), fp32: max |delta logprob| {diff:.2e}")
    assert diff < 2e-3
    assert torch.equal(before.argmax(-1), after.argmax(-1))


def test_o_proj_scales_must_be_shared_within_a_kv_group(smollm2_fp32):
    w = LayerWeights.from_layer(smollm2_fp32.layers[0])
    s = torch.ones(w.o_proj.shape[1])
    s[0] = 2.0       # query head 0 only: its kv head also feeds query heads 1 and 2
    with pytest.raises(ValueError, match="kv head"):
        fold_scales(w, "o_proj", s, smollm2_fp32.args)


# ----------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def smollm2_reference():
    return LLM("smollm2-135m", **ENGINE)


@pytest.fixture(scope="module")
def heldout(smollm2_reference):
    windows = heldout_windows(smollm2_reference.engine.tokenizer, NUM_HELDOUT, WINDOW_LEN)
    calibration = calibration_windows(smollm2_reference.engine.tokenizer, NUM_CALIBRATION, WINDOW_LEN)
    assert not {tuple(w) for w in windows} & {tuple(w) for w in calibration}
    return windows, [prefill_logprobs(smollm2_reference.engine.model, w) for w in windows]


def mean_kl_top1(model, heldout) -> tuple[float, float]:
    """Mean KL(reference || model) over the held-out positions, fp32, and top-1 agreement."""
    windows, refs = heldout
    kls, agree = [], 0
    for window, ref in zip(windows, refs):
        cand = prefill_logprobs(model, window)
        kls.append((ref.exp() * (ref - cand)).sum(-1))
        agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
    kl = torch.cat(kls)
    return kl.mean().item(), agree / kl.numel()


def test_smoothquant_w8a8_is_close_and_smoothing_helps(smollm2_reference, heldout):
    """W8A8 with smoothing stays close to the reference (INT8 LM head included); the bounds leave
    room for noise, not for a broken method. The same W8A8 format without smoothing (per-token
    INT8 activations as they come) has clearly more KL. `python -m pytest -s
    tests/test_quant_methods.py -k smoothing_helps` prints both measurements."""
    smoothed = LLM("smollm2-135m", quantization="smoothquant", quantization_config=QUANT_CONFIG,
                   **ENGINE)
    kl, top1 = mean_kl_top1(smoothed.engine.model, heldout)
    assert kl < 0.04
    assert top1 > 0.88
    plain = copy.deepcopy(smollm2_reference.engine.model)
    cfg = QuantConfig.from_args("smoothquant", {**QUANT_CONFIG, "smoothquant_targets": []})
    tokenizer = smollm2_reference.engine.tokenizer
    quantize_model(plain, cfg, calibration_windows(tokenizer, NUM_CALIBRATION, WINDOW_LEN))
    assert isinstance(plain.layers[0].mlp.down_proj, W8A8Linear)
    kl_plain, top1_plain = mean_kl_top1(plain, heldout)
    print(f"\nW8A8 without smoothing: mean KL {kl_plain:.4f}, top-1 {top1_plain:.3f}; "
          f"SmoothQuant {kl:.4f}, {top1:.3f}")
    assert kl < 0.7 * kl_plain


def test_input_channel_max_shows_outliers(smollm2_reference, short_windows):
    """What SmoothQuant is about, on a real layer: a few input channels far above the rest (here
    one of SmolLM2's 'massive activations', measured ~5900x the median channel)."""
    model = smollm2_reference.engine.model
    amax = input_channel_max(model, short_windows, "layers.11.mlp.down_proj")
    assert amax.shape == (model.args.intermediate_size,)
    ratio = (amax.max() / amax.median()).item()
    print(f"\nlayers.11.mlp.down_proj input: max |x_j| {amax.max():.1f} (channel "
          f"{amax.argmax().item()}), median {amax.median():.2f} ({ratio:.0f}x)")
    assert ratio > 100
    with pytest.raises(ValueError, match="unknown projection"):
        input_channel_max(model, short_windows, "layers.11.mlp.up_proj")

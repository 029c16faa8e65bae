"""SparseGPT joint with INT4 (compress/pruning.py sparsegpt_quantize_weight): pruning and GPTQ's
rounding in one column loop, zeros kept exact, better than quantizing after pruning."""
import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.compress.pruning import (PruneConfig, prune_model, sparsegpt_prune_weight,
                                        sparsegpt_quantize_weight, zero_point_grid)
from workbench.layers.formats import quantize_int4
from workbench.quant.gptq import gptq_quantize_weight
from workbench.layers.linear import Int4Linear
from test_pruning import correlated_inputs, hessian


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_zero_point_grid_holds_zero_and_the_range(dtype):
    span = torch.cat([torch.tensor([[-0.3, 0.2, 0.5], [0.7, 0.4, 0.9], [0.1, -0.2, 0.6]]),
                      torch.randn(3, 3)], dim=0)
    span = torch.cat([span, torch.randn(6, 500)], dim=1)
    scale, minimum = zero_point_grid(span, dtype)
    s, m = scale.to(dtype), minimum.to(dtype)
    assert torch.equal(s.float(), scale) and torch.equal(m.float(), minimum)   # stored exactly
    zero = -m.float() / s.float()
    assert torch.equal(zero, zero.round()) and set(zero.unique().tolist()) <= {0, 1, 2, 4, 8}
    assert torch.equal(zero * s.float() + m.float(), torch.zeros_like(scale))   # 0 is a grid point
    lo, hi = span.amin(0).clamp(max=0), span.amax(0).clamp(min=0)
    assert (minimum <= lo + 1e-6).all() and (minimum + 15 * scale >= hi - 1e-6).all()
    free = (hi - lo) / 15
    ratio = (scale / free).median().item()
    assert ratio < 1.25, f"the step should stay near the free grid's, got {ratio:.2f}x"


@pytest.mark.parametrize("n_m", [None, (2, 4)])
def test_joint_pruning_and_int4_keeps_exact_zeros_and_beats_pruning_then_rounding(n_m):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 192, generator=g)          # 192 = 1.5 groups of 128: a ragged group too
    x = correlated_inputs(768, 192, 8)
    h = hessian(x)
    q, keep = sparsegpt_quantize_weight(w, h, 0.5, n_m, group_size=128, block_size=128)
    dq = q.dequantize()
    assert (dq[~keep] == 0).all(), "every pruned weight is an exact zero"
    assert (dq[keep] == 0).float().mean() < 0.1   # a kept weight rounds to 0 only when near it
    if n_m is None:
        assert int(keep.sum()) == w.numel() // 2
    else:
        assert ((keep.reshape(64, -1, 4).sum(-1)) == 2).all()

    def err(v):
        return ((w - v) @ x.t()).norm().item()
    pruned = sparsegpt_prune_weight(w, h, 0.5, n_m, block_size=128)[0]
    rounded = quantize_int4(pruned, 128).dequantize()
    # GPTQ after pruning compensates into the pruned weights: no zeros survive
    gptq_after = gptq_quantize_weight(pruned, h, 128).weight.dequantize()
    assert (gptq_after == 0).float().mean() < 0.2
    assert err(dq) < err(rounded), (err(dq), err(rounded))
    assert err(dq) < 1.3 * err(pruned), "INT4 on top of 50% should add a fraction of the error"


def test_the_engine_prunes_and_quantizes_sparsegpt_with_gptq_in_one_pass():
    cal = {"num_calibration_windows": 2, "calibration_window_len": 32}
    llm = LLM(model="random:tiny", dtype="float32", verbose=False, pruning="sparsegpt",
              pruning_config={"pattern": "2:4", **cal}, quantization="gptq",
              quantization_config=cal)
    model = llm.engine.model
    layers = [getattr(getattr(layer, o), a) for layer in model.layers
              for o, a in (("self_attn", "qkv_proj"), ("mlp", "down_proj"))]
    assert all(isinstance(m, Int4Linear) for m in layers)
    for m in layers:                              # the stored INT4 weights still follow 2:4
        w = m.dequantize(torch.float32)
        assert ((w != 0).reshape(w.shape[0], -1, 4).sum(-1) <= 2).all()
    assert llm.engine.quantization == "gptq" and "sparsegpt 2:4" in llm.describe()
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="only 'sparsegpt' walks the columns"):
        prune_model(model, PruneConfig.from_args("wanda", None), [[1, 2, 3]], int4_group_size=128)

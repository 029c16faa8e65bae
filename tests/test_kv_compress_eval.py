"""The KV compression harness: its forward is the engine's forward exactly, each method does what
it says (sharing ignores the sharing layer's own K/V, full-rank keys change nothing), plans and
maps have exact layer ids, and the table's bytes are the engine's."""
from __future__ import annotations

import pytest
import torch

from workbench import LLM
from workbench.experiments.kv_compression import (
    KVTransform, bytes_per_token, calibrate_key_bases, compression_table, depth_plans,
    layer_sensitivity, ranked_plans, sharing_map, window_nll)
from workbench.kv.paged_cache import kv_bytes_per_token
from workbench.quant.calibration import calibration_windows, heldout_windows
from workbench.experiments.quality import nll, window_logprobs


@pytest.fixture(scope="module")
def mha():
    """Three layers, so that a plan can give each of them another format."""
    return LLM(model="random:tiny-mha", dtype="float32", device="cpu", verbose=False,
               max_model_len=128)


@pytest.fixture(scope="module")
def window(mha):
    return heldout_windows(mha.engine.tokenizer, 1, 48)[0]


@pytest.mark.parametrize("plan", ["auto", "int8", ["auto", "int8", "int4"], ["int4", "fp8", "auto"]])
def test_harness_forward_is_the_engines(window, plan):
    """The harness's layer-by-layer prefill gives the engine's own negative log-likelihoods bit
    for bit, for a single format and for per-layer plans."""
    llm = LLM(model="random:tiny-mha", dtype="float32", device="cpu", verbose=False,
              max_model_len=128, kv_cache_dtype=plan)
    engine_nll = nll(window_logprobs(llm, window), window)
    assert torch.equal(window_nll(llm.engine.model, window, KVTransform(plan)), engine_nll)


def test_sharing_maps_have_exact_layer_ids():
    assert sharing_map(6, 2) == [0, 0, 2, 2, 4, 4]
    assert sharing_map(7, 3) == [0, 0, 0, 3, 3, 3, 6]
    assert sharing_map(6, 2, first_layer=3) == [0, 1, 2, 3, 3, 5]
    assert sharing_map(4, 1) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="group=0, first_layer=0 is invalid"):
        sharing_map(4, 0)


def test_a_sharing_layer_ignores_its_own_keys_and_values(mha, window):
    """With layer 1 reading layer 0's K/V, layer 1's K/V projections no longer matter; without
    sharing they do. Group size 1 is the plain forward exactly."""
    model = mha.engine.model
    shared = KVTransform(share_from=[0, 0, 2])
    assert torch.equal(window_nll(model, window, KVTransform(share_from=[0, 1, 2])),
                       window_nll(model, window))
    before, plain = window_nll(model, window, shared), window_nll(model, window)
    attn = model.layers[1].self_attn
    w = attn.qkv_proj.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w[attn.q_size:] *= -3.0                       # layer 1's K and V rows only
        assert torch.equal(window_nll(model, window, shared), before)
        assert not torch.equal(window_nll(model, window), plain)
    finally:
        with torch.no_grad():
            w.copy_(saved)


def test_bytes_count_stored_rows_only(mha):
    args, f32 = mha.engine.model_args, torch.float32
    heads, d, n = args.num_key_value_heads, args.head_dim, args.num_hidden_layers
    assert bytes_per_token(args, f32, KVTransform()) == kv_bytes_per_token(args, f32)
    plan = ["auto", "int8", "int4"]
    assert bytes_per_token(args, f32, KVTransform(plan)) == kv_bytes_per_token(args, f32, plan)
    # layers 0 and 1 share: two layers store
    assert bytes_per_token(args, f32, KVTransform(share_from=[0, 0, 2])) == 2 * 2 * heads * d * 4
    bases = [torch.zeros(heads, d, 5) for _ in range(n)]
    # keys as 5 fp32 coefficients, values whole
    assert bytes_per_token(args, f32, KVTransform(key_bases=bases)) == n * heads * (5 + d) * 4


def test_key_bases_are_orthonormal_and_full_rank_changes_nothing(mha, window):
    model, args = mha.engine.model, mha.engine.model_args
    calib = calibration_windows(mha.engine.tokenizer, 2, 48)
    assert all(w != window for w in calib)            # calibrated on other text
    bases = calibrate_key_bases(model, calib, [4, args.head_dim])
    eye = torch.eye(4)
    assert len(bases[4]) == args.num_hidden_layers
    for b in bases[4]:
        assert b.shape == (args.num_key_value_heads, args.head_dim, 4)
        assert torch.allclose(b.transpose(1, 2) @ b, eye.expand(b.shape[0], 4, 4), atol=1e-5)
    full = window_nll(model, window, KVTransform(key_bases=bases[args.head_dim]))
    assert torch.allclose(full, window_nll(model, window), atol=1e-4)
    assert not torch.allclose(window_nll(model, window, KVTransform(key_bases=bases[4])),
                              window_nll(model, window), atol=1e-4)
    with pytest.raises(ValueError, match=r"rank=0 is invalid: it must be an integer in \[1, "):
        calibrate_key_bases(model, calib, [0])


def test_plans_from_a_ranking_have_exact_layers_and_equal_bytes():
    sens = [0.1, 3.0, 0.5, 2.0]
    assert ranked_plans(sens, [2])[2] == ["int4", "int8", "int4", "int8"]
    assert depth_plans(4, [0, 2])[2] == ["int8", "int8", "int4", "int4"]
    assert depth_plans(4, [0])[0] == ["int4"] * 4
    with pytest.raises(ValueError, match=r"counts=\[5\] is invalid"):
        depth_plans(4, [5])


def test_sensitivity_and_table_on_a_tiny_model(mha):
    model = mha.engine.model
    windows = heldout_windows(mha.engine.tokenizer, 1, 32)
    sens = layer_sensitivity(model, windows, "int4")
    assert len(sens) == 3 and all(isinstance(s, float) for s in sens)
    rows = compression_table(mha, num_windows=1, window_len=32, calibration_windows_count=1,
                             counts=(1,), ranks=(8,), groups=(2,))
    methods = [r["method"] for r in rows]
    assert methods == ["model dtype", "uniform", "uniform", "uniform", "per-layer, by depth",
                       "per-layer, by sensitivity", "cross-layer sharing", "cross-layer sharing",
                       "low-rank keys"]
    assert rows[0]["ratio"] == 1.0 and rows[0]["delta"] == 0.0
    args = mha.engine.model_args
    by_setting = {(r["method"], r["setting"]): r for r in rows}
    assert by_setting[("uniform", "int8")]["kv_bytes_per_token"] == \
        kv_bytes_per_token(args, torch.float32, "int8")
    depth = by_setting[("per-layer, by depth", "int8 x1 shallowest, int4 rest")]
    ranked = by_setting[("per-layer, by sensitivity", "int8 x1 most sensitive, int4 rest")]
    assert depth["kv_bytes_per_token"] == ranked["kv_bytes_per_token"]
    for r in rows:
        assert r["ratio"] == r["kv_bytes_per_token"] / rows[0]["kv_bytes_per_token"]
        assert r["perplexity"] > 1.0

"""Pruning (workbench/compress/): exact masks on hand-made matrices, the pattern's invariants on
random ones for every method, SparseGPT's reconstruction against the mask-only methods, the knobs'
errors; structured pruning's slicing against zeroing, Block Influence on a layer that does
nothing, and a smaller engine that still runs. The order the papers report on the real model
(Wanda and SparseGPT far below magnitude at 2:4) is chapter 09's claim, asserted at every size."""
import math
import re

import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.compress.pruning import (PruneConfig, keep_mask, sparsegpt_prune_weight,
                                        sparsity_report, storage_bytes, wanda_score)
from workbench.compress.structured import block_influence, slice_channels


def correlated_inputs(tokens: int, k: int, seed: int) -> torch.Tensor:
    """Inputs with correlated columns and a few large channels, as an LLM's are."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k // 4, generator=g) @ torch.randn(k // 4, k, generator=g)
    x[:, :3] *= 20
    return x


def hessian(x: torch.Tensor) -> torch.Tensor:
    return 2 * x.t().double() @ x.double() / x.shape[0]


def test_magnitude_keeps_each_rows_largest_weights():
    w = torch.tensor([[0.1, -4.0, 0.3, 2.0],
                      [5.0, 0.2, -0.1, -3.0]])
    assert keep_mask(w.abs(), 0.5, None).tolist() == [[False, True, False, True],
                                                      [True, False, False, True]]
    w8 = torch.tensor([[1.0, 2, 3, 4, 8, 7, 6, 5]])
    assert keep_mask(w8.abs(), 0.5, (2, 4)).tolist() == [[False, False, True, True,
                                                           True, True, False, False]]
    assert keep_mask(w8.abs(), 0.75, (1, 4)).tolist() == [[False, False, False, True,
                                                           True, False, False, False]]


def test_wanda_keeps_a_small_weight_on_a_loud_input():
    w = torch.tensor([[0.1, -4.0, 0.3, 2.0]])
    quiet = torch.ones(4)
    loud = torch.tensor([1.0, 1.0, 1e4, 1.0])       # column 2's inputs are 100x larger in norm
    assert keep_mask(wanda_score(w, quiet), 0.5, None).equal(keep_mask(w.abs(), 0.5, None))
    assert keep_mask(wanda_score(w, loud), 0.5, None).tolist() == [[False, True, True, False]]


@pytest.mark.parametrize("pattern", ["unstructured", "2:4", "4:8"])
@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_every_method_gives_exactly_its_pattern(method, pattern):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g)
    x = correlated_inputs(256, 64, 4)
    n_m = None if pattern == "unstructured" else tuple(map(int, pattern.split(":")))
    if method == "magnitude":
        out = w * keep_mask(w.abs(), 0.5, n_m)
    elif method == "wanda":
        out = w * keep_mask(wanda_score(w, x.pow(2).sum(0)), 0.5, n_m)
    else:
        out, keep = sparsegpt_prune_weight(w, hessian(x), 0.5, n_m, block_size=32)
        assert ((out != 0) <= keep).all()
    nonzero = out != 0
    if n_m is None and method != "sparsegpt":
        assert (nonzero.sum(1) == 32).all()                    # per row
    elif n_m is None:
        assert nonzero.sum() == w.numel() // 2                 # per block of columns, all rows
    else:
        n, m = n_m
        assert (nonzero.reshape(48, 64 // m, m).sum(-1) == n).all()
        storage_bytes(out, pattern)                            # raises if the pattern is broken


@pytest.mark.parametrize("n_m", [None, (2, 4)])
def test_sparsegpt_reconstructs_the_layer_output_best(n_m):
    """||(W - W') X^T|| over the calibration inputs: SparseGPT's update makes it smaller than
    keeping either mask-only method's choice."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 128, generator=g)
    x = correlated_inputs(512, 128, 6)
    errors = {
        "magnitude": w * keep_mask(w.abs(), 0.5, n_m),
        "wanda": w * keep_mask(wanda_score(w, x.pow(2).sum(0)), 0.5, n_m),
        "sparsegpt": sparsegpt_prune_weight(w, hessian(x), 0.5, n_m, block_size=64)[0],
    }
    errors = {k: ((w - v) @ x.t()).norm().item() for k, v in errors.items()}
    assert errors["sparsegpt"] < 0.8 * errors["wanda"] < 0.8 * errors["magnitude"], errors


def test_storage_bytes_of_the_compressed_forms():
    w = torch.tensor([[1.0, 0, 2, 0, 0, 3, 0, 4]], dtype=torch.bfloat16)
    sizes = storage_bytes(w, "2:4")
    assert sizes == {"dense": 16, "bitmask": 4 * 2 + 1, "csr": 4 * 6 + 8, "n_m": 4 * 2 + 1}
    with pytest.raises(ValueError, match="does not follow pattern '1:4'"):
        storage_bytes(w, "1:4")


@pytest.mark.parametrize("method, options, message", [
    ("prune", None, r"pruning='prune' is invalid: allowed are None, 'magnitude'"),
    ("wanda", {"sparsity": 1.0}, r"pruning_config\['sparsity'\]=1.0 is invalid"),
    ("wanda", {"ratio_": 0.5}, r"unknown key\(s\) \['ratio_'\]"),
    ("wanda", {"pattern": "4:2"}, r"pruning_config\['pattern'\]='4:2' is invalid"),
    ("wanda", {"pattern": "2:4", "sparsity": 0.6}, r"contradicts pattern '2:4'"),
    ("sparsegpt", {"pattern": "2:6", "sparsegpt_block_size": 128}, r"multiple of 6"),
    ("wanda", {"num_calibration_windows": 0}, r"'num_calibration_windows'\]=0 is invalid"),
])
def test_bad_options_are_named(method, options, message):
    with pytest.raises(ValueError, match=message):
        PruneConfig.from_args(method, options)
    with pytest.raises(ValueError, match=message):
        LLM(model="random:tiny", pruning=method, pruning_config=options, verbose=False)


def test_pruning_config_without_a_method_is_refused():
    with pytest.raises(ValueError, match="pruning_config is set but pruning is None"):
        LLM(model="random:tiny", pruning_config={"sparsity": 0.5}, verbose=False)


def test_a_2_4_pattern_implies_half_sparsity():
    cfg = PruneConfig.from_args("magnitude", {"pattern": "2:4"})
    assert math.isclose(cfg.sparsity, 0.5) and cfg.n_m == (2, 4)


def test_pruned_then_quantized_engine_generates():
    llm = LLM(model="random:tiny", dtype="float32", pruning="magnitude",
              pruning_config={"pattern": "2:4"}, verbose=False)
    report = sparsity_report(llm.engine.model)
    assert report and all(math.isclose(v, 0.5) for v in report.values())
    assert "pruning=magnitude 2:4" in llm.describe()
    both = LLM(model="random:tiny", dtype="float32", pruning="magnitude", quantization="int8",
               verbose=False)
    assert both.engine.quantization == "int8"
    out = both.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


# ----------------------------------------------------------------------------- structured
def test_slicing_channels_computes_what_zeroing_them_does():
    from workbench.models.llama import MLP
    args = LLM(model="random:tiny", dtype="float32", verbose=False).engine.model.args
    torch.manual_seed(0)
    mlp = MLP(args).float()
    x = torch.randn(5, args.hidden_size)
    keep = torch.tensor([0, 3, 4, 9, 17, 100])
    zeroed = MLP(args).float()
    zeroed.load_state_dict(mlp.state_dict())
    dropped = torch.ones(args.intermediate_size, dtype=torch.bool)
    dropped[keep] = False
    zeroed.down_proj.weight.data[:, dropped] = 0
    slice_channels(mlp, keep)
    assert mlp.gate_up_proj.weight.shape == (2 * len(keep), args.hidden_size)
    assert mlp.down_proj.weight.shape == (args.hidden_size, len(keep))
    torch.testing.assert_close(mlp(x), zeroed(x), rtol=1e-6, atol=1e-6)


def test_a_layer_that_changes_nothing_has_no_influence_and_goes_first():
    llm = LLM(model="random:tiny-mha", dtype="float32", verbose=False)
    model = llm.engine.model
    idle = model.layers[1]
    idle.self_attn.o_proj.weight.data.zero_()
    idle.mlp.down_proj.weight.data.zero_()       # the layer adds nothing to the residual stream
    scores = block_influence(model, [[5, 9, 11, 20, 7, 3, 8, 2]] * 2)
    assert abs(scores[1]) < 1e-6 and min(scores[0], scores[2]) > 1e-3, scores


@pytest.mark.parametrize("method", ["channels", "layers"])
def test_structured_pruning_shrinks_the_engine_which_still_generates(method):
    dense = LLM(model="smollm2-135m", dtype="float32", verbose=False, max_model_len=256,
                num_kv_blocks=64)
    small = LLM(model="smollm2-135m", dtype="float32", verbose=False, max_model_len=256,
                num_kv_blocks=64, pruning=method,
                pruning_config={"ratio": 0.25, "num_calibration_windows": 2,
                                "calibration_window_len": 64})
    model = small.engine.model
    if method == "layers":
        assert len(model.layers) == 30 - round(0.25 * 30) == 22
        assert small.engine.kv_cache_bytes == dense.engine.kv_cache_bytes * 22 // 30
    else:
        assert all(layer.mlp.down_proj.in_features == 1536 - 384 for layer in model.layers)
    assert model.num_parameters() < 0.9 * dense.engine.model.num_parameters()
    assert f"pruning={method} 25%" in small.describe()
    out = small.generate(["The capital of France is"],
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


def test_structured_options_are_their_own():
    with pytest.raises(ValueError, match=r"\['pattern'\] do not apply to pruning='layers'"):
        PruneConfig.from_args("layers", {"pattern": "2:4"})
    with pytest.raises(ValueError, match=r"\['ratio'\] do not apply to pruning='wanda'"):
        PruneConfig.from_args("wanda", {"ratio": 0.5})
    with pytest.raises(ValueError, match=r"pruning_config\['ratio'\]=1 is invalid"):
        PruneConfig.from_args("channels", {"ratio": 1})


# ----------------------------------------------------------------------------- save and load
@pytest.mark.parametrize("method, options", [("magnitude", {"pattern": "2:4"}),
                                             ("channels", {"ratio": 0.3}),
                                             ("layers", {"ratio": 0.5})])
def test_a_saved_pruned_model_loads_back_and_quantizes(tmp_path, method, options):
    cal = {} if method == "magnitude" else {"num_calibration_windows": 2,
                                            "calibration_window_len": 32}
    pruned = LLM(model="random:tiny-mha", dtype="float32", verbose=False, pruning=method,
                 pruning_config={**options, **cal})
    folder = pruned.save_pruned(tmp_path / "pruned")
    loaded = LLM(model=folder, dtype="float32", verbose=False)
    assert f"pruned checkpoint ({method})" in loaded.describe()
    a, b = pruned.engine.model.state_dict(), loaded.engine.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    same = [o.outputs[0].token_ids for o in (pruned.generate([[4, 8, 15, 16]], sp)
                                             + loaded.generate([[4, 8, 15, 16]], sp))]
    assert same[0] == same[1]
    both = LLM(model=folder, dtype="float32", verbose=False, quantization="int8")
    assert both.engine.quantization == "int8"
    assert len(both.generate([[4, 8, 15, 16]], sp)[0].outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="already pruned"):
        LLM(model=folder, verbose=False, pruning="magnitude")
    with pytest.raises(ValueError, match="save_pruned needs an unquantized model"):
        LLM(model="random:tiny-mha", verbose=False, pruning="magnitude",
            quantization="int8").save_pruned(tmp_path / "no")


def test_the_compress_bench_reports_every_column(tiny_folder):
    from workbench.bench.compress import format_table, parse_variant, run
    assert parse_variant("sparsegpt-50%") == {"pruning": "sparsegpt",
                                              "pruning_config": {"sparsity": 0.5}}
    with pytest.raises(ValueError, match="variant='wanda-half' is invalid"):
        parse_variant("wanda-half")
    assert parse_variant("layers-0.3+gkd") == {"pruning": "layers", "pruning_config": {"ratio": 0.3},
                                               "distill": "gkd"}
    assert parse_variant("heads-0.25+kd")["pruning"] == "heads"
    assert parse_variant("smoothquant-static") == {
        "quantization": "smoothquant", "quantization_config": {"smoothquant_activations": "static"}}
    assert parse_variant("sparsegpt-2:4-gptq") == {
        "pruning": "sparsegpt", "pruning_config": {"pattern": "2:4"}, "quantization": "gptq"}
    with pytest.raises(ValueError, match="'-gptq' follows a mask variant"):
        parse_variant("layers-0.3-gptq")
    for bad in ("wanda-2:4+kd", "layers-0.3+mse"):
        with pytest.raises(ValueError, match=re.escape(f"variant={bad!r} is invalid: distil a structured")):
            parse_variant(bad)
    # Its plumbing on the tiny model; `python -m workbench.bench compress` measures SmolLM2.
    r = run(variants=("magnitude-2:4", "layers-0.3"), num_windows=1, window_len=32, repeats=1,
            model=str(tiny_folder))
    rows = {row["variant"]: row for row in r["rows"]}
    assert list(rows) == ["dense", "magnitude-2:4", "layers-0.3"]
    assert abs(rows["magnitude-2:4"]["zero_fraction"] - 0.5) < 1e-4   # a few were 0 already
    assert rows["magnitude-2:4"]["compressed"] < 0.6 * rows["magnitude-2:4"]["dense"]
    assert rows["layers-0.3"]["dense"] < 0.75 * rows["dense"]["dense"]
    assert rows["layers-0.3"]["mean_kl"] > 0 and rows["dense"]["speedup_b1"] == 1.0
    assert "layers-0.3" in format_table(r)

"""The benchmark harness itself (not a timing test): on a tiny model it runs both peers, they produce
the same tokens, and the bandwidth arithmetic is the documented formula."""
import pytest
import torch

from workbench.bench import copy_bandwidth, decode_bytes_per_token
from workbench.bench import single_stream
from workbench import LLM


def test_single_stream_runs_both_peers_on_identical_tokens(tiny_folder):
    result = single_stream.run(dtypes=["float32"], repeats=1, new_tokens=16,
                               model=str(tiny_folder))
    d = result["dtypes"]["float32"]
    assert d["same_tokens"]  # the engine and transformers generated the same 16 tokens
    assert d["engine_tok_s"] > 0 and d["transformers_tok_s"] > 0
    assert d["ratio_median"] == d["ratios"][0]
    assert abs(d["achieved_gbs"] - d["bytes_per_token"] * d["engine_decode_tok_s"] / 1e9) < 1e-9
    assert "ratio" in single_stream.format_table(result)


def test_bandwidth_helpers():
    assert copy_bandwidth(size_mib=16, repeats=2) > 0
    assert decode_bytes_per_token(1000, 10, 5) == 1050


def test_kernels_benchmark_rows_through_the_interpreter():
    """The GPU benchmark's code paths on tiny shapes, so a GPU run never finds a Python error;
    each row carries the kernel's error against SDPA, which must be small."""
    from workbench.bench import kernels as kb
    fa = kb.flash_attention_rows(dtype=torch.float32, seq_lens=(32,), tokens=64, heads=2,
                                 head_dim=64, device="cpu")
    dec = kb.paged_decode_rows(100.0, dtype=torch.float32, batches=(2,), contexts=(48,), heads=4,
                               kv_heads=2, head_dim=64, device="cpu")
    assert [(r["seq_len"], r["batch"], r["causal"]) for r in fa] == [(32, 2, False), (32, 2, True)]
    assert all(r["max_abs_error_vs_sdpa"] < 1e-4 for r in fa + dec)
    assert dec[0]["kv_bytes"] == 2 * 2 * 48 * 2 * 64 * 4
    text = kb.summary({"gpu": "cpu", "torch": "x", "triton": "y", "flash_attention": fa,
                       "paged_decode": dec})
    assert "FlashAttention forward vs SDPA" in text and "paged decode" in text


def test_anatomy_splits_a_decode_step_into_measured_parts(tiny_folder):
    """The profiler sees the model's own operators inside the forward: matmuls and attention are
    nonzero, every part is non-negative, and the parts account for the whole step (they are the
    step's phases plus the forward split by operator)."""
    from workbench.bench.anatomy import anatomy, categorize
    assert categorize("aten::mm") == categorize("aten::_weight_int4pack_mm_for_cpu") == "matmul"
    assert categorize("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert categorize("aten::index_copy_") == "attention"
    assert categorize("workbench_cpu::paged_decode_write") == "attention"
    assert categorize("aten::mul") == "other ops"
    # Layer by layer (fused_decode=False): a fused step runs every layer inside one operator.
    llm = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
              max_model_len=64, fused_decode=False)
    a = anatomy(llm, [5, 6, 7, 8, 9], new_tokens=12, profiled_steps=4)
    parts = a["parts_s"]
    assert set(parts) == {"schedule + prepare", "matmul", "attention", "other ops", "overhead",
                          "sample", "postprocess"}
    assert parts["matmul"] > 0 and parts["attention"] > 0 and parts["other ops"] > 0
    assert all(v >= 0 for v in parts.values())
    assert a["tok_s"] == 1 / a["step_s"]
    # The phases of every step are disjoint and add up to it; the forward pass is timed as one.
    phases = ("schedule_s", "draft_s", "prepare_s", "forward_s", "sample_s", "postprocess_s")
    for r in llm.engine.trace:
        assert all(getattr(r, p) >= 0 for p in phases), r
        assert sum(getattr(r, p) for p in phases) == pytest.approx(r.total_s, rel=1e-6, abs=1e-7), r
    assert a["forward_s"] > 0.25 * a["profiled_forward_s"], (a["forward_s"], a["profiled_forward_s"])
    # Self times of disjoint operators inside the profiled forward add up to at most its wall time.
    ops = parts["matmul"] + parts["attention"] + parts["other ops"]
    assert 0 < ops <= 1.05 * a["profiled_forward_s"], (ops, a["profiled_forward_s"])
    # Every layer dispatches at least its seven projections (q, k, v, o, gate, up, down).
    layers = llm.engine.runner.model.args.num_hidden_layers
    assert a["ops_per_step"] >= 7 * layers, (a["ops_per_step"], layers)


def test_speed_ladder_rows_and_targets_on_a_tiny_model(tiny_folder):
    """The ladder's plumbing (the speeds themselves are for `python -m workbench.bench speed`):
    every row runs, engine rows carry their bandwidth arithmetic, targets read from the results."""
    from workbench.bench import speed
    rows = {"engine eager fp32 (torch kernels)": speed.ENGINE_ROWS["engine eager fp32 (torch kernels)"],
            "engine default INT4": speed.ENGINE_ROWS["engine default INT4"]}
    lad = speed.ladder(model=str(tiny_folder), new_tokens=8, repeats=1, rows=rows, llama_cpp=False)
    assert set(rows) | set(speed.HF_ROWS) <= set(lad["rows"])
    for label in rows:
        r = lad["rows"][label]
        assert r["tok_s"] > 0 and r["achieved_gbs"] > 0
        (own_bandwidth,) = r["copy_bandwidth_per_round_gbs"]   # measured right before its run
        assert abs(r["fraction_of_copy_bandwidth"] - r["achieved_gbs"] / own_bandwidth) < 1e-9
    low, high = lad["copy_bandwidth_range_gbs"]
    assert low <= lad["copy_bandwidth_gbs"] <= high
    result = {"ladder": lad, "targets": []}
    for name, read, bar, sense in speed.TARGETS[:1]:
        value = read(result)
        assert value is None                   # no llama.cpp row here: the target is skipped
    assert "engine eager fp32 (torch kernels)" in speed.format_table(dict(result, targets=[]))


def test_gpu_benchmark_plumbing_on_the_cpu():
    """`python -m workbench.bench gpu` runs on a CPU for a smoke check (tiny model, no graphs):
    every row and peer runs, bandwidth arithmetic holds, no GPU target is judged without graphs."""
    from workbench.bench import gpu
    r = gpu.run(shapes=("tiny",), device="cpu", new_tokens=8, num_requests=4, repeats=1)
    s = r["shapes"]["tiny"]
    d = s["decode"]["engine eager"]
    assert d["decode_tok_s"] > 0
    (bw,) = d["copy_bandwidth_per_run_gbs"]
    assert abs(d["fraction_of_copy_bandwidth"] - d["bytes_per_token"] * d["decode_tok_s"] / 1e9 / bw) < 1e-9
    assert s["offline"]["engine eager"]["tokens"] == s["offline"][
        "transformers static batches of 8"]["tokens"] > 0
    assert [t["met"] for t in r["targets"]] == [None]     # no graphs on a CPU: not judged
    assert "engine eager" in gpu.format_table(r)
    # A 1B-shape result with graphs is judged against both bars.
    fake = {"shapes": {"llama-1b": {
        "decode": {"engine + CUDA graphs": {"fraction_of_copy_bandwidth": 0.5}},
        "offline": {"engine + CUDA graphs": {"tok_s": 1200.0},
                    "transformers static batches of 8": {"tok_s": 100.0}}}}}
    assert [(t["measured"], t["met"]) for t in gpu.targets(fake)] == [(12.0, True), (0.5, False)]


def test_gemm_floor_counts_the_workload_and_times_both_paths():
    """The floor of `python -m workbench.bench floor`: FLOPs counted from the requests (checked
    by hand on two requests), rates measured for aten's and the prepacked path on a tiny shape."""
    from workbench.bench import gemm_floor
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=100)
    proj = 2 * ((64 + 2 * 32) * 64 + 64 * 64 + 256 * 64 + 64 * 128)
    flops = gemm_floor.workload_flops(cfg, [([1] * 5, 3), ([2] * 7, 1)])
    assert flops["prefill_flop"] == 2 * proj * 12
    assert flops["decode_flop"] == 2 * proj * 2 + 2 * 100 * 64 * 4
    for packed in (False, True):
        assert gemm_floor.gemm_rate(cfg, 4, packed, repeats=1) > 0

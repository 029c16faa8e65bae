"""The FlexGen-style cost model against hand computations on a made-up machine, and the shape of
the measured curve's rows on a tiny model (no speed is asserted: the machine is shared)."""
from __future__ import annotations

import math

import pytest

from workbench import LLM
from workbench.experiments.offload_cost import (LayerCost, Machine, compute_time, head_cost, layer_costs,
                                          measure_flops, measure_memory_bandwidth,
                                          measure_offload_curve, measure_slow_bandwidth,
                                          predict_from_resident, predict_step_time,
                                          predict_tokens_per_s)

MACHINE = Machine(flops=1e9, memory_bandwidth=1e8, slow_bandwidth=1e7)
LAYER = LayerCost(weight_bytes=1_000_000, matmul_params=500_000, attention_width=64,
                  kv_bytes_per_token=256)
HEAD = LayerCost(weight_bytes=200_000, matmul_params=100_000, attention_width=0,
                 kv_bytes_per_token=0)


def test_compute_time_is_the_roofline_of_flops_and_bytes():
    # batch 4, context 100: 2*4*500000 + 4*4*100*64 = 4,102,400 FLOPs -> 4.1024 ms;
    # 1,000,000 + 4*100*256 = 1,102,400 bytes -> 11.024 ms: memory-bound
    assert compute_time(LAYER, 4, 100, MACHINE) == pytest.approx(0.011024, rel=1e-12)
    # batch 64: 64,000,000 + 1,638,400 FLOPs -> 65.6384 ms; 2,638,400 bytes -> 26.384 ms
    assert compute_time(LAYER, 64, 100, MACHINE) == pytest.approx(0.0656384, rel=1e-12)
    # the head at batch 4: 800,000 FLOPs -> 0.8 ms; 200,000 bytes -> 2 ms
    assert compute_time(HEAD, 4, 0, MACHINE) == pytest.approx(0.002, rel=1e-12)


def test_step_time_overlapped_and_serial():
    layers = [LAYER, LAYER]
    # layer 1 offloaded: transfer 1,000,000 / 1e7 = 100 ms, compute 11.024 ms
    overlapped = predict_step_time(layers, HEAD, {1}, 4, 100, MACHINE, overlap=True)
    serial = predict_step_time(layers, HEAD, {1}, 4, 100, MACHINE, overlap=False)
    assert overlapped == pytest.approx(0.002 + 0.011024 + 0.1, rel=1e-12)
    assert serial == pytest.approx(0.002 + 0.011024 + 0.011024 + 0.1, rel=1e-12)
    assert predict_tokens_per_s(layers, HEAD, {1}, 4, 100, MACHINE) == \
        pytest.approx(4 / 0.113024, rel=1e-12)
    resident = predict_step_time(layers, HEAD, [], 4, 100, MACHINE)
    assert resident == pytest.approx(0.002 + 2 * 0.011024, rel=1e-12)


def test_large_batches_hide_the_transfer():
    fast_disk = Machine(flops=1e9, memory_bandwidth=1e8, slow_bandwidth=1e8)   # 10 ms per layer
    layers = [LAYER, LAYER]
    # batch 64: compute 65.6384 ms > transfer 10 ms, so overlap hides the transfer entirely
    assert predict_step_time(layers, HEAD, {0, 1}, 64, 100, fast_disk) == \
        pytest.approx(predict_step_time(layers, HEAD, [], 64, 100, fast_disk), rel=1e-12)
    # batch 1 on the slow tier of MACHINE: compute 10.256 ms (1,025,600 bytes at 1e8 B/s), the
    # transfer 100 ms, so each offloaded layer costs its transfer
    t1 = predict_step_time(layers, HEAD, {0, 1}, 1, 100, MACHINE)
    assert t1 == pytest.approx(compute_time(HEAD, 1, 0, MACHINE) + 2 * 0.1, rel=1e-12)


def test_layer_costs_of_the_tiny_model(tiny_llm):
    model = tiny_llm.engine.model
    args = model.args
    costs = layer_costs(model)
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    h, i = args.hidden_size, args.intermediate_size
    params = h * (q + 2 * kv) + q * h + h * 2 * i + i * h          # 36,864 for "tiny"
    assert len(costs) == args.num_hidden_layers
    assert costs[0] == LayerCost(weight_bytes=4 * (params + 2 * h), matmul_params=params,
                                 attention_width=q, kv_bytes_per_token=2 * kv * 4)
    assert head_cost(model).matmul_params == args.vocab_size * h


def test_measured_machine_numbers_are_positive(tmp_path):
    import torch
    cpu = torch.device("cpu")
    for value in (measure_flops(cpu, torch.float32, n=128, repeats=1),
                  measure_memory_bandwidth(cpu, nbytes=2**20, repeats=1),
                  measure_slow_bandwidth("disk", cpu, nbytes=2**20, chunk_bytes=2**18,
                                         directory=str(tmp_path), repeats=1),
                  measure_slow_bandwidth("cpu", cpu, nbytes=2**20, repeats=1)):
        assert math.isfinite(value) and value > 0
    assert list(tmp_path.iterdir()) == []          # the probe's file is deleted


def test_prediction_from_a_measured_resident_step():
    layers = [LAYER, LAYER]
    # roofline resident step at batch 4: 2 + 2 x 11.024 = 24.048 ms; measured 48.096 ms: factor 2,
    # so each layer computes 22.048 ms and the head 4 ms
    measured = 0.048096
    assert predict_from_resident(measured, layers, HEAD, [], 4, 100, MACHINE) == \
        pytest.approx(measured, rel=1e-12)
    # layer 1 offloaded: its 100 ms transfer exceeds its 22.048 ms compute
    assert predict_from_resident(measured, layers, HEAD, {1}, 4, 100, MACHINE) == \
        pytest.approx(0.004 + 0.022048 + 0.1, rel=1e-12)
    assert predict_from_resident(measured, layers, HEAD, {1}, 4, 100, MACHINE, overlap=False) == \
        pytest.approx(0.004 + 2 * 0.022048 + 0.1, rel=1e-12)


def test_measured_curve_rows(tiny_folder):
    def factory(offload: bool):
        extra = {"cpu_offload_gb": 1.0} if offload else {}
        return LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
                   max_model_len=64, max_num_seqs=2, **extra)
    rows = measure_offload_curve(factory, [1, 2], prompt_len=8, decode_tokens=3,
                                 machine=MACHINE)
    assert [(r["batch_size"], r["weights"]) for r in rows] == \
        [(1, "resident"), (1, "offloaded"), (2, "resident"), (2, "offloaded")]
    assert [r["offloaded_layers"] for r in rows] == [0, 2, 0, 2]   # 1 GiB covers both layers
    for r in rows:
        assert r["decode_steps"] == 2                 # 3 tokens: the prefill samples the first
        assert r["measured_step_s"] > 0 and r["measured_tokens_per_s"] == \
            pytest.approx(r["batch_size"] / r["measured_step_s"])
        assert r["relative_error"] == pytest.approx(
            (r["predicted_step_s"] - r["measured_step_s"]) / r["measured_step_s"])
        assert (r["flops"], r["slow_bandwidth"]) == (MACHINE.flops, MACHINE.slow_bandwidth)
        assert r["calibrated_error"] == pytest.approx(
            (r["calibrated_step_s"] - r["measured_step_s"]) / r["measured_step_s"])
    for resident in rows[0::2]:            # calibrated on the resident step itself
        assert resident["calibrated_step_s"] == pytest.approx(resident["measured_step_s"])
    # the prediction is the model's, for the engine's own placement
    off = rows[1]
    assert off["predicted_step_s"] > rows[0]["predicted_step_s"]


def test_curve_refuses_a_factory_without_offload(tiny_folder):
    def factory(offload: bool):
        return LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
                   max_model_len=64, max_num_seqs=2)
    with pytest.raises(ValueError, match="cpu_offload_gb > 0"):
        measure_offload_curve(factory, [1], machine=MACHINE)

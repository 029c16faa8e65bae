"""Mixed precision (quant/mixed.py): the knapsack's exact choices, the knobs' errors, an explicit
plan in the engine, and the engine's own plan within uniform INT4's bytes (that it beats uniform INT4
on SmolLM2's KL is chapter 09's claim)."""
from __future__ import annotations

import pytest

from workbench import LLM, SamplingParams
from workbench.layers.linear import Int4Linear, Int8Linear
from workbench.quant.mixed import plan


def test_the_plan_spends_the_budget_where_the_kl_saved_per_byte_is_largest():
    # bytes and error proxies per format; the sensitivity was measured in int4-g128
    costs = {"a": {"int4-g128": (100, 1.0), "int8": (200, 0.01)},
             "b": {"int4-g128": (100, 1.0), "int8": (200, 0.01)},
             "c": {"int4-g128": (100, 1.0), "int4-g32": (120, 0.25), "int8": (200, 0.01)}}
    ref = {n: 1.0 for n in costs}
    sens = {"a": 0.5, "b": 0.01, "c": 0.2}
    assert plan(sens, costs, ref, 300) == {n: "int4-g128" for n in costs}
    # 20 bytes buy c's g32 (0.15 saved, 0.0075 / byte); 100 buy a's int8 (0.495, 0.00495 / byte)
    assert plan(sens, costs, ref, 320) == {"a": "int4-g128", "b": "int4-g128", "c": "int4-g32"}
    assert plan(sens, costs, ref, 420) == {"a": "int8", "b": "int4-g128", "c": "int4-g32"}
    # with room for everything, b (the least sensitive) is upgraded last
    assert plan(sens, costs, ref, 600) == {"a": "int8", "b": "int8", "c": "int8"}
    with pytest.raises(ValueError, match=r"budget_bits'\] is too small: .* 300 bytes, the budget is 299"):
        plan(sens, costs, ref, 299)


@pytest.mark.parametrize("options, message", [
    ({"budget_bits": 1}, r"\['budget_bits'\]=1 is invalid: it must be a number of bits per weight in \(2, 16\]"),
    ({"mixed_formats": ["int3"]}, r"\['mixed_formats'\]=\['int3'\] is invalid: it must be a non-empty list of formats"),
    ({"mixed_plan": ["int8"]}, r"\['mixed_plan'\]=\['int8'\] is invalid: it must be a dict"),
    ({"mixed_sensitivity_windows": 0}, r"\['mixed_sensitivity_windows'\]=0 is invalid"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        LLM(model="random:tiny", quantization="mixed", quantization_config=options, verbose=False)


def test_an_explicit_plan_gives_each_projection_its_format(tiny_folder):
    plan_ = {"layers.0.mlp.down_proj": "int8", "layers.1.self_attn.qkv_proj": "int4-g32"}
    llm = LLM(model=str(tiny_folder), dtype="float32", quantization="mixed", verbose=False,
              quantization_config={"mixed_plan": plan_}, max_model_len=64)
    layers = llm.engine.model.layers
    assert isinstance(layers[0].mlp.down_proj, Int8Linear)
    assert layers[1].self_attn.qkv_proj.group_size == 32
    assert isinstance(layers[0].self_attn.o_proj, Int4Linear) and layers[0].self_attn.o_proj.group_size == 128
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match=r"mixed_plan'\] names unknown projection\(s\) \['layers.99.mlp.down_proj'\]"):
        LLM(model=str(tiny_folder), quantization="mixed", verbose=False,
            quantization_config={"mixed_plan": {"layers.99.mlp.down_proj": "int8"}})


def test_the_engine_plans_its_own_mix_within_uniform_int4s_bytes(tiny_folder):
    """LLM(quantization="mixed") measures the sensitivities, plans, and quantizes: several formats
    in no more projection bytes than uniform INT4. That such a plan beats uniform INT4 on SmolLM2's
    held-out KL is chapter 09's claim (the same planner, asserted at every size)."""
    from workbench.quant.mixed import named_projections
    calib = {"num_calibration_windows": 4, "calibration_window_len": 64, "mixed_sensitivity_windows": 1}
    engines = {m: LLM(model=str(tiny_folder), dtype="float32", verbose=False, max_model_len=256,
                      quantization=m, quantization_config=calib if m == "mixed" else None)
               for m in ("int4", "mixed")}

    def projection_bytes(llm):
        model = llm.engine.model
        return sum(getattr(o, a).weight_bytes() for o, a in named_projections(model).values())

    assert projection_bytes(engines["mixed"]) <= projection_bytes(engines["int4"])
    formats = set(engines["mixed"].engine.model.mixed_plan.values())
    assert len(formats) > 1, formats
    out = engines["mixed"].generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4

"""The mixed-precision search (experiments/mixed_search.py): the Pareto front, each plan's bits and KL measured
exactly as the engine's modules give them, and Optuna's trials reproducible from the seed."""
from __future__ import annotations

import pytest
import torch

from workbench import LLM
from workbench.quant.metrics import kl_divergence
from workbench.quant.forward import prefill_logprobs
from workbench.quant.mixed import named_projections, quantized
from workbench.experiments.mixed_search import PlanEvaluator, expand, group_of, pareto, search


def test_pareto_keeps_exactly_the_non_dominated_points():
    points = [(4.0, 1.0), (5.0, 0.5), (4.5, 1.2), (6.0, 0.5), (8.0, 0.01), (3.0, 2.0), (5.0, 0.7)]
    # (4.5, 1.2) is beaten by (4.0, 1.0); (6.0, 0.5) ties (5.0, 0.5) on KL with more bits;
    # (5.0, 0.7) has the bits of (5.0, 0.5) and more KL
    assert pareto(points) == [5, 0, 1, 4]
    assert pareto([]) == []


def test_groups_name_a_layer_or_a_projection_kind():
    assert group_of("layers.3.mlp.down_proj", "layer") == "layer 3"
    assert group_of("layers.3.mlp.down_proj", "kind") == "down_proj"
    names = ["layers.0.self_attn.qkv_proj", "layers.1.self_attn.qkv_proj", "layers.1.mlp.down_proj"]
    assert expand({"qkv_proj": "int8", "down_proj": "int4-g32"}, names, "kind") == {
        names[0]: "int8", names[1]: "int8", names[2]: "int4-g32"}


@pytest.fixture(scope="module")
def evaluator(tiny_folder):
    llm = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
              max_model_len=64, max_num_seqs=1)
    windows = [list(range(3, 35)), list(range(40, 72))]
    return PlanEvaluator(llm.engine.model, windows, ("int4-g32", "int8"))


def test_bits_and_kl_are_those_of_the_quantized_modules(evaluator):
    model = evaluator.model
    names = list(evaluator.names)
    assert len(names) == 4 * len(model.layers) > 0     # qkv, o, gate_up and down of every layer
    plan = {n: ("int8" if i % 2 else "int4-g32") for i, n in enumerate(names)}
    params = sum(getattr(o, a).weight.numel() for o, a in named_projections(model).values())
    stored = sum(quantized(getattr(o, a), plan[n], torch.float32).weight_bytes()
                 for n, (o, a) in named_projections(model).items())
    assert evaluator.bits(plan) == pytest.approx(8 * stored / params, rel=1e-12)
    # the same plan applied by hand: the KL must be the evaluator's to the last digit
    originals = {n: getattr(o, a) for n, (o, a) in named_projections(model).items()}
    reference = [prefill_logprobs(model, w) for w in evaluator.windows]
    for n, (o, a) in named_projections(model).items():
        setattr(o, a, quantized(originals[n], plan[n], torch.float32))
    try:
        by_hand = torch.cat([kl_divergence(r, prefill_logprobs(model, w))
                             for r, w in zip(reference, evaluator.windows)]).mean().item()
    finally:
        for n, (o, a) in named_projections(model).items():
            setattr(o, a, originals[n])
    assert evaluator.kl(plan) == pytest.approx(by_hand, rel=1e-9)
    assert by_hand > 0
    # the evaluator put the unquantized modules back
    assert all(getattr(o, a) is originals[n] for n, (o, a) in named_projections(model).items())
    assert evaluator.kl(evaluator.uniform("int8")) < evaluator.kl(evaluator.uniform("int4-g32"))


def test_the_search_is_seeded_and_its_front_is_non_dominated(evaluator):
    first = search(evaluator, 6, "kind", seed=1)
    again = search(evaluator, 6, "kind", seed=1)
    assert [t.groups for t in first.trials] == [t.groups for t in again.trials]
    assert len(first.trials) == 6 and first.front
    for t in first.trials:
        plan = expand(t.groups, evaluator.names, "kind")
        assert t.bits == pytest.approx(evaluator.bits(plan))
    front_points = {(t.bits, t.kl) for t in first.front}
    points = [(t.bits, t.kl) for t in first.trials]
    # the front is exactly the trials' non-dominated points (ties on both kept, as Optuna does)
    assert front_points == {points[i] for i in pareto(points)}
    for b, k in front_points:
        assert not any(b2 <= b and k2 < k or b2 < b and k2 <= k for b2, k2 in points)


def test_a_bytes_cap_keeps_larger_plans_off_the_front(evaluator):
    cap = evaluator.bits(evaluator.uniform("int4-g32")) + 0.01
    result = search(evaluator, 8, "kind", max_bits=cap, seed=0)
    feasible = [(t.bits, t.kl) for t in result.trials if t.bits <= cap]
    # the front is the feasible trials' front, not empty: the all-INT4 plan was tried
    assert result.front
    assert {(t.bits, t.kl) for t in result.front} == {feasible[i] for i in pareto(feasible)}
    # and the cap kept something off it: a plan over it that the uncapped front would hold
    everything = [(t.bits, t.kl) for t in result.trials]
    assert any(everything[i][0] > cap for i in pareto(everything))


@pytest.mark.parametrize("kwargs, message", [
    ({"trials": 0}, r"trials=0 is invalid"),
    ({"trials": 2, "grouping": "head"}, r"grouping='head' is invalid: allowed are \['layer', 'kind'\]"),
])
def test_bad_arguments_are_named(evaluator, kwargs, message):
    with pytest.raises(ValueError, match=message):
        search(evaluator, **kwargs)


def test_unknown_formats_are_named(evaluator):
    with pytest.raises(ValueError, match=r"formats \['int3'\] are invalid"):
        PlanEvaluator(evaluator.model, evaluator.windows, ("int3",))

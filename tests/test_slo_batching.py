"""SLO-aware batching: with tpot_slo the prefill tokens of a step that carries decodes are capped
by a budget computed from the measured cost of a decode step and of a prefill token, or, until
both are measured, one that halves when decode steps run over the target and grows back when they
run well under it (scheduler.py)."""
import pytest

from workbench import LLM, SamplingParams


def engine_with(tiny_folder, slo):
    return LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
               max_model_len=256, max_num_seqs=8, block_size=16, max_num_batched_tokens=256,
               tpot_slo=slo).engine


def test_budget_halves_over_the_target_and_grows_back_under_it(tiny_folder):
    sched = engine_with(tiny_folder, 0.05).scheduler
    sched.observe_step(0.2, num_decode_tokens=0)          # a prefill-only step: nothing to protect
    assert sched.prefill_budget == 256
    for expected in (128, 64, 32, 32):                    # down to an eighth of 256
        sched.observe_step(0.06, num_decode_tokens=3)
        assert sched.prefill_budget == expected
    sched.observe_step(0.045, num_decode_tokens=3)        # between 80% and 100%: hold
    assert sched.prefill_budget == 32
    for expected in (64, 96, 128):
        sched.observe_step(0.01, num_decode_tokens=3)
        assert sched.prefill_budget == expected


def test_budget_from_measured_costs_meets_the_target(tiny_folder):
    """Decode-only steps take 20 ms, each prefill token adds 1 ms: with a 100 ms target the
    budget is the 80 prefill tokens that fit, whatever it was."""
    sched = engine_with(tiny_folder, 0.1).scheduler
    sched.observe_step(0.02, num_decode_tokens=4)
    for prefill in (200, 16, 64):
        sched.observe_step(0.02 + 0.001 * prefill, num_decode_tokens=4, num_prefill_tokens=prefill)
        assert sched.prefill_budget == pytest.approx(80, abs=1)
    sched.observe_step(0.5, num_decode_tokens=0, num_prefill_tokens=500)   # prefill alone
    assert sched.prefill_token_s == pytest.approx(0.001) and sched.prefill_budget in (79, 80)


def test_decode_steps_carry_no_more_prefill_than_the_budget(tiny_folder):
    engine = engine_with(tiny_folder, 1e-9)               # every decode step is over the target
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.add_request(list(range(1, 40)), params)
    engine.step()
    for k in range(4):                                     # long prompts arrive while it decodes
        engine.add_request(list(range(k + 2, k + 202)), params)
    budgets = [engine.scheduler.prefill_budget]
    while engine.has_unfinished_requests():
        engine.step()
        budgets.append(engine.trace[-1].prefill_budget)
    mixed = [(r, b) for r, b in zip(engine.trace[1:], budgets)
             if r.num_decode_tokens and r.num_prefill_tokens]
    assert mixed and all(r.num_prefill_tokens <= b for r, b in mixed)
    assert min(budgets) == 32 and engine.blocks.pool.num_used == 0
    fixed = engine_with(tiny_folder, None)
    fixed.add_request(list(range(1, 40)), params)
    fixed.step()
    for k in range(4):
        fixed.add_request(list(range(k + 2, k + 202)), params)
    fixed.step()
    assert fixed.trace[-1].num_prefill_tokens > 32         # without a target: the whole budget


def test_tpot_slo_is_validated(tiny_folder):
    with pytest.raises(ValueError, match=r"^tpot_slo=0 is invalid"):
        engine_with(tiny_folder, 0)
    with pytest.raises(ValueError, match=r"^tpot_slo is invalid with batch_invariant=True"):
        LLM(model=str(tiny_folder), device="cpu", verbose=False, tpot_slo=0.1,
            batch_invariant=True)

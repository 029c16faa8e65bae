"""Lab 05 (continuous batching): one step's token budget, and whom to preempt when blocks run out.

The reference is the engine's own `Scheduler.schedule` (`workbench/engine/scheduler.py`), run on small
scripted scenarios: the checker builds real `Sequence`s in a real `BlockManager` in the state a
case describes, asks the scheduler for one step, and compares its choices with the learner's. The
learner's function sees only the numbers that matter (tokens left to compute, blocks held and
needed), so the lab is about the decisions, not the engine's data structures.
"""
from __future__ import annotations

import random

from workbench.config import EngineConfig, ModelFacts, plan_kernels, resolve
from workbench.kv.block_manager import BlockManager
from workbench.sampling_params import SamplingParams
from workbench.engine.scheduler import Scheduler
from workbench.engine.sequence import Sequence, SequenceStatus
from workbench.course.labs.core import Mismatch, call, exercise, expect_equal

CHAPTER = "05_continuous_batching"
_PARAMS = SamplingParams(max_tokens=1000)


def _sequence(rid: str, num_computed: int, num_uncomputed: int, order: int) -> Sequence:
    """A sequence with `num_uncomputed` tokens left to compute. One token left after a computed
    prefix is a decode (the token sampled last step); more is a prompt, whole or partly done."""
    if num_uncomputed == 1 and num_computed > 0:
        seq = Sequence(rid, None, [1] * num_computed, _PARAMS, arrival_time=float(order))
        seq.output_token_ids = [2]
    else:
        seq = Sequence(rid, None, [1] * (num_computed + num_uncomputed), _PARAMS,
                       arrival_time=float(order))
    seq.num_computed_tokens = num_computed
    return seq


def _scheduler(max_num_batched_tokens: int, max_num_seqs: int, chunked: bool,
               num_blocks: int, block_size: int) -> Scheduler:
    # No model: a context as long as one step may be (the pool's, with chunked prefill), and one
    # byte per token (nothing is allocated).
    context = num_blocks * block_size if chunked else max_num_batched_tokens
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          enable_chunked_prefill=chunked, block_size=block_size,
                          num_kv_blocks=num_blocks, max_model_len=context)
    plan = resolve(config, plan_kernels(config), ModelFacts(context, 1))
    return Scheduler(plan, BlockManager(num_blocks=num_blocks, block_size=block_size))


def _pairs(got, what: str) -> list[tuple[str, int]]:
    """The learner's answer as [(request id, tokens)], or a Mismatch saying what shape to return."""
    shape = "a list of (request_id, num_tokens) pairs, e.g. [('a', 1), ('c', 15)]"
    if not isinstance(got, (list, tuple)):
        raise Mismatch(f"{what}: returned {type(got).__name__} {got!r:.80}; return {shape}")
    out = []
    for item in got:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], int) and not isinstance(item[1], bool)):
            raise Mismatch(f"{what}: the answer holds {item!r:.60}; return {shape} "
                           "(an int count, not a tensor or a float)")
        out.append((item[0], item[1]))
    return out


# --------------------------------------------------------------------------- exercise 1
def _reference_plan(running, waiting, budget, max_num_seqs, chunked) -> list[tuple[str, int]]:
    """The engine's choice: running sequences hold `num_computed` tokens in the cache and need
    `n` more; waiting ones are new prompts of n tokens. The pool is large: only the budget and the
    sequence slots limit the step."""
    sched = _scheduler(budget, max_num_seqs, chunked, num_blocks=10_000, block_size=16)
    order = 0
    for rid, n in running:
        num_computed = 5 if n == 1 else 16          # a decode after a 5-token prompt, or a prompt
        seq = _sequence(rid, num_computed, n, order)   # whose first chunk of 16 has run
        seq.status = SequenceStatus.RUNNING
        sched.blocks.allocate(rid, 0, num_computed)
        sched.running.append(seq)
        order += 1
    for rid, n in waiting:
        sched.add(_sequence(rid, 0, n, order))
        order += 1
    batch = sched.schedule()
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]


def _plan_cases() -> list[tuple]:
    """(running, waiting, max_num_batched_tokens, max_num_seqs, chunked). With chunked prefill
    off every running sequence is decoding (a prompt never runs in part) and every prompt fits an
    empty step (the engine raises the budget to max_model_len), as in the engine."""
    cases = [
        # The chapter's scenario: three decoders, a long prompt arrives; chunked, it gets 32 - 3.
        ([("a", 1), ("b", 1), ("c", 1)], [("long", 100)], 32, 8, True),
        ([("a", 1), ("b", 1), ("c", 1)], [("long", 100)], 128, 8, False),
        # A running prompt mid-prefill ahead of a decoder (it arrived first): it takes the budget.
        ([("p", 40), ("d", 1)], [("w", 4)], 32, 8, True),
        ([("d", 1), ("p", 40)], [("w", 4)], 32, 8, True),
        # Slots: two running, max_num_seqs=3, so one of three small prompts joins.
        ([("a", 1), ("b", 1)], [("x", 3), ("y", 3), ("z", 3)], 64, 3, True),
        ([("a", 1), ("b", 1)], [("x", 3), ("y", 3), ("z", 3)], 64, 2, True),
        # First come, first served without chunking: a prompt that does not fit blocks the queue.
        ([("a", 1), ("b", 1)], [("big", 31), ("small", 5)], 32, 8, False),
        ([("a", 1), ("b", 1)], [("big", 30), ("small", 5)], 32, 8, False),
        # Chunked: the second prompt gets what is left, the third nothing.
        ([], [("x", 20), ("y", 20), ("z", 20)], 32, 8, True),
        ([("a", 1)], [("x", 15), ("y", 20)], 16, 8, True),
        ([], [], 16, 4, True),
        ([("a", 1), ("b", 1)], [], 16, 4, False),
        ([], [("x", 16), ("y", 1)], 16, 4, False),
    ]
    rng = random.Random(5)
    names = iter(f"r{i}" for i in range(10_000))
    for trial in range(40):
        chunked = trial % 2 == 0
        budget = rng.choice([8, 16, 32, 64] if chunked else [16, 32, 64])
        max_seqs = rng.randint(1, 6)
        running = []
        for _ in range(rng.randint(0, max_seqs)):
            n = 1 if not chunked or rng.random() < 0.6 else rng.randint(2, 40)
            running.append((next(names), n))
        waiting = [(next(names), rng.randint(1, 40 if chunked else budget))
                   for _ in range(rng.randint(0, 5))]
        cases.append((running, waiting, budget, max_seqs, chunked))
    return cases


def _plan_hint(got, expected, running, waiting, budget, max_seqs, chunked) -> str:
    need = dict(running + waiting)
    run_ids = [rid for rid, _ in running]
    wait_ids = [rid for rid, _ in waiting]
    got_ids = [rid for rid, _ in got]
    if set(got_ids) - set(need):
        return "return only the request ids you were given."
    if len(set(got_ids)) != len(got_ids):
        return "each sequence appears at most once in a step, with all the tokens it gets."
    if any(n <= 0 for _, n in got):
        return "leave out the sequences that get no tokens this step."
    if any(n > need[rid] for rid, n in got):
        return "a sequence gets at most the tokens it has left to compute."
    if sum(n for _, n in got) > budget:
        return ("the step's tokens must fit max_num_batched_tokens: subtract each sequence's "
                "tokens from the budget and hand out only what is left.")
    joined = [rid for rid in got_ids if rid in wait_ids]
    if len(running) + len(joined) > max_seqs:
        return ("max_num_seqs caps the sequences that are running, and the running ones count: "
                "a waiting request joins only while len(running) + joined < max_num_seqs.")
    if not chunked and any(0 < n < need[rid] for rid, n in got if rid in wait_ids):
        return ("with chunked prefill off, a prompt runs whole or not at all: if it does not fit "
                "what is left of the budget, it waits.")
    got_d, exp_d = dict(got), dict(expected)
    if got_ids and any(rid in wait_ids for rid in got_ids) and \
            any(got_d.get(rid, 0) < exp_d.get(rid, 0) for rid in run_ids):
        return ("running sequences come first, in the order given, each taking all its tokens or "
                "what is left of the budget; waiting requests share what remains after them.")
    if any(got_d.get(rid, 0) < exp_d.get(rid, 0) for rid in run_ids):
        return ("every running sequence gets all its uncomputed tokens, or (chunked prefill) what "
                "is left of the budget: a prompt mid-prefill gets a chunk, a decode its one token.")
    if chunked and any(0 < exp_d[rid] < need[rid] and rid not in got_d for rid in exp_d):
        return ("with chunked prefill on, a prompt that does not fit whole gets what is left of "
                "the budget (a chunk); the rest of it runs in later steps.")
    if not chunked:
        skipped = [i for i, rid in enumerate(wait_ids) if rid not in got_d]
        if skipped and any(i > skipped[0] for i, rid in enumerate(wait_ids) if rid in got_d):
            return ("waiting requests join in order (first come, first served): the first one that "
                    "does not fit stops admission for this step (break, not continue), so a large "
                    "prompt is not starved by smaller ones behind it.")
    if sorted(got) == sorted(expected):
        return ("list the sequences in the order the scheduler takes them: the running ones in "
                "the given order, then the waiting ones that join.")
    if any(rid not in got_d for rid in exp_d):
        return ("a waiting request joins while there is budget left and a free sequence slot: "
                f"here {sorted(set(exp_d) - set(got_d))} should have joined.")
    return ""


@exercise("batching.plan_step", CHAPTER, "plan_step",
          "one step's batch: running sequences, then waiting ones, within the token budget",
          hint="running sequences first, in order: each gets its uncomputed tokens, or (chunked "
               "prefill) what is left of max_num_batched_tokens. Then waiting requests, in order, "
               "while budget is left and len(running) + joined < max_num_seqs; without chunking a "
               "prompt that does not fit whole stops admission.")
def check_plan_step(plan_step) -> None:
    for running, waiting, budget, max_seqs, chunked in _plan_cases():
        what = (f"plan_step(running={running}, waiting={waiting}, max_num_batched_tokens={budget}, "
                f"max_num_seqs={max_seqs}, chunked_prefill={chunked})")
        got = _pairs(call(plan_step, what, list(running), list(waiting), budget, max_seqs,
                          chunked), what)
        expected = _reference_plan(running, waiting, budget, max_seqs, chunked)
        if got != expected:
            expect_equal(got, expected, what,
                         _plan_hint(got, expected, running, waiting, budget, max_seqs, chunked))


# --------------------------------------------------------------------------- exercise 2
BLOCK = 4


def _reference_preempt(running, free_blocks) -> tuple[list[str], list[str]]:
    """The engine's choice for running sequences (id, blocks held, blocks this step's tokens need
    beyond those) sharing a pool with `free_blocks` free: each sequence's state is built so that
    `BlockManager.allocate` asks for exactly that many blocks. The budget is large, so blocks are
    the only limit."""
    total = sum(h for _, h, _ in running) + free_blocks
    sched = _scheduler(10**6, max(1, len(running)), True, num_blocks=max(total, 1),
                       block_size=BLOCK)
    for order, (rid, held, need) in enumerate(running):
        if need == 0:       # its last block has room for the one token it decodes
            seq = _sequence(rid, held * BLOCK - 1, 1, order)
        else:               # its blocks are full; `need` more hold its next tokens
            seq = _sequence(rid, held * BLOCK, need * BLOCK - order % BLOCK, order)
        seq.status = SequenceStatus.RUNNING
        sched.blocks.allocate(rid, 0, seq.num_computed_tokens)
        assert len(sched.blocks.tables[rid]) == held
        sched.running.append(seq)
    batch = sched.schedule()
    assert not sched.ended, "a case where a sequence alone cannot fit: not in this exercise"
    return [s.request_id for s in batch.seqs], [s.request_id for s in batch.preempted]


def _preempt_cases() -> list[tuple]:
    cases = [
        ([("a", 2, 1), ("b", 1, 0), ("c", 3, 1)], 2),          # room for everyone
        ([("a", 2, 1), ("b", 2, 1), ("c", 2, 1)], 1),          # b's block comes from c
        ([("a", 1, 0), ("b", 1, 2)], 1),                       # b is the last: it goes itself
        ([("a", 1, 3), ("b", 1, 1), ("c", 1, 0), ("d", 1, 1)], 0),   # three victims for a
        ([("a", 2, 1), ("b", 2, 2), ("c", 1, 1), ("d", 3, 1)], 1),   # d's 3 blocks serve b and c
        ([("a", 1, 1), ("b", 4, 0), ("c", 1, 1)], 0),          # c goes for a, then b needs none
        ([("a", 1, 0), ("b", 1, 0)], 0),                       # nobody needs a block
        ([("a", 3, 1)], 1),
        ([], 3),
    ]
    rng = random.Random(11)
    for _ in range(40):
        running = [(chr(ord("a") + i), rng.randint(1, 4), rng.choice([0, 1, 1, 1, 2, 3]))
                   for i in range(rng.randint(1, 7))]
        free = rng.randint(0, 3)
        # Every sequence fits the pool alone (else the engine ends it for length: not taught here).
        free = max(free, max(h + n for _, h, n in running) - sum(h for _, h, _ in running))
        cases.append((running, free))
    return cases


def _simulate_preempt(running, free, mistake: str) -> tuple[list[str], list[str]]:
    """What a typical wrong reading of the rule gives (only to name the mistake in a hint)."""
    queue, scheduled, preempted = list(running), [], []
    i = 0
    while i < len(queue):
        rid, held, need = queue[i]
        if need > free and mistake == "skip":
            i += 1
            continue
        if need > free and mistake == "self":
            queue.pop(i)
            preempted.append(rid)
            free += held
            continue
        gone = False
        while need > free and queue:
            victim = queue.pop()
            preempted.append(victim[0])
            if mistake != "keep_blocks":
                free += victim[1]
            if victim[0] == rid:
                gone = True
                break
            if mistake == "one_victim":
                break
        if gone:
            continue
        if need > free and mistake == "one_victim":
            i += 1
            continue
        if mistake != "no_take":
            free -= need
        scheduled.append(rid)
        i += 1
    return scheduled, preempted


_PREEMPT_HINTS = {
    "skip": "when the pool is short, the scheduler does not skip the sequence: it takes blocks "
            "from another one by preempting it (the lowest-priority running sequence).",
    "self": "the victim is the lowest-priority running sequence, the last in the list, not the one "
            "asking for blocks (unless it is itself the last).",
    "keep_blocks": "a preempted sequence gives all its blocks back: add its blocks_held to the "
                   "free count before checking again.",
    "one_victim": "keep preempting (from the end of the list) until the sequence's blocks fit, or "
                  "until the sequence itself was the one preempted.",
    "no_take": "a sequence that runs takes the blocks it needs: subtract its blocks_needed from "
               "the free count, or later sequences find blocks that are already gone.",
}


@exercise("batching.preempt", CHAPTER, "preempt",
          "which running sequences run and which are preempted when KV blocks run out",
          hint="walk the running sequences in order; while one needs more blocks than are free, "
               "preempt the last sequence of the list (running.pop()), adding its blocks to the "
               "free ones; stop if the victim was the sequence itself. A sequence that fits takes "
               "its blocks and runs.")
def check_preempt(preempt) -> None:
    for running, free in _preempt_cases():
        what = f"preempt(running={running}, free_blocks={free})"
        got = call(preempt, what, list(running), free)
        if not (isinstance(got, (list, tuple)) and len(got) == 2
                and all(isinstance(part, (list, tuple)) for part in got)):
            raise Mismatch(f"{what}: returned {got!r:.80}; return a pair (scheduled, preempted) "
                           "of two lists of request ids, e.g. (['a', 'b'], ['c'])")
        got = (list(got[0]), list(got[1]))
        expected = _reference_preempt(running, free)
        if got == expected:
            continue
        scheduled, preempted = got
        hint = next((h for m, h in _PREEMPT_HINTS.items()
                     if _simulate_preempt(running, free, m) == got), "")
        ids = [rid for rid, _, _ in running]
        if not hint and set(scheduled) & set(preempted):
            hint = "a preempted sequence does not run this step: it goes back to the waiting queue."
        elif not hint and preempted and preempted != ids[::-1][:len(preempted)]:
            hint = ("victims come from the end of the list, lowest priority first (running.pop()): "
                    f"the first victim here is {ids[-1]!r}, then the one before it, and so on.")
        expect_equal(got, expected, what, hint)

"""Reference solutions and typical wrong answers for lab 05 (tests only: never in a lab notebook).

SOLUTIONS: exercise id -> the source of a correct exercise cell.
WRONG: (exercise id, source of a wrong cell, a phrase the checker's message or hint must contain).
"""

SOLUTIONS = {
    "batching.plan_step": '''
def plan_step(running, waiting, max_num_batched_tokens, max_num_seqs, chunked_prefill):
    budget, step = max_num_batched_tokens, []
    for rid, n in running:
        if budget == 0:
            break
        take = n if n <= budget else (budget if chunked_prefill else 0)
        if take:
            step.append((rid, take))
            budget -= take
    num_running = len(running)
    for rid, n in waiting:
        if budget == 0 or num_running >= max_num_seqs:
            break
        take = n if n <= budget else (budget if chunked_prefill else 0)
        if take == 0:
            break
        step.append((rid, take))
        budget -= take
        num_running += 1
    return step
''',
    "batching.preempt": '''
def preempt(running, free_blocks):
    queue = list(running)
    scheduled, preempted = [], []
    i = 0
    while i < len(queue):
        rid, held, need = queue[i]
        while need > free_blocks:
            victim = queue.pop()
            preempted.append(victim[0])
            free_blocks += victim[1]
            if victim[0] == rid:
                break
        else:
            free_blocks -= need
            scheduled.append(rid)
            i += 1
    return scheduled, preempted
''',
}

_PLAN = '''
def plan_step(running, waiting, max_num_batched_tokens, max_num_seqs, chunked_prefill):
    budget, step = max_num_batched_tokens, []
    for rid, n in running:
        take = min(n, budget) if chunked_prefill else (n if n <= budget else 0)
        if take:
            step.append((rid, take))
            budget -= take
    num_running = len(running)
    for rid, n in waiting:
        if budget == 0 or {SLOTS}:
            break
        take = {TAKE}
        if take == 0:
            {SKIP}
        step.append((rid, take))
        budget -= take
        num_running += 1
    return step
'''


def _plan(slots="num_running >= max_num_seqs",
          take="min(n, budget) if chunked_prefill else (n if n <= budget else 0)", skip="break"):
    return _PLAN.replace("{SLOTS}", slots).replace("{TAKE}", take).replace("{SKIP}", skip)


WRONG = [
    ("batching.plan_step", _plan(slots="False"), "max_num_seqs caps"),
    ("batching.plan_step", _plan(slots="num_running - len(running) >= max_num_seqs"),
     "the running ones count"),
    ("batching.plan_step", _plan(skip="continue"), "first come, first served"),
    ("batching.plan_step", _plan(take="n if n <= budget else 0"), "gets what is left of"),
    ("batching.plan_step", _plan(take="min(n, budget)"), "runs whole or not at all"),
    ("batching.plan_step", '''
def plan_step(running, waiting, max_num_batched_tokens, max_num_seqs, chunked_prefill):
    # waiting requests first: the long prompt no longer waits behind the decodes
    budget, step, num_running = max_num_batched_tokens, [], len(running)
    for rid, n in waiting:
        take = min(n, budget) if chunked_prefill else (n if n <= budget else 0)
        if take == 0 or num_running >= max_num_seqs:
            break
        step.append((rid, take))
        budget -= take
        num_running += 1
    for rid, n in running:
        take = min(n, budget)
        if take:
            step.append((rid, take))
            budget -= take
    return step
''', "running sequences come first"),
    ("batching.plan_step", '''
def plan_step(running, waiting, max_num_batched_tokens, max_num_seqs, chunked_prefill):
    step = [(rid, n) for rid, n in running]           # forgets the budget entirely
    room = max_num_seqs - len(running)
    return step + [(rid, n) for rid, n in waiting[:max(0, room)]]
''', "must fit max_num_batched_tokens"),
    ("batching.plan_step", '''
def plan_step(running, waiting, max_num_batched_tokens, max_num_seqs, chunked_prefill):
    return {rid: n for rid, n in running}             # a dict, not a list of pairs
''', "list of (request_id, num_tokens) pairs"),
    ("batching.preempt", '''
def preempt(running, free_blocks):
    scheduled = []
    for rid, held, need in running:
        if need <= free_blocks:                       # no preemption: just skip it
            free_blocks -= need
            scheduled.append(rid)
    return scheduled, []
''', "does not skip the sequence"),
    ("batching.preempt", '''
def preempt(running, free_blocks):
    scheduled, preempted = [], []
    for rid, held, need in running:
        if need > free_blocks:                        # preempts the sequence asking for blocks
            preempted.append(rid)
            free_blocks += held
        else:
            free_blocks -= need
            scheduled.append(rid)
    return scheduled, preempted
''', "not the one asking"),
    ("batching.preempt", '''
def preempt(running, free_blocks):
    queue = list(running)
    scheduled, preempted = [], []
    i = 0
    while i < len(queue):
        rid, held, need = queue[i]
        while need > free_blocks:
            victim = queue.pop()
            preempted.append(victim[0])               # forgets to take back its blocks
            if victim[0] == rid:
                break
        else:
            free_blocks -= need
            scheduled.append(rid)
            i += 1
    return scheduled, preempted
''', "gives all its blocks back"),
    ("batching.preempt", '''
def preempt(running, free_blocks):
    queue = list(running)
    scheduled, preempted = [], []
    i = 0
    while i < len(queue):
        rid, held, need = queue[i]
        while need > free_blocks:
            victim = queue.pop(i + 1 if i + 1 < len(queue) else i)   # the next one, not the last
            preempted.append(victim[0])
            free_blocks += victim[1]
            if victim[0] == rid:
                break
        else:
            free_blocks -= need
            scheduled.append(rid)
            i += 1
    return scheduled, preempted
''', "victims come from the end of the list"),
    ("batching.preempt", '''
def preempt(running, free_blocks):
    return [rid for rid, _, _ in running]             # forgets the preempted list
''', "return a pair (scheduled, preempted)"),
]

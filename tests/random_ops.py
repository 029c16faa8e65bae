"""Random adds, aborts and steps against a real engine: the driver of the scheduler's and
speculative decoding's invariant tests (hypothesis draws the operations, as vLLM's scheduler tests
do with their own sequences)."""
from hypothesis import strategies as st


def operations(add_args: st.SearchStrategy) -> st.SearchStrategy:
    """Lists of ("add", drawn add_args), ("abort", index) and ("step", count) operations."""
    return st.lists(st.one_of(st.tuples(st.just("add"), add_args),
                              st.tuples(st.just("abort"), st.integers(0, 30)),
                              st.tuples(st.just("step"), st.integers(1, 3))),
                    min_size=1, max_size=25)


def drive(engine, ops, add, check) -> dict:
    """Run `ops`: an add calls add(engine, args) -> (request id, what to remember of it); an abort
    aborts the live request at that index (sorted ids, modulo their count); a step runs the engine
    that many times. check(engine) runs after every operation and every step of the final drain.
    Returns {request id: remembered} for every request that was not aborted."""
    live, kept = {}, {}
    for op in ops:
        if op[0] == "add":
            rid, info = add(engine, op[1])
            live[rid] = info
        elif op[0] == "abort":
            if live:
                rid = sorted(live)[op[1] % len(live)]
                engine.abort_request(rid)
                live.pop(rid)
        else:
            for _ in range(op[1]):
                engine.step()
        check(engine)
        for rid in [r for r in live if engine.get_sequence(r).is_finished]:
            kept[rid] = live.pop(rid)
    while engine.has_unfinished_requests():
        engine.step()
        check(engine)
    kept.update(live)
    return kept

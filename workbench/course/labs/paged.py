"""Lab 03 (paged KV cache): where a token's K and V live, and giving a sequence blocks as it grows.

The references are the engine's own: the runner's slot formula (`workbench/worker/model_runner.py`,
`plan_step`) and `BlockManager.allocate` over a `BlockPool` (`workbench/kv/`).
"""
from __future__ import annotations

import random

from workbench.kv.block_manager import BlockManager
from workbench.course.labs.core import Mismatch, call, exercise, expect_equal

CHAPTER = "03_paged_kv_cache"


def _reference_slots(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    # The runner's formula: slot of position p = block_table[p // block_size] * block_size + p % bs
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


@exercise("paged.slot_mapping", CHAPTER, "slot_mapping",
          "cache slots of token positions through a block table",
          hint="position p is in the (p // block_size)-th block of the sequence, at offset "
               "p % block_size; that block's physical id is block_table[p // block_size], and a "
               "block with id b holds slots b * block_size ... b * block_size + block_size - 1.")
def check_slot_mapping(slot_mapping) -> None:
    rng = random.Random(3)
    cases = [([7, 2, 9], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 4),
             ([5], [0, 15], 16),
             ([3, 0, 8, 1], [31, 16, 17, 0], 8)]
    for _ in range(20):
        bs = rng.choice([1, 2, 4, 16])
        table = rng.sample(range(64), rng.randint(1, 6))
        positions = rng.sample(range(len(table) * bs), rng.randint(1, len(table) * bs))
        cases.append((table, positions, bs))
    for table, positions, bs in cases:
        what = f"slot_mapping(block_table={table}, positions={positions}, block_size={bs})"
        got = call(slot_mapping, what, list(table), list(positions), bs)
        got = [int(s) for s in got] if got is not None else None
        expected = _reference_slots(table, positions, bs)
        if got == expected:
            continue
        if got == [table[p // bs] + p % bs for p in positions]:
            hint = "a block id counts blocks, not slots: multiply it by block_size."
        elif got == list(positions):
            hint = ("you returned the positions themselves: that is only right if the sequence's "
                    "blocks were 0, 1, 2, ... in order. Look the block up in block_table.")
        elif got == [table[p % len(table)] * bs + p // bs for p in positions]:
            hint = "// and % are swapped: the block index is p // block_size, the offset p % block_size."
        else:
            hint = ""
        expect_equal(got, expected, what, hint)


@exercise("paged.blocks_needed", CHAPTER, "blocks_needed",
          "how many more blocks a sequence needs to hold num_tokens",
          hint="a sequence of n tokens needs ceil(n / block_size) blocks: the last one may be "
               "partly empty. It already holds num_held of them, and never gives any back here.")
def check_blocks_needed(blocks_needed) -> None:
    manager = BlockManager(num_blocks=1, block_size=1)
    cases = [(0, 1, 16), (0, 16, 16), (0, 17, 16), (1, 16, 16), (1, 17, 16), (2, 17, 16),
             (3, 5, 4), (0, 0, 4), (5, 3, 1), (1, 1, 1)]
    for held, n, bs in cases:
        manager.block_size = bs     # blocks_for reads only the block size
        expected = max(0, manager.blocks_for(n) - held)
        what = f"blocks_needed(num_held={held}, num_tokens={n}, block_size={bs})"
        got = call(blocks_needed, what, held, n, bs)
        if got == expected:
            continue
        hint = ""
        if got == max(0, n // bs - held):
            hint = ("n // block_size rounds down: 17 tokens in blocks of 16 need 2 blocks, the "
                    "second holding one token. Round up: -(-n // block_size).")
        elif got == -(-n // bs):
            hint = "the sequence already holds num_held blocks: only the rest are new."
        elif isinstance(got, int) and got < 0:
            hint = "a sequence that already has enough blocks needs 0 more, not a negative number."
        expect_equal(got, expected, what, hint)


@exercise("paged.append", CHAPTER, "append",
          "grow a block table from the free list and return the new tokens' slots",
          hint="take blocks with free.pop() only while len(block_table) * block_size < "
               "num_computed + num_new; if free has too few, return None before changing anything.")
def check_append(append) -> None:
    rng = random.Random(7)
    for trial in range(30):
        bs, num_blocks = rng.choice([1, 2, 4, 8]), rng.randint(2, 12)
        manager = BlockManager(num_blocks=num_blocks, block_size=bs)
        free = list(range(num_blocks - 1, -1, -1))    # the pool's free list: pop() gives the lowest id
        tables: dict[str, list[int]] = {}
        lengths: dict[str, int] = {}
        history = []
        for _ in range(rng.randint(1, 10)):
            rid = rng.choice("abc")
            num_computed, num_new = lengths.get(rid, 0), rng.randint(1, 2 * bs + 1)
            table = tables.setdefault(rid, [])
            before = (list(table), list(free))
            call_text = (f"append(block_table={before[0]}, free={before[1]}, num_computed={num_computed}, "
                    f"num_new={num_new}, block_size={bs})")
            history.append(call_text)
            got = call(append, call_text, table, free, num_computed, num_new, bs)
            ok = manager.allocate(rid, num_computed, num_new)
            where = call_text + (f"\n  (earlier calls in this run: {len(history) - 1})" if len(history) > 1 else "")
            if not ok:
                if got is not None:
                    raise Mismatch(f"{where}: there are not enough free blocks, so append must "
                                   f"return None; it returned {got!r}",
                                   "check the free list holds enough blocks before taking any.")
                if (table, free) != before:
                    raise Mismatch(f"{where}: returned None but changed the block table or the "
                                   f"free list (now {table}, {free})",
                                   "a failed append must leave everything as it was: check first, "
                                   "then pop.")
                continue
            if got is None:
                raise Mismatch(f"{where}: returned None, but {len(free)} free blocks are enough",
                               "count only the blocks the new tokens need beyond those the "
                               "sequence already holds.")
            expected_table = manager.tables[rid]
            if table != expected_table:
                hint = ("take a block only when the last one is full: a sequence of n tokens holds "
                        "ceil(n / block_size) blocks." if len(table) != len(expected_table) else
                        "take free blocks with free.pop(), in order, and append them to the table.")
                expect_equal(table, expected_table, f"{where}: block table afterwards", hint)
            if len(free) != manager.pool.num_free:
                expect_equal(len(free), manager.pool.num_free,
                             f"{where}: free blocks left afterwards",
                             "remove every block you put into the table from the free list.")
            expected_slots = _reference_slots(expected_table,
                                              list(range(num_computed, num_computed + num_new)), bs)
            expect_equal([int(s) for s in got], expected_slots,
                         f"{where}: slots of the {num_new} new tokens (positions {num_computed}.."
                         f"{num_computed + num_new - 1})",
                         "the new tokens sit at positions num_computed ... num_computed + num_new - 1;"
                         " map each through the (grown) block table.")
            lengths[rid] = num_computed + num_new

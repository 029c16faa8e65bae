"""Reference solutions and typical wrong answers for lab 03 (tests only: never in a lab notebook).

SOLUTIONS: exercise id -> the source of a correct exercise cell.
WRONG: (exercise id, source of a wrong cell, a phrase the checker's message or hint must contain).
"""

SOLUTIONS = {
    "paged.slot_mapping": '''
def slot_mapping(block_table, positions, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]
''',
    "paged.blocks_needed": '''
def blocks_needed(num_held, num_tokens, block_size):
    return max(0, -(-num_tokens // block_size) - num_held)
''',
    "paged.append": '''
def append(block_table, free, num_computed, num_new, block_size):
    need = max(0, -(-(num_computed + num_new) // block_size) - len(block_table))
    if need > len(free):
        return None
    for _ in range(need):
        block_table.append(free.pop())
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(num_computed, num_computed + num_new)]
''',
}

WRONG = [
    ("paged.slot_mapping", '''
def slot_mapping(block_table, positions, block_size):
    return [block_table[p // block_size] + p % block_size for p in positions]
''', "multiply it by block_size"),
    ("paged.slot_mapping", '''
def slot_mapping(block_table, positions, block_size):
    return list(positions)
''', "Look the block up in block_table"),
    ("paged.blocks_needed", '''
def blocks_needed(num_held, num_tokens, block_size):
    return max(0, num_tokens // block_size - num_held)
''', "rounds down"),
    ("paged.blocks_needed", '''
def blocks_needed(num_held, num_tokens, block_size):
    return -(-num_tokens // block_size) - num_held
''', "not a negative number"),
    ("paged.append", '''
def append(block_table, free, num_computed, num_new, block_size):
    need = max(0, -(-(num_computed + num_new) // block_size) - len(block_table))
    while need and free:        # takes what it can even when it cannot finish
        block_table.append(free.pop())
        need -= 1
    if need:
        return None
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(num_computed, num_computed + num_new)]
''', "leave everything as it was"),
    ("paged.append", '''
def append(block_table, free, num_computed, num_new, block_size):
    need = max(0, -(-(num_computed + num_new) // block_size) - len(block_table))
    if need > len(free):
        return None
    for _ in range(need):
        block_table.append(free.pop(0))     # the highest id first: not the pool's order
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(num_computed, num_computed + num_new)]
''', "free.pop()"),
]

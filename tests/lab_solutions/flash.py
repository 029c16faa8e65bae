"""Reference solutions and typical wrong answers for lab 04 (tests only: never in a lab notebook).

SOLUTIONS: exercise id -> the source of a correct exercise cell.
WRONG: (exercise id, source of a wrong cell, a phrase the checker's message or hint must contain).
"""

SOLUTIONS = {
    "flash.online_softmax_update": '''
import torch

def online_softmax_update(m, l, acc, s, v):
    m_new = torch.maximum(m, s.max(dim=1).values)
    p = torch.exp(s - m_new[:, None])
    alpha = torch.exp(m - m_new)
    l = alpha * l + p.sum(dim=1)
    acc = alpha[:, None] * acc + p @ v
    return m_new, l, acc
''',
    "flash.tile_plan": '''
def tile_plan(q_len, kv_len, block_m, block_n):
    shift = kv_len - q_len
    plan = []
    for m0 in range(0, q_len, block_m):
        first = m0 + shift                                   # the tile's first query position
        last = min(m0 + block_m, q_len) - 1 + shift          # and its last
        row = []
        for n0 in range(0, kv_len, block_n):
            if n0 > last:
                row.append("skip")
            elif n0 + block_n - 1 <= first and n0 + block_n <= kv_len:
                row.append("full")
            else:
                row.append("masked")
        plan.append(row)
    return plan
''',
    "flash.merge_partials": '''
import torch

def merge_partials(outs, lse):
    w = torch.exp(lse - lse.max(dim=0).values)
    w = w / w.sum(dim=0)
    return (w[..., None] * outs).sum(dim=0)
''',
}

_UPDATE = '''
import torch

def online_softmax_update(m, l, acc, s, v):
    m_new = {M}
    p = torch.exp(s - m_new[:, None])
    alpha = {ALPHA}
    l = {L}
    acc = {ACC}
    return m_new, l, acc
'''
_UPDATE_OK = dict(M="torch.maximum(m, s.max(dim=1).values)", ALPHA="torch.exp(m - m_new)",
                  L="alpha * l + p.sum(dim=1)", ACC="alpha[:, None] * acc + p @ v")

_PLAN = '''
def tile_plan(q_len, kv_len, block_m, block_n):
    shift = {SHIFT}
    plan = []
    for m0 in range(0, q_len, block_m):
        first = m0 + shift
        last = min(m0 + block_m, q_len) - 1 + shift
        row = []
        for n0 in range(0, kv_len, block_n):
            if n0 > {SKIP_ROW}:
                row.append("skip")
            elif {LAST_KEY} <= {FULL_ROW}{WHOLE}:
                row.append("full")
            else:
                row.append("masked")
        plan.append(row)
    return plan
'''
_PLAN_OK = dict(SHIFT="kv_len - q_len", SKIP_ROW="last", FULL_ROW="first",
                LAST_KEY="n0 + block_n - 1", WHOLE=" and n0 + block_n <= kv_len")

_MERGE = '''
import torch

def merge_partials(outs, lse):
    {BODY}
'''


def _src(template, ok, **change):
    return template.format(**{**ok, **change})


WRONG = [
    ("flash.online_softmax_update", _src(_UPDATE, _UPDATE_OK, ACC="acc + p @ v"),
     "multiply acc by alpha"),
    ("flash.online_softmax_update", _src(_UPDATE, _UPDATE_OK, L="l + p.sum(dim=1)"),
     "l_new = alpha * l"),
    ("flash.online_softmax_update", _src(_UPDATE, _UPDATE_OK, ALPHA="torch.exp(m_new - m)"),
     "alpha = exp(m - m_new) is then 0"),
    ("flash.online_softmax_update", _src(_UPDATE, _UPDATE_OK, M="s.max(dim=1).values",
                                         ALPHA="torch.exp(m - m_new)"),
     "not the tile's max alone"),
    ("flash.online_softmax_update", '''
import torch

def online_softmax_update(m, l, acc, s, v):
    m_new = torch.maximum(m, s.max(dim=1).values)
    p = torch.exp(s - m_new[:, None])
    alpha = torch.exp(m - m_new)
    l = alpha * l + p.sum(dim=1)
    acc = alpha[:, None] * acc + p @ v
    return m_new, l, acc / l[:, None]        # normalized every tile
''', "keep acc unnormalized"),
    ("flash.online_softmax_update", '''
import torch

def online_softmax_update(m, l, acc, s, v):
    tile_max = s.max(dim=1).values
    p = torch.exp(s - tile_max[:, None])      # against the tile's own max
    m_new = torch.maximum(m, tile_max)
    alpha = torch.exp(m - m_new)
    beta = torch.exp(tile_max - m_new)
    l = alpha * l + beta * p.sum(dim=1)
    acc = alpha[:, None] * acc + beta[:, None] * (p @ v)
    return m_new, l, acc
''', "never the tile's own max"),
    ("flash.online_softmax_update", '''
import torch

def online_softmax_update(m, l, acc, s, v):
    p = torch.exp(s)                          # no max subtracted
    return torch.maximum(m, s.max(dim=1).values), l + p.sum(dim=1), acc + p @ v
''', "relative to the running max"),
    ("flash.tile_plan", _src(_PLAN, _PLAN_OK, SHIFT="0"), "aligned bottom-right"),
    ("flash.tile_plan", _src(_PLAN, _PLAN_OK, LAST_KEY="min(n0 + block_n, kv_len) - 1", WHOLE=""),
     "runs past kv_len"),
    ("flash.tile_plan", _src(_PLAN, _PLAN_OK, SKIP_ROW="first"), "the *last* query row"),
    ("flash.tile_plan", _src(_PLAN, _PLAN_OK, FULL_ROW="last"), "the *first* query row"),
    ("flash.tile_plan", '''
def tile_plan(q_len, kv_len, block_m, block_n):
    return [[0] * -(-kv_len // block_n) for _ in range(-(-q_len // block_m))]
''', "entries must be 'skip', 'masked' or 'full'"),
    ("flash.merge_partials", _MERGE.format(BODY="return outs.mean(dim=0)"), "plain average"),
    ("flash.merge_partials", _MERGE.format(
        BODY="w = torch.exp(lse)\n    return (w[..., None] * outs).sum(dim=0) / w.sum(dim=0)[..., None]"),
     "overflows or underflows"),
    ("flash.merge_partials", _MERGE.format(
        BODY="w = torch.exp(lse - lse.max(dim=0).values)\n    return (w[..., None] * outs).sum(dim=0)"),
     "divide by the sum of the weights"),
    ("flash.merge_partials", _MERGE.format(
        BODY="w = torch.softmax(lse, dim=-1)\n    return (w[..., None] * outs).sum(dim=0)"),
     "not over the query rows"),
    ("flash.merge_partials", _MERGE.format(
        BODY="w = torch.softmax(lse, dim=0)\n    return (w[..., None] * outs).sum(dim=0), w"),
     "return only the merged output"),
]

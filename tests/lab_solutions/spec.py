"""Reference solutions and typical wrong answers for lab 06 (tests only: never in a lab notebook).

SOLUTIONS: exercise id -> the source of a correct exercise cell.
WRONG: (exercise id, source of a wrong cell, a phrase the checker's message or hint must contain).
"""

SOLUTIONS = {
    "spec.verify_greedy": '''
def verify_greedy(target_logits, drafts):
    best = target_logits.argmax(-1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return drafts[:a] + [best[a]]
''',
    "spec.residual": '''
def residual(p, q):
    r = (p - q).clamp(min=0)
    if r.sum() <= 0:
        return p
    return r / r.sum()
''',
    # Self-contained (the tests run each cell alone); in the notebook it may call residual().
    "spec.verify_sampled": '''
import torch

def verify_sampled(target_probs, drafts, draft_probs, generator):
    out = []
    for i, x in enumerate(drafts):
        p = target_probs[i]
        q = torch.zeros_like(p) if draft_probs is None else draft_probs[i]
        if draft_probs is None:
            q[x] = 1.0
        u = torch.rand((), generator=generator).item()
        if q[x] > 0 and u < p[x] / q[x]:
            out.append(x)
            continue
        r = (p - q).clamp(min=0)
        if r.sum() <= 0:
            r = p
        out.append(int(torch.multinomial(r, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))
    return out
''',
}

# A correct verify_sampled whose pieces the wrong answers below replace one at a time.
_SAMPLED = '''
import torch

def verify_sampled(target_probs, drafts, draft_probs, generator):
    out = []
    for i, x in enumerate(drafts):
        p = target_probs[{ROW}]
        q = torch.zeros_like(p) if draft_probs is None else draft_probs[{ROW}]
        if draft_probs is None:
            q[x] = 1.0
        u = torch.rand((), generator={GEN}).item()
        if {ACCEPT}:
            out.append(x)
            continue
        r = {RESIDUAL}
        if r.sum() <= 0:
            r = p
        out.append(int(torch.multinomial(r, 1, generator={GEN})))
        return out
    {BONUS}
    return out
'''


def _sampled(row="i", gen="generator", accept="q[x] > 0 and u < p[x] / q[x]",
             residual="(p - q).clamp(min=0)",
             bonus="out.append(int(torch.multinomial(target_probs[len(drafts)], 1, "
                   "generator=generator)))"):
    return (_SAMPLED.replace("{ROW}", row).replace("{GEN}", gen).replace("{ACCEPT}", accept)
            .replace("{RESIDUAL}", residual).replace("{BONUS}", bonus))


WRONG = [
    ("spec.verify_greedy", '''
def verify_greedy(target_logits, drafts):
    best = target_logits.argmax(-1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return drafts[:a] + ([best[a]] if a < len(drafts) else [])    # no bonus token
''', "bonus token"),
    ("spec.verify_greedy", '''
def verify_greedy(target_logits, drafts):
    best = target_logits.argmax(-1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return drafts[:a] + [drafts[a] if a < len(drafts) else best[a]]   # keeps the wrong draft
''', "not the rejected draft"),
    ("spec.verify_greedy", '''
def verify_greedy(target_logits, drafts):
    best = target_logits.argmax(-1).tolist()
    kept = [d for d, b in zip(drafts, best) if d == b]     # every match, not the prefix
    return kept + [best[len(kept)]]
''', "stop at the first mismatch"),
    ("spec.verify_greedy", '''
def verify_greedy(target_logits, drafts):
    return target_logits.argmax(-1)                          # a tensor, and every row
''', "return a list of Python ints"),
    ("spec.residual", '''
def residual(p, q):
    return (p - q).clamp(min=0)                              # not normalised
''', "divide max(0, p - q) by its sum"),
    ("spec.residual", '''
def residual(p, q):
    r = (p - q).clamp(min=0)
    return r / r.sum()                                       # nan when p == q
''', "when p == q"),
    ("spec.residual", '''
def residual(p, q):
    r = (q - p).clamp(min=0)
    return r / r.sum() if r.sum() > 0 else p
''', "not q - p"),
    ("spec.residual", '''
def residual(p, q):
    r = (p - q).clamp(min=0)
    return (r / r.sum() if r.sum() > 0 else p).tolist()
''', "return a torch tensor"),
    ("spec.verify_sampled", _sampled(accept="p[x] >= q[x]"), "is deterministic"),
    ("spec.verify_sampled", _sampled(accept="u < p[x]"), "not p(x)"),
    ("spec.verify_sampled", _sampled(residual="p.clone()"), "not from p"),
    ("spec.verify_sampled", _sampled(residual="p - q"), "clamp p - q at zero"),
    ("spec.verify_sampled", _sampled(bonus="pass"), "bonus token"),
    ("spec.verify_sampled", _sampled(row="0"), "row i of target_probs"),
    ("spec.verify_sampled", _sampled(gen="None"), "draw every random number from `generator`"),
    ("spec.verify_sampled", '''
import torch

def verify_sampled(target_probs, drafts, draft_probs, generator):
    out = []
    for i, x in enumerate(drafts):
        p = target_probs[i]
        if draft_probs is None:             # zeroes the target's own row: changes the input
            u = torch.rand((), generator=generator).item()
            if u < p[x]:
                out.append(x)
                continue
            p[x] = 0.0
            out.append(int(torch.multinomial(p, 1, generator=generator)))
            return out
        q = draft_probs[i]
        u = torch.rand((), generator=generator).item()
        if u < p[x] / q[x]:
            out.append(x)
            continue
        out.append(int(torch.multinomial((p - q).clamp(min=0), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))
    return out
''', "in place"),
]

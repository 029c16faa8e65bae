"""Reference solutions and typical wrong answers for lab 01 (tests only: never in a lab notebook).

SOLUTIONS: exercise id -> the source of a correct exercise cell.
WRONG: (exercise id, source of a wrong cell, a phrase the checker's message or hint must contain).
"""

SOLUTIONS = {
    "speed.attribute": '''
from workbench.bench.anatomy import ATTENTION_OPS, MATMUL_OPS

def attribute(events, forward_s):
    buckets = {"matmul": 0.0, "attention": 0.0, "other ops": 0.0}
    for name, self_s in events:
        low = name.lower()
        if any(p in low for p in MATMUL_OPS):
            buckets["matmul"] += self_s
        elif any(p in low for p in ATTENTION_OPS):
            buckets["attention"] += self_s
        else:
            buckets["other ops"] += self_s
    buckets["overhead"] = max(forward_s - sum(buckets.values()), 0.0)
    return buckets
''',
    "speed.achieved_bandwidth": '''
def achieved_bandwidth(weight_bytes, kv_bytes_per_token, context_len, batch, tok_s):
    bytes_per_step = weight_bytes + batch * kv_bytes_per_token * context_len
    return bytes_per_step * tok_s / batch / 1e9
''',
    "speed.roofline_tok_s": '''
def roofline_tok_s(weight_bytes, kv_bytes_per_token, context_len, batch, flops_per_token,
                   bandwidth_gbs, peak_gflops):
    memory = batch * bandwidth_gbs * 1e9 / (weight_bytes + batch * kv_bytes_per_token * context_len)
    compute = peak_gflops * 1e9 / flops_per_token
    return min(memory, compute)
''',
}

_ATTRIBUTE = '''
from workbench.bench.anatomy import ATTENTION_OPS, MATMUL_OPS

def attribute(events, forward_s):
    buckets = {{"matmul": 0.0, "attention": 0.0, "other ops": 0.0}}
    for name, self_s in events:
        low = name.lower()
        if {MATMUL}:
            buckets["matmul"] += self_s
        elif {ATTN}:
            buckets["attention"] += self_s
        else:
            buckets["other ops"] += self_s
    {OVERHEAD}
    return buckets
'''
_OK = dict(MATMUL="any(p in low for p in MATMUL_OPS)", ATTN="any(p in low for p in ATTENTION_OPS)",
           OVERHEAD='buckets["overhead"] = max(forward_s - sum(buckets.values()), 0.0)')


def _attribute(**change):
    return _ATTRIBUTE.format(**{**_OK, **change})


WRONG = [
    ("speed.attribute", _attribute(OVERHEAD='buckets["overhead"] = forward_s - sum(buckets.values())'),
     "never negative"),
    ("speed.attribute", _attribute(OVERHEAD='buckets["overhead"] = forward_s'), "not the whole forward"),
    ("speed.attribute", _attribute(OVERHEAD="pass"), "lacks 'overhead'"),
    ("speed.attribute", _attribute(
        OVERHEAD='buckets["overhead"] = max(forward_s - buckets["matmul"], 0.0)'), "not only the matmuls"),
    ("speed.attribute", _attribute(MATMUL="name in MATMUL_OPS", ATTN="name in ATTENTION_OPS"),
     "*contains*"),
    ("speed.attribute", _attribute(MATMUL="any(p in low for p in MATMUL_OPS + ATTENTION_OPS)"),
     "are not matmuls"),
    ("speed.achieved_bandwidth", '''
def achieved_bandwidth(weight_bytes, kv_bytes_per_token, context_len, batch, tok_s):
    return (weight_bytes + batch * kv_bytes_per_token * context_len) * tok_s / 1e9
''', "not tok_s times"),
    ("speed.achieved_bandwidth", '''
def achieved_bandwidth(weight_bytes, kv_bytes_per_token, context_len, batch, tok_s):
    return (weight_bytes + kv_bytes_per_token * context_len) * tok_s / batch / 1e9
''', "its own context"),
    ("speed.achieved_bandwidth", '''
def achieved_bandwidth(weight_bytes, kv_bytes_per_token, context_len, batch, tok_s):
    return (weight_bytes + kv_bytes_per_token * context_len) * tok_s / 1e9
''', "read once per step"),
    ("speed.achieved_bandwidth", '''
def achieved_bandwidth(weight_bytes, kv_bytes_per_token, context_len, batch, tok_s):
    return (weight_bytes + batch * kv_bytes_per_token * context_len) * tok_s / batch / 2**30
''', "not 2**30"),
    ("speed.achieved_bandwidth", '''
def achieved_bandwidth(weight_bytes, kv_bytes_per_token, context_len, batch, tok_s):
    return weight_bytes * tok_s / batch / 1e9
''', "K/V of the context"),
    ("speed.roofline_tok_s", '''
def roofline_tok_s(weight_bytes, kv_bytes_per_token, context_len, batch, flops_per_token,
                   bandwidth_gbs, peak_gflops):
    memory = batch * bandwidth_gbs * 1e9 / (weight_bytes + batch * kv_bytes_per_token * context_len)
    return max(memory, peak_gflops * 1e9 / flops_per_token)
''', "*lower* roof"),
    ("speed.roofline_tok_s", '''
def roofline_tok_s(weight_bytes, kv_bytes_per_token, context_len, batch, flops_per_token,
                   bandwidth_gbs, peak_gflops):
    return batch * bandwidth_gbs * 1e9 / (weight_bytes + batch * kv_bytes_per_token * context_len)
''', "arithmetic is the limit"),
    ("speed.roofline_tok_s", '''
def roofline_tok_s(weight_bytes, kv_bytes_per_token, context_len, batch, flops_per_token,
                   bandwidth_gbs, peak_gflops):
    memory = bandwidth_gbs * 1e9 / (weight_bytes + kv_bytes_per_token * context_len)
    return min(memory, peak_gflops * 1e9 / flops_per_token)
''', "reads the weights once"),
    ("speed.roofline_tok_s", '''
def roofline_tok_s(weight_bytes, kv_bytes_per_token, context_len, batch, flops_per_token,
                   bandwidth_gbs, peak_gflops):
    memory = batch * bandwidth_gbs * 1e9 / (batch * weight_bytes + batch * kv_bytes_per_token * context_len)
    return min(memory, peak_gflops * 1e9 / flops_per_token)
''', "not once per sequence"),
    ("speed.roofline_tok_s", '''
def roofline_tok_s(weight_bytes, kv_bytes_per_token, context_len, batch, flops_per_token,
                   bandwidth_gbs, peak_gflops):
    memory = batch * bandwidth_gbs * 1e9 / (weight_bytes + batch * kv_bytes_per_token * context_len)
    return min(memory, peak_gflops / flops_per_token)
''', "GFLOP/s"),
]

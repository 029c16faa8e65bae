"""Reference solutions and typical wrong answers for lab 00 (tests only: never in a lab notebook).

SOLUTIONS: exercise id -> the source of a correct exercise cell.
WRONG: (exercise id, source of a wrong cell, a phrase the checker's message or hint must contain).
"""

SOLUTIONS = {
    "tour.next_token_probs": '''
import torch

def next_token_probs(logits, temperature, top_k, top_p):
    if temperature == 0:
        probs = torch.zeros(logits.shape[0])
        probs[logits.argmax()] = 1.0
        return probs
    x = logits.float() / temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.shape[0]:
        keep = x >= torch.topk(x, top_k).values[-1]
    if top_p < 1.0:
        p = x.masked_fill(~keep, float("-inf")).softmax(-1)
        sorted_p, order = torch.sort(p, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        keep[order[before >= top_p]] = False
    return x.masked_fill(~keep, float("-inf")).softmax(-1)
''',
    "tour.kv_bytes_per_token": '''
import torch

def kv_bytes_per_token(config, dtype):
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * elem
''',
    "tour.decode_ceiling": '''
def decode_ceiling(weight_bytes, kv_bytes_per_token, context_len, bandwidth_gbs):
    return bandwidth_gbs * 1e9 / (weight_bytes + kv_bytes_per_token * context_len)
''',
}

_PROBS = '''
import torch

def next_token_probs(logits, temperature, top_k, top_p):
    if temperature == 0:
        probs = torch.zeros(logits.shape[0])
        probs[logits.argmax()] = 1.0
        return probs
    x = {SCALE}
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.shape[0]:
        {TOPK}
    if top_p < 1.0:
        p = x.masked_fill(~keep, float("-inf")).softmax(-1)
        sorted_p, order = torch.sort(p, descending=True)
        {TOPP}
    return x.masked_fill(~keep, float("-inf")).softmax(-1)
'''
_OK = dict(SCALE="logits.float() / temperature",
           TOPK="keep = x >= torch.topk(x, top_k).values[-1]",
           TOPP="keep[order[sorted_p.cumsum(-1) - sorted_p >= top_p]] = False")


def _probs(**change):
    return _PROBS.format(**{**_OK, **change})


WRONG = [
    ("tour.next_token_probs", _probs(SCALE="logits.float() * temperature"), "do not multiply"),
    ("tour.next_token_probs", _probs(
        TOPK="keep = torch.zeros_like(keep)\n        keep[torch.topk(x, top_k).indices] = True"),
     "tied tokens all stay"),
    ("tour.next_token_probs", _probs(TOPP="keep[order[sorted_p.cumsum(-1) > top_p]] = False"),
     "the token that crosses top_p stays"),
    ("tour.next_token_probs", '''
import torch

def next_token_probs(logits, temperature, top_k, top_p):
    return (logits / temperature).softmax(-1)     # divides by zero when greedy
''', "do not divide by it"),
    ("tour.next_token_probs", '''
import torch

def next_token_probs(logits, temperature, top_k, top_p):
    return int(logits.argmax())
''', "one-hot vector"),
    ("tour.next_token_probs", '''
import torch

def next_token_probs(logits, temperature, top_k, top_p):
    if temperature == 0:
        probs = torch.zeros(logits.shape[0])
        probs[logits.argmax()] = 1.0
        return probs
    e = torch.exp(logits / temperature)           # no max subtracted: overflows
    return e / e.sum()
''', "Subtract the row's max"),
    ("tour.next_token_probs", '''
import torch

def next_token_probs(logits, temperature, top_k, top_p):
    if temperature == 0:
        probs = torch.zeros(logits.shape[0])
        probs[logits.argmax()] = 1.0
        return probs
    x = logits.float() / temperature
    probs = x.softmax(-1)
    if 0 < top_k < x.shape[0]:
        probs[x < torch.topk(x, top_k).values[-1]] = 0.0   # not renormalized
    return probs
''', "renormalize"),
    ("tour.kv_bytes_per_token", '''
import torch

def kv_bytes_per_token(config, dtype):
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config["num_hidden_layers"] * config["num_attention_heads"] * head_dim * elem
''', "grouped-query attention"),
    ("tour.kv_bytes_per_token", '''
import torch

def kv_bytes_per_token(config, dtype):
    kv_heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    elem = torch.empty((), dtype=dtype).element_size()
    return config["num_hidden_layers"] * kv_heads * head_dim * elem
''', "the factor 2"),
    ("tour.kv_bytes_per_token", '''
import torch

def kv_bytes_per_token(config, dtype):
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config["hidden_size"] // heads
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * elem
''', "use it"),
    ("tour.kv_bytes_per_token", '''
def kv_bytes_per_token(config, dtype):
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * 2     # bf16 only
''', "element size"),
    ("tour.kv_bytes_per_token", '''
import torch

def kv_bytes_per_token(config, dtype):
    kv_heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * elem
''', "without num_key_value_heads"),
    ("tour.decode_ceiling", '''
def decode_ceiling(weight_bytes, kv_bytes_per_token, context_len, bandwidth_gbs):
    return bandwidth_gbs * 1e9 / weight_bytes
''', "K and V of every context token"),
    ("tour.decode_ceiling", '''
def decode_ceiling(weight_bytes, kv_bytes_per_token, context_len, bandwidth_gbs):
    return bandwidth_gbs * 2**30 / (weight_bytes + kv_bytes_per_token * context_len)
''', "not 2**30"),
    ("tour.decode_ceiling", '''
def decode_ceiling(weight_bytes, kv_bytes_per_token, context_len, bandwidth_gbs):
    return (weight_bytes + kv_bytes_per_token * context_len) / (bandwidth_gbs * 1e9)
''', "seconds per token"),
]

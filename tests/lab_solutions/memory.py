"""Reference solutions and typical wrong answers for lab 11 (tests only: never in a lab notebook).

SOLUTIONS: exercise id -> the source of a correct exercise cell.
WRONG: (exercise id, source of a wrong cell, a phrase the checker's message or hint must contain).
"""

SOLUTIONS = {
    "memory.kv_bytes_per_token": '''
def kv_bytes_per_token(config, kv_bytes):
    layers = config["num_hidden_layers"]
    if config.get("kv_lora_rank"):
        return layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * kv_bytes
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * layers * kv_heads * head_dim * kv_bytes
''',
}

WRONG = [
    ("memory.kv_bytes_per_token", '''
def kv_bytes_per_token(config, kv_bytes):
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * heads * head_dim * kv_bytes
''', "grouped-query attention"),
    ("memory.kv_bytes_per_token", '''
def kv_bytes_per_token(config, kv_bytes):
    layers = config["num_hidden_layers"]
    if config.get("kv_lora_rank"):
        return 2 * layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * kv_bytes
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * layers * kv_heads * head_dim * kv_bytes
''', "no factor 2"),
    ("memory.kv_bytes_per_token", '''
def kv_bytes_per_token(config, kv_bytes):
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return config["num_hidden_layers"] * kv_heads * head_dim * kv_bytes
''', "count both"),
    ("memory.kv_bytes_per_token", '''
def kv_bytes_per_token(config, kv_bytes):
    layers = config["num_hidden_layers"]
    if config.get("kv_lora_rank"):
        return layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * layers * kv_heads * head_dim
''', "bytes of one element"),
]

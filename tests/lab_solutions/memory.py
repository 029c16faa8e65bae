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
    "memory.spill": '''
def spill(block_hash, cpu, disk, cpu_capacity, disk_capacity):
    def to_disk(h):
        if disk_capacity == 0:
            return
        if len(disk) == disk_capacity:
            disk.pop(0)
        disk.append(h)
    if cpu_capacity == 0:
        to_disk(block_hash)
        return
    if len(cpu) == cpu_capacity:
        to_disk(cpu.pop(0))
    cpu.append(block_hash)
''',
    "memory.lookup": '''
def lookup(hashes, device, cpu, disk):
    found = []
    for h in hashes:
        if h in device:
            found.append("device")
        elif h in cpu:
            found.append("cpu")
        elif h in disk:
            found.append("disk")
        else:
            break
    return found
''',
    "memory.reduce_scatter": '''
import torch

def reduce_scatter(partials, num_tokens):
    n = len(partials)
    padded = -(-num_tokens // n) * n
    total = torch.zeros(padded, partials[0].shape[1])
    total[:num_tokens] = sum(partials)
    return list(total.split(padded // n))
''',
    "memory.all_gather": '''
import torch

def all_gather(slices, num_tokens):
    return torch.cat(slices)[:num_tokens]
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
    ("memory.spill", '''
def spill(block_hash, cpu, disk, cpu_capacity, disk_capacity):
    if len(cpu) < cpu_capacity:
        cpu.append(block_hash)
    elif len(disk) < disk_capacity:
        disk.append(block_hash)          # the new block goes down instead of the CPU's oldest
''', "oldest entry"),
    ("memory.spill", '''
def spill(block_hash, cpu, disk, cpu_capacity, disk_capacity):
    if cpu_capacity and len(cpu) == cpu_capacity:
        disk.append(cpu.pop(0))          # the disk never evicts
    if cpu_capacity:
        cpu.append(block_hash)
    else:
        disk.append(block_hash)
''', "never holds more than its capacity"),
    ("memory.lookup", '''
def lookup(hashes, device, cpu, disk):
    found = []
    for h in hashes:
        if h in device:
            found.append("device")
        elif h in cpu:
            found.append("cpu")
        elif h in disk:
            found.append("disk")
    return found
''', "stop at the first hash found nowhere"),
    ("memory.reduce_scatter", '''
def reduce_scatter(partials, num_tokens):
    n = len(partials)
    return list(sum(partials).tensor_split(n))      # no padding: unequal slices
''', "pad"),
    ("memory.all_gather", '''
import torch

def all_gather(slices, num_tokens):
    return torch.cat(slices)                          # padding kept
''', "cut the padding"),
]

"""Reference solutions and typical wrong answers for lab 02 (tests only: never in a lab notebook).

SOLUTIONS: exercise id -> the source of a correct exercise cell.
WRONG: (exercise id, source of a wrong cell, a phrase the checker's message or hint must contain).
"""

SOLUTIONS = {
    "quant.quantize_int8": '''
import torch

def quantize_int8(w):
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale
''',
    "quant.quantize_int4": '''
import torch

def quantize_int4(w, group_size):
    n, k = w.shape
    w = torch.nn.functional.pad(w.float(), (0, -k % group_size))
    g = w.view(n, -1, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return codes.view(n, -1).to(torch.uint8), scale, lo
''',
    "quant.dequantize_int4": '''
import torch

def dequantize_int4(packed, scale, minimum, group_size, in_features):
    n = packed.shape[0]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(n, -1).float()
    w = codes * scale.repeat_interleave(group_size, dim=1) + minimum.repeat_interleave(group_size, dim=1)
    return w[:, :in_features]
''',
}

_INT8 = '''
import torch

def quantize_int8(w):
    w = w.float()
    scale = ({SCALE}).clamp(min=1e-12)
    q = {Q}
    return q, scale
'''
_INT8_OK = dict(SCALE="w.abs().amax(dim=1) / 127",
                Q="torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)")

_INT4 = '''
import torch

def quantize_int4(w, group_size):
    n, k = w.shape
    w = {PAD}
    g = w.view({VIEW})
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ({SCALE}).clamp(min=1e-12)
    codes = {CODES}.clamp(0, 15)
    return codes.reshape(n, -1).to(torch.uint8), scale, {MIN}
'''
_INT4_OK = dict(PAD="torch.nn.functional.pad(w.float(), (0, -k % group_size))",
                VIEW="n, -1, group_size", SCALE="(hi - lo) / 15", MIN="lo",
                CODES="torch.round((g - lo[..., None]) / scale[..., None])")

_DEQ = '''
import torch

def dequantize_int4(packed, scale, minimum, group_size, in_features):
    n = packed.shape[0]
    codes = {CODES}.float()
    w = codes * {EXPAND_S} + {EXPAND_M}
    return w{CROP}
'''
_DEQ_OK = dict(CODES="torch.stack([packed & 0xF, packed >> 4], dim=-1).view(n, -1)",
               EXPAND_S="scale.repeat_interleave(group_size, dim=1)",
               EXPAND_M="minimum.repeat_interleave(group_size, dim=1)", CROP="[:, :in_features]")


def _src(template, ok, **change):
    return template.format(**{**ok, **change})


WRONG = [
    ("quant.quantize_int8", _src(_INT8, _INT8_OK, SCALE="w.abs().max() / 127 * torch.ones(w.shape[0])"),
     "one scale per output row"),
    ("quant.quantize_int8", _src(_INT8, _INT8_OK, SCALE="w.abs().amax(dim=1) / 128"),
     "divide by 127"),
    ("quant.quantize_int8", _src(_INT8, _INT8_OK, SCALE="w.amax(dim=1) / 127"),
     "largest *magnitude*"),
    ("quant.quantize_int8", _src(_INT8, _INT8_OK, Q="(w / scale[:, None]).clamp(-127, 127).to(torch.int8)"),
     "truncates"),
    ("quant.quantize_int8", _src(_INT8, _INT8_OK, SCALE="w.abs().amax(dim=0) / 127",
                                 Q="torch.round(w / scale[None, :]).clamp(-127, 127).to(torch.int8)"),
     "one per column"),
    ("quant.quantize_int8", _src(_INT8, _INT8_OK, Q="torch.round(w / scale[:, None]).clamp(-127, 127)"),
     "torch.int8"),
    ("quant.quantize_int8", '''
import torch

def quantize_int8(w):
    scale = w.abs().amax(dim=1) / 127        # in w's dtype: bf16 stays bf16
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale
''', "float32"),
    ("quant.quantize_int8", '''
import torch

def quantize_int8(w):
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
''', "expected a tuple (q, scale)"),
    ("quant.quantize_int4", _src(_INT4, _INT4_OK, SCALE="(hi - lo) / 16"), "15 steps"),
    ("quant.quantize_int4", _src(_INT4, _INT4_OK, SCALE="g.abs().amax(dim=-1) / 7.5",
                                 MIN="-g.abs().amax(dim=-1)",
                                 CODES="torch.round((g + g.abs().amax(dim=-1, keepdim=True)) / scale[..., None])"),
     "asymmetric"),
    ("quant.quantize_int4", _src(_INT4, _INT4_OK, VIEW="n, group_size, -1).transpose(1, 2"),
     "*consecutive* weights"),
    ("quant.quantize_int4", _src(_INT4, _INT4_OK, PAD="w.float()"), "pad the columns with zeros"),
    ("quant.quantize_int4", _src(_INT4, _INT4_OK, CODES="((g - lo[..., None]) / scale[..., None]).floor()"),
     "do not truncate"),
    ("quant.quantize_int4", '''
import torch

def quantize_int4(w, group_size):
    n, k = w.shape
    lo_parts, hi_parts = [], []
    for j in range(0, k, group_size):          # min and max of the real weights only
        part = w[:, j:j + group_size].float()
        lo_parts.append(part.amin(dim=1))
        hi_parts.append(part.amax(dim=1))
    lo, hi = torch.stack(lo_parts, 1), torch.stack(hi_parts, 1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    g = torch.nn.functional.pad(w.float(), (0, -k % group_size)).view(n, -1, group_size)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return codes.view(n, -1).to(torch.uint8), scale, lo
''', "the zero padding is part of the last group's range"),
    ("quant.dequantize_int4", _src(_DEQ, _DEQ_OK, CODES="torch.stack([packed >> 4, packed & 0xF], dim=-1).view(n, -1)"),
     "nibble order"),
    ("quant.dequantize_int4", _src(_DEQ, _DEQ_OK, CODES="torch.cat([packed & 0xF, packed >> 4], dim=1)"),
     "interleave the nibbles"),
    ("quant.dequantize_int4", _src(_DEQ, _DEQ_OK, EXPAND_M="0"), "add each group's minimum"),
    ("quant.dequantize_int4", _src(_DEQ, _DEQ_OK, EXPAND_S="scale.repeat(1, group_size)",
                                   EXPAND_M="minimum.repeat(1, group_size)"), "repeat_interleave"),
    ("quant.dequantize_int4", _src(_DEQ, _DEQ_OK, CROP=""), "padding columns"),
    ("quant.dequantize_int4", _src(_DEQ, _DEQ_OK, CODES="(torch.stack([packed & 0xF, packed >> 4], dim=-1).view(n, -1).float() - 8)"),
     "do not subtract 8"),
]

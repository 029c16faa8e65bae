"""Reference solutions and typical wrong answers for lab 09 (tests only: never in a lab notebook).

SOLUTIONS: exercise id -> the source of a correct exercise cell.
WRONG: (exercise id, source of a wrong cell, a phrase the checker's message or hint must contain).
"""

SOLUTIONS = {
    "compress.two_four_mask": '''
import torch

def two_four_mask(score):
    rows, k = score.shape
    groups = score.reshape(rows, k // 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(2, groups.topk(2, dim=2).indices, True)
    return keep.reshape(rows, k)
''',
    "compress.wanda_score": '''
def wanda_score(weight, x):
    return weight.abs() * x.norm(dim=0)
''',
    "compress.forward_kl": '''
import torch.nn.functional as F

def forward_kl(student_logits, teacher_logprobs, temperature=1.0):
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = F.log_softmax(teacher_logprobs / temperature, dim=-1)
    return temperature ** 2 * (t.exp() * (t - s)).sum(-1).mean()
''',
    "compress.reverse_kl": '''
import torch.nn.functional as F

def reverse_kl(student_logits, teacher_logprobs):
    s = F.log_softmax(student_logits, dim=-1)
    return (s.exp() * (s - teacher_logprobs)).sum(-1).mean()
''',
}

WRONG = [
    ("compress.two_four_mask", '''
import torch

def two_four_mask(score):
    rows, k = score.shape
    groups = score.reshape(rows, k // 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(2, groups.topk(2, dim=2, largest=False).indices, True)
    return keep.reshape(rows, k)
''', "highest"),
    ("compress.two_four_mask", '''
import torch

def two_four_mask(score):
    keep = torch.zeros_like(score, dtype=torch.bool)
    keep.scatter_(1, score.topk(score.shape[1] // 2, dim=1).indices, True)
    return keep
''', "not 50% of the whole row"),
    ("compress.two_four_mask", '''
def two_four_mask(score):
    rows, k = score.shape
    groups = score.reshape(rows, k // 4, 4)
    second = groups.sort(dim=2, descending=True).values[..., 1:2]
    return (groups >= second).reshape(rows, k).float()
''', "torch.bool"),
    ("compress.two_four_mask", '''
import torch

def two_four_mask(score):
    t = score.t()
    rows, k = t.shape
    groups = t.reshape(rows, k // 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(2, groups.topk(2, dim=2).indices, True)
    return keep.reshape(rows, k).t()
''', "consecutive rows"),
    ("compress.wanda_score", '''
def wanda_score(weight, x):
    return weight.abs() * x.pow(2).sum(0)
''', "square root"),
    ("compress.wanda_score", '''
def wanda_score(weight, x):
    return weight * x.norm(dim=0)
''', "|W|"),
    ("compress.wanda_score", '''
def wanda_score(weight, x):
    return weight.abs() * x.pow(2).mean(0).sqrt()
''', "root mean square"),
    ("compress.wanda_score", '''
def wanda_score(weight, x):
    return weight.abs() * x.norm(dim=1)
''', "shape"),
    ("compress.forward_kl", '''
import torch.nn.functional as F

def forward_kl(student_logits, teacher_logprobs, temperature=1.0):
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = F.log_softmax(teacher_logprobs / temperature, dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()
''', "T**2"),
    ("compress.forward_kl", '''
import torch.nn.functional as F

def forward_kl(student_logits, teacher_logprobs, temperature=1.0):
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = F.log_softmax(teacher_logprobs / temperature, dim=-1)
    return temperature ** 2 * (s.exp() * (s - t)).sum(-1).mean()
''', "reverse KL"),
    ("compress.forward_kl", '''
import torch.nn.functional as F

def forward_kl(student_logits, teacher_logprobs, temperature=1.0):
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = teacher_logprobs
    return temperature ** 2 * (t.exp() * (t - s)).sum(-1).mean()
''', "soften the teacher"),
    ("compress.forward_kl", '''
import torch
import torch.nn.functional as F

def forward_kl(student_logits, teacher_logprobs, temperature=1.0):
    s = F.log_softmax(student_logits.detach() / temperature, dim=-1)
    t = F.log_softmax(teacher_logprobs / temperature, dim=-1)
    return temperature ** 2 * (t.exp() * (t - s)).sum(-1).mean()
''', "no gradient"),
    ("compress.reverse_kl", '''
import torch.nn.functional as F

def reverse_kl(student_logits, teacher_logprobs):
    s = F.log_softmax(student_logits, dim=-1)
    t = teacher_logprobs
    return (t.exp() * (t - s)).sum(-1).mean()
''', "forward KL"),
    ("compress.reverse_kl", '''
def reverse_kl(student_logits, teacher_logprobs):
    s = student_logits
    return (s.softmax(-1) * (s - teacher_logprobs)).sum(-1).mean()
''', "log_softmax first"),
    ("compress.reverse_kl", '''
import torch.nn.functional as F

def reverse_kl(student_logits, teacher_logprobs):
    s = F.log_softmax(student_logits, dim=-1)
    return (s.exp() * (s - teacher_logprobs)).sum()
''', "do not sum"),
]

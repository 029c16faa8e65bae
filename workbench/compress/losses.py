"""Distillation losses over next-token distributions, as published.

Every function takes the student's logits and the teacher's log-probabilities at the same
positions, (N, vocab) each, and returns the mean over the N positions. Gradients flow to the
student only; the teacher's side is a constant.

- forward_kl (Hinton et al., 2015, "kd"): T^2 KL(p_teacher^T || p_student^T), both softened by the
  temperature T; mean-seeking: the student spreads mass over everything the teacher finds
  plausible. T^2 keeps the gradient's scale independent of T.
- cross_entropy ("seqkd", Kim & Rush, 2016): -log p_student(token) on sequences the teacher
  generated, the teacher's greedy choice as a hard label.
- reverse_kl (MiniLLM, Gu et al., 2024, token-level form): KL(p_student || p_teacher) at positions
  of the student's own samples; mode-seeking: the student is punished for mass where the teacher
  has little and may ignore some of the teacher's modes.
- generalized_jsd (GKD, Agarwal et al., 2024): beta KL(p_t || m) + (1 - beta) KL(p_s || m),
  m = beta p_t + (1 - beta) p_s. It interpolates between forward KL (beta -> 0, up to a 1/beta
  scale) and reverse KL (beta -> 1, up to 1/(1 - beta)), and stays bounded (by ln 2 at
  beta = 0.5) where a KL can explode.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LOSSES = ("kd", "seqkd", "reverse_kl", "gkd")


def _wide(x: torch.Tensor) -> torch.Tensor:
    """fp32 at least: a softmax over 49152 tokens in bf16 loses the tail the KLs weigh."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def forward_kl(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor,
               temperature: float = 1.0) -> torch.Tensor:
    s = F.log_softmax(_wide(student_logits) / temperature, -1)
    t = F.log_softmax(_wide(teacher_logprobs) / temperature, -1)   # softened and renormalised
    return temperature ** 2 * (t.exp() * (t - s)).sum(-1).mean()


def cross_entropy(student_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_wide(student_logits), targets)


def reverse_kl(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    s = F.log_softmax(_wide(student_logits), -1)
    return (s.exp() * (s - _wide(teacher_logprobs))).sum(-1).mean()


def generalized_jsd(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor,
                    beta: float = 0.5) -> torch.Tensor:
    if not 0 < beta < 1:
        raise ValueError(f"beta={beta!r} is invalid: it must be in (0, 1) (0 and 1 are the "
                         "forward and reverse KL: use loss='kd' or 'reverse_kl')")
    s = F.log_softmax(_wide(student_logits), -1)
    t = _wide(teacher_logprobs)
    # log m = log(beta e^t + (1 - beta) e^s), stably
    m = torch.logaddexp(t + math.log(beta), s + math.log(1 - beta))
    return (beta * (t.exp() * (t - m)).sum(-1)
            + (1 - beta) * (s.exp() * (s - m)).sum(-1)).mean()

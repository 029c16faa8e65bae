"""Lab 09 (compression): the 2:4 mask, Wanda's score and the two KL losses of distillation, by hand.

The references are the engine's own code: `keep_mask` and `wanda_score` in
`workbench/compress/pruning.py`, `forward_kl` and `reverse_kl` in `workbench/compress/losses.py`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.compress.losses import forward_kl, reverse_kl
from workbench.compress.pruning import keep_mask, wanda_score
from workbench.course.labs.core import Mismatch, call, exercise

CHAPTER = "09_compression"


def _scores(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(rows, cols, generator=gen)       # distinct values: no ties to break


def _where(got: torch.Tensor, expected: torch.Tensor) -> str:
    bad = (got != expected).nonzero()
    if not len(bad):
        return ""
    r, c = (int(v) for v in bad[0])
    return f" (first difference at row {r}, column {c}; {len(bad)} of {got.numel()} differ)"


# ----------------------------------------------------------------------------- 2:4 mask
@exercise("compress.two_four_mask", CHAPTER, "two_four_mask",
          "the 2:4 keep-mask: the 2 highest scores of every 4 consecutive weights of a row",
          hint="reshape (N, K) to (N, K // 4, 4), take topk(2, dim=-1).indices, scatter True "
               "into a zeros bool tensor of that shape, reshape back to (N, K).")
def check_two_four_mask(fn) -> None:
    cases = [_scores(8, 8, 5), torch.tensor([[0.1, 0.9, 0.5, 0.2]]),
             torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.1, 0.3, 0.2, 0.4]]),
             _scores(3, 8, 0), _scores(16, 64, 1), _scores(5, 12, 2)]
    for score in cases:
        what = f"two_four_mask(score of shape {tuple(score.shape)})"
        got = call(fn, what, score.clone())
        expected = keep_mask(score, 0.5, (2, 4))
        if not isinstance(got, torch.Tensor):
            raise Mismatch(f"{what} returned {type(got).__name__}: expected a torch.Tensor")
        if tuple(got.shape) != tuple(score.shape):
            raise Mismatch(f"{what}: the mask should have the score's shape {tuple(score.shape)}, "
                           f"got {tuple(got.shape)}")
        if got.dtype != torch.bool:
            raise Mismatch(f"{what}: the mask should be torch.bool, got {got.dtype}",
                           "a mask says keep or drop: compare, or scatter True into "
                           "torch.zeros(..., dtype=torch.bool).")
        if torch.equal(got, expected):
            continue
        groups = got.reshape(score.shape[0], -1, 4).sum(-1)
        hint = ""
        if torch.equal(got, ~expected):
            hint = "you kept the 2 lowest of each 4: keep the highest scores (topk's largest=True)."
        elif score.shape[0] % 4 == 0 and torch.equal(
                got, keep_mask(score.t().contiguous(), 0.5, (2, 4)).t()):
            hint = ("you grouped 4 consecutive rows of a column; the groups run along a row "
                    "(4 consecutive input columns), as the sparse tensor cores read them.")
        elif not bool((groups == 2).all()):
            hint = ("every group of 4 consecutive weights of a row must keep exactly 2: the "
                    "pattern is local, not 50% of the whole row. Group along dim 1 (the inputs).")
        raise Mismatch(f"{what}: wrong mask{_where(got, expected)}", hint)


# ----------------------------------------------------------------------------- Wanda
@exercise("compress.wanda_score", CHAPTER, "wanda_score",
          "Wanda's score |W_ij| * ||X_j||_2 from the weight and its inputs",
          hint="x is (tokens, K): the norm of input column j is x.norm(dim=0), shape (K,); "
               "multiply weight.abs() (N, K) by it broadcast along the rows.")
def check_wanda_score(fn) -> None:
    gen = torch.Generator().manual_seed(3)
    cases = []
    for n, k, t in ((2, 3, 4), (8, 16, 5), (32, 64, 40)):
        w = torch.randn(n, k, generator=gen)
        x = torch.randn(t, k, generator=gen)
        x[:, 1] *= 30                                  # an outlier input channel, as LLMs have
        cases.append((w, x))
    for w, x in cases:
        what = f"wanda_score(weight {tuple(w.shape)}, x {tuple(x.shape)})"
        got = call(fn, what, w.clone(), x.clone())
        expected = wanda_score(w, x.pow(2).sum(0))
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(w.shape):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise Mismatch(f"{what}: expected a tensor of the weight's shape {tuple(w.shape)}, "
                           f"got {shape}",
                           "one score per weight: |W| (N, K) times a (K,) norm per input column.")
        got = got.detach().float()
        if torch.allclose(got, expected, rtol=1e-4, atol=1e-6):
            continue
        hint = ""
        if torch.allclose(got, w.abs() * x.pow(2).sum(0), rtol=1e-4):
            hint = "take the square root: the score uses the L2 norm ||X_j||_2, not its square."
        elif torch.allclose(got, w * x.norm(dim=0), rtol=1e-4):
            hint = "use |W|: a large negative weight matters as much as a large positive one."
        elif torch.allclose(got, w.abs() * x.pow(2).mean(0).sqrt(), rtol=1e-4):
            hint = ("that is the root mean square; the score is the norm (sum of squares, not "
                    "mean). Per row the ranking is the same, but Wanda's score is the norm.")
        elif torch.allclose(got, w.abs() * x.abs().sum(0), rtol=1e-4):
            hint = "the L2 norm, sqrt(sum x^2), not the sum of |x|."
        raise Mismatch(f"{what}: wrong score (max difference "
                       f"{(got - expected).abs().max().item():.3g})", hint)


# ----------------------------------------------------------------------------- KL losses
def _logit_cases():
    gen = torch.Generator().manual_seed(4)
    out = []
    for n, v, spread in ((1, 4, 1.0), (3, 10, 3.0), (16, 50, 5.0)):
        student = torch.randn(n, v, generator=gen) * spread
        teacher = F.log_softmax(torch.randn(n, v, generator=gen) * spread, -1)
        out.append((student, teacher))
    return out


def _scalar(got, what: str, student: torch.Tensor) -> torch.Tensor:
    if not isinstance(got, torch.Tensor) or got.numel() != 1:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise Mismatch(f"{what}: expected a scalar tensor (the mean over positions), got {shape}",
                       "sum over the vocabulary (dim=-1), then .mean() over the positions.")
    if not got.requires_grad:
        raise Mismatch(f"{what}: the loss carries no gradient to the student's logits",
                       "stay in torch, without .detach(), .item() or numpy: training "
                       "back-propagates through this value.")
    return got.detach().double().reshape(())


@exercise("compress.forward_kl", CHAPTER, "forward_kl",
          "distillation's forward KL, T^2 KL(p_teacher^T || p_student^T)",
          hint="s = log_softmax(student / T), t = log_softmax(teacher / T); "
               "T**2 * (t.exp() * (t - s)).sum(-1).mean().")
def check_forward_kl(fn) -> None:
    for (student, teacher) in _logit_cases():
        for temperature in (1.0, 2.0):
            what = f"forward_kl(student {tuple(student.shape)}, teacher, temperature={temperature})"
            s = student.clone().requires_grad_(True)
            got = _scalar(call(fn, what, s, teacher.clone(), temperature), what, s)
            expected = forward_kl(student, teacher, temperature).double()
            if torch.allclose(got, expected, rtol=1e-4, atol=1e-7):
                continue
            hint = ""
            if temperature != 1 and torch.allclose(got * temperature ** 2, expected, rtol=1e-4):
                hint = ("multiply by T**2: softening shrinks the gradients by 1/T^2, and Hinton's "
                        "T^2 keeps their scale the same whatever T is.")
            elif torch.allclose(got, reverse_kl(student / temperature, F.log_softmax(
                    teacher / temperature, -1)).double() * temperature ** 2, rtol=1e-4):
                hint = ("that is the reverse KL: the forward KL weighs by the teacher's "
                        "probabilities, sum p_t (log p_t - log p_s).")
            elif torch.allclose(got, expected * student.shape[0], rtol=1e-4):
                hint = "average over the positions (.mean()), do not sum them."
            elif temperature != 1 and torch.allclose(
                    got, temperature ** 2 * (teacher.exp() * (teacher - F.log_softmax(
                        student / temperature, -1))).sum(-1).mean().double(), rtol=1e-4):
                hint = ("soften the teacher too: log_softmax(teacher_logprobs / T), both "
                        "distributions at the same temperature.")
            raise Mismatch(f"{what}: expected {expected.item():.6g}, got {got.item():.6g}", hint)


@exercise("compress.reverse_kl", CHAPTER, "reverse_kl",
          "MiniLLM's reverse KL, KL(p_student || p_teacher)",
          hint="s = log_softmax(student_logits, -1); (s.exp() * (s - teacher_logprobs))"
               ".sum(-1).mean().")
def check_reverse_kl(fn) -> None:
    for (student, teacher) in _logit_cases():
        what = f"reverse_kl(student {tuple(student.shape)}, teacher)"
        s = student.clone().requires_grad_(True)
        got = _scalar(call(fn, what, s, teacher.clone()), what, s)
        expected = reverse_kl(student, teacher).double()
        if torch.allclose(got, expected, rtol=1e-4, atol=1e-7):
            continue
        hint = ""
        if torch.allclose(got, forward_kl(student, teacher).double(), rtol=1e-4):
            hint = ("that is the forward KL: the reverse KL weighs by the student's own "
                    "probabilities, sum p_s (log p_s - log p_t), which is what makes it "
                    "mode-seeking.")
        elif torch.allclose(got, (student.softmax(-1) * (student - teacher)).sum(-1).mean()
                            .double(), rtol=1e-4):
            hint = "the student gives logits: take log_softmax first, then its exp for p_s."
        elif torch.allclose(got, expected * student.shape[0], rtol=1e-4):
            hint = "average over the positions (.mean()), do not sum them."
        raise Mismatch(f"{what}: expected {expected.item():.6g}, got {got.item():.6g}", hint)

"""Cross-layer KV sharing after a short distillation: can a pretrained model learn to read its
neighbour's keys and values?

CLA (Brandon et al. 2024) trains models that share K/V between adjacent layers from the start.
A pretrained model made to share without training breaks (compress_eval.py measures it). Here the
layers that lost their own K/V (share_from[i] != i) are trained to match the unshared model's
next-token distributions (forward KL, the compression chapter's loss and training loop,
compress/trainer.py) on calibration text, while every other weight stays frozen; perplexity under
the sharing is measured on held-out text before and after, through compress_eval's evaluation
path, so the numbers are comparable with its table.

    result = distill_sharing(llm, sharing_map(30, 2, 15), steps=32)
    result["before"], result["after"], result["reference"]     # perplexities
"""
from __future__ import annotations

import torch

from ..compress import losses as L
from ..compress.distill import _autocast_dtype
from ..compress.train_forward import hidden_states
from ..compress.trainer import LoopConfig, train
from ..models.loader import load_model
from ..quant.calibration import calibration_windows, heldout_windows
from ..quant.forward import prefill_logprobs
from .compress_eval import KVTransform, perplexity


def _check(share_from, num_layers: int) -> list[int]:
    if (not isinstance(share_from, (list, tuple)) or len(share_from) != num_layers
            or any(not isinstance(s, int) or not 0 <= s <= i for i, s in enumerate(share_from))):
        raise ValueError(f"share_from={share_from!r} is invalid: one entry per layer "
                         f"({num_layers}), each an earlier or the same layer (sharing_map makes one)")
    trained = [i for i, s in enumerate(share_from) if s != i]
    if not trained:
        raise ValueError(f"share_from={share_from!r} is invalid: no layer shares, so there is "
                         "nothing to train")
    return trained


def distill_sharing(llm, share_from: list[int], steps: int = 32, batch_size: int = 4,
                    seq_len: int = 128, num_sequences: int = 64, lr: float = 2e-4,
                    eval_windows: int = 2, eval_len: int = 128, eval_every: int = 0,
                    seed: int = 0, log=None) -> dict:
    """Train the sharing layers of a copy of llm's model; returns perplexities (under the sharing,
    before and after; the unshared model's as "reference"), KL(unshared || shared) on the held-out
    windows before and after, the trained layers, the history (train loss, held-out perplexity
    and KL every `eval_every` steps; 0: only at the start and end) and the student model."""
    engine = llm.engine if hasattr(llm, "engine") else llm
    teacher, tok = engine.model, engine.tokenizer
    trained = _check(share_from, len(teacher.layers))
    student = load_model(engine.checkpoint, torch.float32, torch.device("cpu"))
    student.requires_grad_(False)
    params = [p for i in trained for p in student.layers[i].parameters()]
    for p in params:
        p.requires_grad_(True)
    student.train()
    items = torch.tensor(calibration_windows(tok, num_sequences, seq_len, seed))
    held = heldout_windows(tok, eval_windows, eval_len)
    sharing = KVTransform(share_from=list(share_from))

    held_ids = torch.tensor(held)
    held_lp = torch.stack([prefill_logprobs(teacher, w).float() for w in held])[:, :-1]

    @torch.no_grad()
    def held_metrics() -> dict:
        """Perplexity under the sharing (compress_eval's path) and KL(unshared || shared)."""
        student.eval()
        ppl = perplexity(student, held, sharing)
        s_lp = torch.log_softmax(student.compute_logits(
            hidden_states(student, held_ids, share_from=share_from))[:, :-1].float(), -1)
        kl = (held_lp.exp() * (held_lp - s_lp)).sum(-1).mean().item()
        student.train()
        return {"heldout_ppl": ppl, "heldout_kl": kl}

    def batch_loss(batch: torch.Tensor, step: int):
        ids = items[batch]
        dt = _autocast_dtype()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dt is not None):
            z = student.compute_logits(hidden_states(student, ids, share_from=share_from)).float()
        z = z[:, :-1].flatten(0, 1)
        t = torch.stack([prefill_logprobs(teacher, row.tolist()).float() for row in ids])
        return L.forward_kl(z, t[:, :-1].flatten(0, 1).clone(), 1.0), z.shape[0]

    reference = perplexity(teacher, held)
    cfg = LoopConfig(steps=steps, batch_size=batch_size, lr=lr,
                     eval_every=eval_every or steps, seed=seed)
    history = train(student, [{"params": params}], len(items), batch_loss, held_metrics, cfg,
                    log=log or (lambda *a, **k: None))
    student.eval()
    return {"reference": reference, "before": history[0]["heldout_ppl"],
            "after": history[-1]["heldout_ppl"], "kl_before": history[0]["heldout_kl"],
            "kl_after": history[-1]["heldout_kl"],
            "trained_layers": trained, "history": history, "student": student,
            "trained_params": sum(p.numel() for p in params)}

"""Cross-layer KV sharing after a short distillation: can a pretrained model learn to read its
neighbour's keys and values?

CLA (Brandon et al. 2024) trains models that share K/V between adjacent layers from the start.
A pretrained model made to share without training breaks (compress_eval.py measures it). Here the
layers that lost their own K/V (share_from[i] != i) are trained to match the unshared model's
next-token distributions (forward KL, the compression chapter's loss and training loop,
compress/trainer.py) on calibration text, while every other weight stays frozen; perplexity under
the sharing is measured on held-out text before and after, through compress_eval's evaluation
path and in the engine's dtype, so the numbers are comparable with its table.

    engine model (teacher, frozen) --shared modules--> student: fp32 masters of the trained layers
    calibration windows -> teacher log-probs -> KL(teacher || student under sharing) -> AdamW
    evaluation: the masters cast to the engine's dtype -> window_nll under the sharing

Only the trained layers are copied (fp32 masters, their gradients and Adam's moments: 16 bytes
per trained parameter); the embeddings, the head and the frozen layers are the engine's own
tensors, so the memory added is not a second model.

    result = distill_sharing(llm, sharing_map(30, 2, 15), steps=32)
    result["before"], result["after"], result["reference"]     # perplexities
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from workbench.compress import losses as L
from workbench.compress.train_forward import hidden_states
from workbench.compress.trainer import LoopConfig, train
from workbench.models.llama import LlamaModel
from workbench.quant.calibration import calibration_windows, heldout_windows
from workbench.quant.forward import prefill_hidden, prefill_logprobs
from workbench.experiments.kv_compression import KVTransform, perplexity

LOSS_ROWS = 64     # rows of the head and the loss alive at once in training


def _check(share_from, model: LlamaModel) -> list[int]:
    num_layers = len(model.layers)
    if (not isinstance(share_from, (list, tuple)) or len(share_from) != num_layers
            or any(not isinstance(s, int) or not 0 <= s <= i for i, s in enumerate(share_from))):
        raise ValueError(f"share_from={share_from!r} is invalid: one entry per layer "
                         f"({num_layers}), each an earlier or the same layer (sharing_map makes one)")
    trained = [i for i, s in enumerate(share_from) if s != i]
    if not trained:
        raise ValueError(f"share_from={share_from!r} is invalid: no layer shares, so there is "
                         "nothing to train")
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} is {t.dtype}: distillation runs autograd through "
                             "floating-point weights; load the model unquantized")
    return trained


def with_layers(model: LlamaModel, layers: list[nn.Module]) -> LlamaModel:
    """A LlamaModel that shares `model`'s embeddings, final norm, head and rotary tables, with
    `layers` as its decoder layers (no tensor is copied)."""
    view = LlamaModel.__new__(LlamaModel)
    nn.Module.__init__(view)
    view.args = model.args
    view.embed_tokens, view.norm, view.lm_head = model.embed_tokens, model.norm, model.lm_head
    view.rotary = model.rotary
    view.layers = nn.ModuleList(layers)
    return view


def distill_sharing(llm, share_from: list[int], steps: int = 32, batch_size: int = 4,
                    seq_len: int = 128, num_sequences: int = 64, lr: float = 2e-4,
                    eval_windows: int = 2, eval_len: int = 128, eval_every: int = 0,
                    seed: int = 0, log=None) -> dict:
    """Train the sharing layers against llm's model; returns perplexities (under the sharing,
    before and after; the unshared model's as "reference"), KL(unshared || shared) on the held-out
    windows before and after, the trained layers, the history (train loss, held-out perplexity
    and KL every `eval_every` steps; 0: only at the start and end), the number of trained
    parameters and "student": the distilled model in the engine's dtype (shared tensors, the
    trained layers its own)."""
    engine = llm.engine if hasattr(llm, "engine") else llm
    teacher, tok = engine.model, engine.tokenizer
    trained = _check(share_from, teacher)
    dtype = teacher.embed_tokens.weight.dtype
    masters = {i: copy.deepcopy(teacher.layers[i]).float().requires_grad_(True) for i in trained}
    params = [p for m in masters.values() for p in m.parameters()]
    train_model = with_layers(teacher, [masters.get(i, layer) for i, layer in enumerate(teacher.layers)])
    served = {i: copy.deepcopy(teacher.layers[i]) for i in trained}   # the masters in `dtype`
    student = with_layers(teacher, [served.get(i, layer) for i, layer in enumerate(teacher.layers)])
    sharing = KVTransform(share_from=list(share_from))
    items = torch.tensor(calibration_windows(tok, num_sequences, seq_len, seed))
    held = heldout_windows(tok, eval_windows, eval_len)
    held_ids = torch.tensor(held)
    held_lp = torch.stack([prefill_logprobs(teacher, w).float() for w in held])[:, :-1]
    # frozen layers run in the engine's dtype; autocast runs the fp32 masters' matmuls in it too
    autocast = dict(device_type=teacher.embed_tokens.weight.device.type, dtype=dtype,
                    enabled=dtype != torch.float32)

    @torch.no_grad()
    def held_metrics() -> dict:
        """Perplexity under the sharing (compress_eval's path) and KL(unshared || shared), with
        the trained layers cast to the engine's dtype as a server would load them."""
        for i, layer in served.items():
            for p, q in zip(layer.parameters(), masters[i].parameters()):
                p.copy_(q)
        ppl = perplexity(student, held, sharing)
        s_lp = torch.log_softmax(student.compute_logits(
            hidden_states(student, held_ids, share_from=share_from))[:, :-1].float(), -1)
        kl = (held_lp.exp() * (held_lp - s_lp)).sum(-1).mean().item()
        return {"heldout_ppl": ppl, "heldout_kl": kl}

    def chunk_kl(h: torch.Tensor, teacher_h: torch.Tensor) -> torch.Tensor:
        """Summed KL(teacher || student) over the rows of one chunk of final hidden states."""
        with torch.no_grad():
            t = torch.log_softmax(teacher.compute_logits(teacher_h), -1)
        with torch.autocast(**autocast):
            z = train_model.compute_logits(h)
        return L.forward_kl(z, t, 1.0) * h.shape[0]

    def batch_loss(batch: torch.Tensor, step: int):
        ids = items[batch]
        with torch.autocast(**autocast):
            h = hidden_states(train_model, ids, share_from=share_from)[:, :-1].flatten(0, 1)
        teacher_h = torch.cat([prefill_hidden(teacher, row.tolist())[:-1] for row in ids])
        # (rows x vocab) logits and softmaxes are the largest activations: the head and the loss
        # run LOSS_ROWS rows at a time and are recomputed in the backward pass
        loss = sum(checkpoint(chunk_kl, h[r:r + LOSS_ROWS], teacher_h[r:r + LOSS_ROWS],
                              use_reentrant=False) for r in range(0, h.shape[0], LOSS_ROWS))
        return loss / h.shape[0], h.shape[0]

    reference = perplexity(teacher, held)
    cfg = LoopConfig(steps=steps, batch_size=batch_size, lr=lr,
                     eval_every=eval_every or steps, seed=seed)
    flags = [(p, p.requires_grad) for p in teacher.parameters()]
    teacher.requires_grad_(False)       # else backward fills gradients for the whole engine
    try:
        history = train(train_model, [{"params": params}], len(items), batch_loss, held_metrics,
                        cfg, log=log or (lambda *a, **k: None))
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
    return {"reference": reference, "before": history[0]["heldout_ppl"],
            "after": history[-1]["heldout_ppl"], "kl_before": history[0]["heldout_kl"],
            "kl_after": history[-1]["heldout_kl"],
            "trained_layers": trained, "history": history, "student": student,
            "trained_params": sum(p.numel() for p in params)}

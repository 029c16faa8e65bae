"""The one training loop of the workbench: students distilled from a teacher (compress/distill.py)
and speculative decoding's draft model (compress/draft.py) both run it.

    batches (seeded permutations of the items) -> batch_loss(indices, step) -> AdamW step
      (gradients clipped to norm 1; linear warm-up over 5% of the steps, then cosine decay to
       10% of the rate) -> every `eval_every` steps and at the end: evaluate() into the history
      -> every `checkpoint_every` steps before the last: model, optimizer, schedule, batch order
         and history to one file, from which `resume=True` continues exactly where it stopped
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


@dataclass
class LoopConfig:
    steps: int
    batch_size: int
    lr: float
    eval_every: int
    seed: int = 0
    checkpoint_every: int = 0      # 0: no checkpoints


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first 5% of the steps, then cosine decay from 1 to 0.1."""
    warmup = max(1, steps // 20)
    return min((step + 1) / warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * min(step, steps) / steps)))


def train(model: torch.nn.Module, param_groups: list[dict], num_items: int,
          batch_loss: Callable[[torch.Tensor, int], tuple[torch.Tensor, int]],
          evaluate: Callable[[], dict], cfg: LoopConfig, log: Callable = print,
          checkpoint: Path | None = None, resume: bool = False, progress: bool = False) -> list:
    """AdamW on `batch_loss(indices, step) -> (loss, tokens)` over batches of `cfg.batch_size`
    item indices. Returns the history: at step 0, every `eval_every` steps and at the end,
    {"step", "train_loss" (mean since the previous entry; None at step 0) and what `evaluate()`
    returns}; the log and the progress bar also give the training tokens per second."""
    optimizer = torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0,
                                  fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.steps))
    generator, order, losses, tokens, first = torch.Generator().manual_seed(cfg.seed), [], [], 0, 1
    history: list[dict] = []
    if resume and checkpoint is not None and Path(checkpoint).is_file():
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        generator.set_state(state["generator"])
        order, losses, history, first = state["order"], state["losses"], state["history"], state["step"] + 1
        log(f"[train] resumed from {checkpoint} after step {state['step']}")
    if not history:
        history.append({"step": 0, "train_loss": None, **evaluate()})
        log(f"[train] step 0: {_metrics(history[-1])}")
    bar = _bar(cfg.steps, first - 1) if progress else None
    start = time.perf_counter()
    for step in range(first, cfg.steps + 1):
        if len(order) < cfg.batch_size:
            order += torch.randperm(num_items, generator=generator).tolist()
        batch, order = torch.tensor(order[:cfg.batch_size]), order[cfg.batch_size:]
        loss, n = batch_loss(batch, step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        tokens += n
        rate = tokens / (time.perf_counter() - start)
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:.0f}")
            bar.update()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            history.append({"step": step, "train_loss": sum(losses) / len(losses), **evaluate()})
            losses = []
            log(f"[train] step {step}: {_metrics(history[-1])} ({time.perf_counter() - start:.0f} s, "
                f"{rate:.0f} training tokens/s)")
        # None after the last step: the caller saves the trained model next, so the weights and
        # AdamW's two moments (three copies of the model) would be written only to be deleted.
        if (checkpoint is not None and cfg.checkpoint_every and step % cfg.checkpoint_every == 0
                and step < cfg.steps):
            _save(checkpoint, {"step": step, "model": model.state_dict(),
                               "optimizer": optimizer.state_dict(),
                               "schedule": schedule.state_dict(),
                               "generator": generator.get_state(), "order": order,
                               "losses": losses, "history": history})
    if bar is not None:
        bar.close()
    return history


def _metrics(entry: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in entry.items()
                     if k != "step" and isinstance(v, float))


def _bar(total: int, done: int):
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=done, desc="distill", unit="step")


def _save(path: Path, state: dict) -> None:
    """Written next to the target and renamed: an interrupted save leaves the previous one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)

"""Distil a compressed student (a pruned checkpoint) from its teacher, to win back what pruning
lost. The student is the engine's own `LlamaModel`, trained through a differentiable forward over
its weights (train_forward.py) by the workbench's one training loop (trainer.py).

    teacher LLM (the engine)          student folder (pruned checkpoint, per-layer widths)
      |                                  | load_pruned -> fp32 LlamaModel, trainable
      |-- data, per loss:
      |     kd          calibration windows; teacher log-probs at every position
      |     seqkd       teacher greedy continuations of calibration prompts (once), hard labels
      |     reverse_kl  the student's own samples each step; teacher log-probs on them
      |     gkd         the student's samples (share `on_policy` of the steps) or the teacher's
      |                 continuations; generalized JSD against the teacher's log-probs
      |-- loss (losses.py) -> trainer.train (AdamW, warm-up + cosine, clipping, checkpoints)
      |-- held-out perplexity and KL to the teacher every `eval_every` steps
      -> out folder: the same pruned-checkpoint format, manifest + "distillation" record; loads in
         LLM(model=out) and quantizes on load like any pruned model

Training runs in fp32, under bf16 autocast where the CPU multiplies bf16 natively.
"""
from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from workbench.compress import losses as L
from workbench.compress.checkpoint import is_pruned_checkpoint, load_pruned, save_student
from workbench.compress.draft import target_generations
from workbench.compress.train_forward import hidden_states, sample
from workbench.compress.trainer import LoopConfig, train
from workbench.config import cpu_has_native_bf16
from workbench.models.loader import load_model, resolve_checkpoint
from workbench.quant.calibration import calibration_windows, heldout_windows
from workbench.quant.forward import prefill_logprobs


@dataclass
class StudentDistillConfig:
    loss: str = "kd"
    steps: int = 60
    batch_size: int = 8
    lr: float = 1e-4
    seq_len: int = 64            # kd: calibration windows of this many tokens
    prompt_len: int = 16         # seqkd, reverse_kl, gkd: prompt tokens ...
    gen_len: int = 48            # ... and the continuation trained on
    num_sequences: int = 128     # kd windows / teacher continuations to draw batches from
    temperature: float = 1.0     # kd: softening of both distributions
    beta: float = 0.5            # gkd: the JSD's interpolation
    on_policy: float = 0.5       # gkd: share of steps on the student's own samples
    sample_temperature: float = 1.0   # the student's sampling (reverse_kl, gkd)
    eval_windows: int = 8        # held-out windows of seq_len tokens for the history
    eval_every: int = 20
    checkpoint_every: int = 20   # 0: no checkpoints
    seed: int = 0

    def __post_init__(self):
        if self.loss not in L.LOSSES:
            _invalid("loss", self.loss, f"allowed values are {', '.join(map(repr, L.LOSSES))}")
        for f in fields(self):
            if f.name == "loss":
                continue
            value, is_int = getattr(self, f.name), f.type == "int"
            low = 0 if f.name in ("seed", "checkpoint_every") else 1
            if isinstance(value, bool) or not isinstance(value, int if is_int else (int, float)) \
                    or not math.isfinite(value) or (is_int and value < low):
                _invalid(f.name, value, f"it must be an integer >= {low}" if is_int
                         else "it must be a finite number")
        for name in ("lr", "temperature", "sample_temperature"):
            if getattr(self, name) <= 0:
                _invalid(name, getattr(self, name), "it must be > 0")
        if not 0 < self.beta < 1:
            _invalid("beta", self.beta, "it must be in (0, 1)")
        if not 0 <= self.on_policy <= 1:
            _invalid("on_policy", self.on_policy, "it must be in [0, 1]")
        if self.seq_len < 2:
            _invalid("seq_len", self.seq_len, "it must be >= 2 (a token and its successor)")
        if self.batch_size > self.num_sequences:
            _invalid("batch_size", self.batch_size,
                     f"it must be <= num_sequences={self.num_sequences}")


@dataclass
class DistillRun:
    path: Path
    history: list[dict]     # {"step", "train_loss", "heldout_ppl", "heldout_kl"} per evaluation
    seconds: float


def _invalid(name, value, allowed: str):
    raise ValueError(f"{name}={value!r} is invalid: {allowed}")


@functools.lru_cache(maxsize=None)
def _autocast_dtype():
    return torch.bfloat16 if cpu_has_native_bf16() else None


def student_logits(student, ids: torch.Tensor) -> torch.Tensor:
    """(B, T, vocab) fp32 next-token logits of the student, with autograd."""
    dt = _autocast_dtype()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dt is not None):
        return student.compute_logits(hidden_states(student, ids)).float()


@torch.inference_mode()
def teacher_logprobs(teacher_llm, ids: torch.Tensor) -> torch.Tensor:
    """(B, T, vocab) fp32 log-probs of the teacher, through the engine's own forward pass (the one
    evaluation uses), one sequence at a time."""
    return torch.stack([prefill_logprobs(teacher_llm.engine.model, row.tolist()).float().cpu()
                        for row in ids]).clone()


def load_student(folder) -> tuple[torch.nn.Module, dict, Path]:
    """(fp32 LlamaModel on the CPU with gradients, its pruning manifest or {}, its folder)."""
    folder = Path(folder) if Path(folder).is_dir() else resolve_checkpoint(str(folder))
    if is_pruned_checkpoint(folder):
        model, manifest = load_pruned(folder, torch.float32, torch.device("cpu"))
    else:
        model, manifest = load_model(folder, torch.float32, torch.device("cpu")), {}
    model.requires_grad_(True).train()
    return model, manifest, folder


def build_data(teacher_llm, cfg: StudentDistillConfig) -> dict:
    """Token tensors the loss draws batches from (seeded, from the calibration part of the text)
    and the held-out windows with the teacher's log-probs on them."""
    tok = teacher_llm.get_tokenizer()
    data = {}
    if cfg.loss == "kd":
        data["items"] = torch.tensor(calibration_windows(tok, cfg.num_sequences, cfg.seq_len,
                                                         cfg.seed))
    elif cfg.loss == "reverse_kl":
        data["items"] = torch.tensor(calibration_windows(tok, cfg.num_sequences, cfg.prompt_len,
                                                         cfg.seed))
    else:   # seqkd, gkd: the teacher's greedy continuations (gkd's prompts are their starts)
        data["items"] = torch.tensor(target_generations(
            teacher_llm, cfg.num_sequences, cfg.prompt_len, cfg.gen_len, "calibration", cfg.seed))
    held = torch.tensor(heldout_windows(tok, cfg.eval_windows, cfg.seq_len))
    data["held"], data["held_lp"] = held, teacher_logprobs(teacher_llm, held)
    return data


def make_batch_loss(student, teacher_llm, data: dict, cfg: StudentDistillConfig):
    """batch_loss(indices, step) -> (loss, trained tokens) for trainer.train."""
    items, P = data["items"], cfg.prompt_len

    def on_policy_ids(prompts: torch.Tensor, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)   # resumable: per step
        student.eval()
        ids = sample(student, prompts, cfg.gen_len, cfg.sample_temperature, g)
        student.train()
        return ids

    def batch_loss(batch: torch.Tensor, step: int):
        ids = items[batch]
        if cfg.loss == "kd":
            z = student_logits(student, ids)[:, :-1].flatten(0, 1)
            t = teacher_logprobs(teacher_llm, ids)[:, :-1].flatten(0, 1)
            return L.forward_kl(z, t, cfg.temperature), z.shape[0]
        if cfg.loss == "reverse_kl" or (cfg.loss == "gkd" and torch.rand(
                (), generator=torch.Generator().manual_seed(cfg.seed + step)) < cfg.on_policy):
            ids = on_policy_ids(ids[:, :P], step)
        z = student_logits(student, ids)[:, P - 1:-1].flatten(0, 1)   # predicting generated tokens
        if cfg.loss == "seqkd":
            return L.cross_entropy(z, ids[:, P:].flatten()), z.shape[0]
        t = teacher_logprobs(teacher_llm, ids)[:, P - 1:-1].flatten(0, 1)
        if cfg.loss == "reverse_kl":
            return L.reverse_kl(z, t), z.shape[0]
        return L.generalized_jsd(z, t, cfg.beta), z.shape[0]

    return batch_loss


@torch.no_grad()
def heldout_metrics(student, held: torch.Tensor, held_lp: torch.Tensor) -> dict:
    """Perplexity of the held-out windows and mean KL(teacher || student) per position."""
    was_training = student.training
    student.eval()
    s = torch.log_softmax(student_logits(student, held)[:, :-1], -1)
    t = held_lp[:, :-1]
    nll = -s.gather(-1, held[:, 1:, None]).mean().item()
    kl = (t.exp() * (t - s)).sum(-1).mean().item()
    student.train(was_training)
    return {"heldout_ppl": math.exp(nll), "heldout_kl": kl}


def distill_student(student_dir, teacher_llm, out_dir, config: StudentDistillConfig | None = None,
                    resume: bool = False, progress: bool = False) -> DistillRun:
    """Train the student in `student_dir` against `teacher_llm` (see the module docstring) and
    save it to `out_dir`; with `resume`, continue from `out_dir`'s training checkpoint (written
    every `checkpoint_every` steps, removed once the student is saved)."""
    cfg = StudentDistillConfig() if config is None else config
    if not isinstance(cfg, StudentDistillConfig):
        _invalid("config", cfg, "pass a StudentDistillConfig or None")
    start, out_dir = time.perf_counter(), Path(out_dir)
    student, manifest, source = load_student(student_dir)
    t_args, s_args = teacher_llm.engine.model_args, student.args
    if t_args.vocab_size != s_args.vocab_size:
        raise ValueError(f"student={str(student_dir)!r} has vocab_size={s_args.vocab_size}, the "
                         f"teacher {t_args.vocab_size}: distillation compares their distributions "
                         "token by token, so they must share the tokenizer")
    need = max(cfg.seq_len, cfg.prompt_len + cfg.gen_len)
    if need > teacher_llm.engine.plan.max_model_len:
        _invalid("gen_len" if cfg.loss != "kd" else "seq_len", need,
                 f"sequences must fit the teacher's max_model_len="
                 f"{teacher_llm.engine.plan.max_model_len}")
    log = functools.partial(print, flush=True) if progress else (lambda *a, **k: None)
    data = build_data(teacher_llm, cfg)
    log(f"[distill] {cfg.loss}: {len(data['items'])} training sequences, "
        f"{len(data['held'])} held-out windows ({time.perf_counter() - start:.0f} s)")
    history = train(student, [{"params": list(student.parameters())}], len(data["items"]),
                    make_batch_loss(student, teacher_llm, data, cfg),
                    lambda: heldout_metrics(student, data["held"], data["held_lp"]),
                    LoopConfig(cfg.steps, cfg.batch_size, cfg.lr, cfg.eval_every, cfg.seed,
                               cfg.checkpoint_every),
                    log=lambda m: log(m.replace("[train]", "[distill]")),
                    checkpoint=out_dir / "training_state.pt", resume=resume, progress=progress)
    record = {"loss": cfg.loss, "config": asdict(cfg), "teacher": str(teacher_llm.engine.config.model),
              "student": str(student_dir), "history": history}
    save_student(student, manifest, source, out_dir, record)
    (out_dir / "distill.json").write_text(json.dumps(record, indent=1))
    # the optimizer's state is three times the model's: kept only while a run can still resume
    (out_dir / "training_state.pt").unlink(missing_ok=True)
    return DistillRun(out_dir, history, time.perf_counter() - start)

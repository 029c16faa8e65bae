"""Distil a tiny draft model from the target, for speculative decoding.

A drafter must share the target's tokenizer and agree with its greedy choice as often as possible:
its teacher-forced top-1 agreement is the per-token greedy acceptance rate. We train a small
transformers `LlamaForCausalLM` on CPU in minutes:

1. Data: the target's greedy continuations of prompts cut from the calibration part of CPython's
   docs (`workbench.quant.calibration`), from one engine `generate` call. Sequence-level
   distillation (Kim & Rush 2016): the draft learns what the target *says*, which is what it
   will have to predict, not what the corpus says.
2. Teacher signal: besides the greedy token, the target's top-k next-token log-probabilities at
   each generated position, from one `prefill_logprobs` per sequence, kept as (values, indices).
3. Initialisation: the tied embedding is the target's, projected on its top principal directions
   (PCA). It is ~90% of the draft's parameters and cannot be learnt from a few thousand tokens;
   the projection keeps the target's token geometry (similar tokens start with similar input
   vectors *and* output rows, the head being tied as in the target), so the layers only have to
   learn the context -> next-token map.
4. Loss on generated positions only: (1-w) CE(greedy token) + w KL(target top-k || draft).

The folder written (fp32 safetensors, config.json with the target's special ids and rope, its
generation config and tokenizer files) loads in `LLM(model=folder)` and in transformers. Training
runs on the CPU, whatever the target's device: under bf16 autocast where the CPU multiplies bf16
natively (AVX-512 BF16 / AMX, where bf16 matmuls beat fp32 ones: `python -m timeit -s "import
torch; w = torch.randn(2048, 2048, dtype=torch.bfloat16)" "w @ w"`, then with torch.float32), in
fp32 elsewhere.
"""
from __future__ import annotations

import functools
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from workbench.compress.trainer import LoopConfig
from workbench.compress.trainer import train as train_loop
from workbench.config import cpu_has_native_bf16
from workbench.quant.calibration import calibration_windows, heldout_windows
from workbench.quant.forward import prefill_logprobs
from workbench.sampling_params import SamplingParams

# Files of a checkpoint folder that make up the tokenizer (copied next to the draft's weights).
TOKENIZER_PREFIXES = ("tokenizer", "special_tokens", "chat_template", "added_tokens", "vocab",
                      "merges")
# Keys of the target's config.json that describe the target's file, not the draft.
DROPPED_KEYS = ("_name_or_path", "_model_name_or_path", "workbench_source", "quantization_config",
                "transformers_version")
# Learning-rate factor of the PCA-initialised tied embedding: at the full rate it memorises the
# few thousand training tokens and loses the target's geometry, and the held-out agreement drops
# (distill_draft's history holds it: run the defaults with this at 0.1 and at 1.0).
EMBED_LR_SCALE = 0.1


@dataclass
class DistillConfig:
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    num_prompts: int = 64          # target generations used as training data
    prompt_len: int = 32           # prompt tokens, cut from the calibration part of CPython's docs
    gen_len: int = 96              # tokens the target generates greedily after each prompt
    steps: int = 200               # agreement plateaus before this at batch 8 (the history shows)
    batch_size: int = 8
    lr: float = 3e-3               # a higher rate ends lower in held-out agreement (the history)
    kl_weight: float = 0.5         # loss = (1-w) * CE(greedy token) + w * KL(target top-k || draft)
    top_k_logits: int = 64         # target logits kept per position for the KL term (memory)
    eval_every: int = 50
    seed: int = 0
    num_heldout_prompts: int = 16  # held-out generations (part="heldout") measuring `agreement`

    def __post_init__(self):
        for f in fields(self):
            value, is_int, low = getattr(self, f.name), f.type == "int", int(f.name != "seed")
            if isinstance(value, bool) or not isinstance(value, int if is_int else (int, float)) \
                    or not math.isfinite(value) or (is_int and value < low):
                _invalid(f.name, value, f"it must be an integer >= {low}" if is_int
                         else "it must be a finite number")
        if self.lr <= 0:
            _invalid("lr", self.lr, "it must be > 0")
        if not 0 <= self.kl_weight <= 1:
            _invalid("kl_weight", self.kl_weight, "it must be in [0, 1]")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            _invalid("hidden_size", self.hidden_size, f"it must be divisible by num_heads="
                     f"{self.num_heads} into an even head_dim (rotary embeddings)")
        if self.num_heads % self.num_kv_heads:
            _invalid("num_kv_heads", self.num_kv_heads, f"it must divide num_heads="
                     f"{self.num_heads} (grouped-query attention)")
        if self.batch_size > self.num_prompts:
            _invalid("batch_size", self.batch_size, f"it must be <= num_prompts={self.num_prompts}")


@dataclass
class DistillResult:
    path: Path
    history: list[dict]   # per evaluation {"step", "train_loss", "agreement"}: see train_draft
    num_params: int
    seconds: float


def _invalid(name, value, allowed: str):
    raise ValueError(f"{name}={value!r} is invalid: {allowed}")


def target_generations(llm, num_prompts: int, prompt_len: int, gen_len: int,
                       part: str = "calibration", seed: int = 0) -> list[list[int]]:
    """Prompt + greedy continuation (exactly gen_len tokens: EOS ignored) for `num_prompts`
    windows of `prompt_len` tokens of one part of the docs text, all in ONE `llm.generate` call so
    the engine batches them continuously (an LLM built with a larger max_num_seqs, e.g. 32,
    decodes more of them per step, which is faster on CPU too: `python -m workbench.bench
    offline-mixed` measures what batching gains). Held-out windows are the part's first ones,
    calibration windows a choice seeded by `seed`."""
    if part not in ("calibration", "heldout"):
        _invalid("part", part, "allowed values are 'calibration', 'heldout'")
    for name, value in (("num_prompts", num_prompts), ("prompt_len", prompt_len),
                        ("gen_len", gen_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _invalid(name, value, "it must be an integer >= 1")
    max_len = llm.engine.plan.max_model_len
    if prompt_len + gen_len > max_len:
        _invalid("gen_len", gen_len, f"prompt_len + gen_len must be <= the engine's "
                 f"max_model_len={max_len} (prompt_len={prompt_len})")
    tok = llm.get_tokenizer()
    if tok is None:
        raise ValueError(f"model={llm.engine.config.model!r} has no tokenizer: the prompts are "
                         "cut from tokenized text")
    try:
        prompts = (heldout_windows(tok, num_prompts, prompt_len) if part == "heldout" else
                   calibration_windows(tok, num_prompts, prompt_len, seed))
    except ValueError as e:   # the calibration module names its own arguments; name ours too
        raise ValueError(f"num_prompts={num_prompts!r} with prompt_len={prompt_len!r} is "
                         f"invalid for part={part!r}: {e}") from None
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=gen_len,
                                                ignore_eos=True))
    return [list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def teacher_topk(llm, seqs: list[list[int]], prompt_len: int, k: int):
    """(log-probs, indices), each (N, gen_len, k) on the CPU: the target's k likeliest next tokens
    at each position whose next token was generated, renormalised over those k (a distribution,
    so the KL term is >= 0)."""
    values, indices = [], []
    for s in seqs:
        v, i = prefill_logprobs(llm.engine.model, s)[prompt_len - 1:-1].float().topk(k, dim=-1)
        values.append((v - v.logsumexp(-1, keepdim=True)).cpu())
        indices.append(i.cpu())
    return torch.stack(values), torch.stack(indices)


def pca_embedding(embedding: torch.Tensor, dim: int) -> torch.Tensor:
    """The rows of `embedding` (V, d), centred, on their top `dim` principal directions (V, dim).
    Centring shifts all of a position's logits by one constant (h . mean), which softmax ignores;
    each direction's sign is fixed (largest entry positive) so the result is deterministic."""
    e = embedding.detach().double().cpu()
    e = e - e.mean(0)
    top = torch.linalg.eigh(e.T @ e).eigenvectors[:, -dim:].flip(-1)   # eigenvalues ascend
    top = top * top.gather(0, top.abs().argmax(0, keepdim=True)).sign()
    return (e @ top).float()


def draft_config(llm, cfg: DistillConfig) -> dict:
    """The target's config.json (special ids, rope, eps, positions, vocabulary, activation) with
    the draft's sizes; rope_theta also at the top level, for readers that look there."""
    out = json.loads((llm.engine.checkpoint / "config.json").read_text())
    out = {k: v for k, v in out.items() if k not in DROPPED_KEYS}
    args = llm.engine.model_args
    out.update(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=args.vocab_size,
               hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
               num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
               num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.hidden_size // cfg.num_heads,
               tie_word_embeddings=True, rms_norm_eps=args.rms_norm_eps,
               max_position_embeddings=args.max_position_embeddings, dtype="float32",
               attention_bias=False, mlp_bias=False, rope_theta=args.rope_theta)
    if args.rope_scaling is None:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": args.rope_theta}
    return out


def init_draft(config: dict, target_embedding: torch.Tensor, seed: int):
    """transformers' seeded init, except the tied embedding (the target's, by PCA) and the final
    norm's weight."""
    from transformers import LlamaConfig, LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):   # seeded, without touching the caller's RNG
        torch.manual_seed(seed)
        draft = LlamaForCausalLM(LlamaConfig(**config))
    with torch.no_grad():
        emb = draft.model.embed_tokens.weight
        emb.copy_(pca_embedding(target_embedding, config["hidden_size"]))
        # With transformers' final-norm weight of 1 the initial logits are huge: the residual
        # stream starts as the input token's own embedding, which the tied head then predicts
        # with a logit of ~30: an initial loss of ~24 nats, twice uniform's ln V = 10.8. Scaled
        # so that this logit is ~ln V (0.35 for the defaults), the initial loss is ~10, and
        # training ends at a higher held-out agreement than from a weight of 1 (distill_draft's
        # history holds it).
        draft.model.norm.weight.fill_(math.log(emb.shape[0]) / (
            emb.shape[1] ** 0.5 * emb.norm(dim=1).mean().item()))
    draft.tie_weights()
    return draft.train()


@functools.lru_cache(maxsize=None)
def compute_dtype() -> torch.dtype:
    """bf16 where this CPU multiplies it natively, else fp32: torch emulates bf16 matmuls several
    times slower than fp32 on CPUs without it (config.cpu_has_native_bf16)."""
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def _hidden(draft, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Final hidden states (B * gen_len, hidden), fp32, at the positions that predict generated
    tokens; the last token is not fed (nothing after it is predicted)."""
    dt = compute_dtype()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dt == torch.bfloat16):
        h = draft.model(input_ids=ids[:, :-1]).last_hidden_state[:, prompt_len - 1:]
    return h.reshape(-1, h.shape[-1]).float()


class SoftTargetHead(torch.autograd.Function):
    """Mean over rows of logsumexp(z) - sum_j t_j z_j, with z = h @ weight.T (the LM head) and
    sparse targets t (indices, weights; each row's weights sum to 1).

    With t = (1-w) onehot(greedy) + w p_teacher this is (1-w) CE + w KL(teacher || draft) less
    the teacher's (constant) entropy term. The LM head and its softmax over 49152 tokens are most
    of a step (the head's weights outnumber the small draft's layers'), and under autograd a dozen
    full-vocabulary fp32 passes (casts, logsumexp, the gathers' zero-filled gradients) cost more
    than the matmuls themselves (torch.profiler over one training step shows both). Here
    dL/dz = softmax(z) - t is formed in the forward pass in bf16 (the softmax kernel accumulates
    in fp32 and rounds once: the 2^-9 relative error autocast already puts on every activation),
    t is subtracted at its few indices, and both backward matmuls run at once, by row chunks that
    bound memory."""

    @staticmethod
    def forward(ctx, h, weight, target_idx, target_w):
        n, vocab, dt = h.shape[0], weight.shape[0], compute_dtype()
        hb, wb = h.detach().to(dt), weight.detach().to(dt)
        grad_h, grad_w = torch.empty_like(h), torch.zeros_like(weight)
        total = torch.zeros((), dtype=torch.float64)
        chunk = max(1, 2 ** 28 // (vocab * dt.itemsize))   # <= 256 MiB of logits at a time
        for s in range(0, n, chunk):
            z = hb[s:s + chunk] @ wb.T
            ti, tw = target_idx[s:s + chunk], target_w[s:s + chunk]
            g = torch.softmax(z, dim=-1)
            # The softmax at the argmax is 1 / sum exp(z - max), so lse = max - log(max softmax)
            # (amax: bf16 max-with-index, argmax and scatter run unvectorised, several times
            # slower: `python -m timeit -s "import torch; z = torch.randn(512, 49152,
            # dtype=torch.bfloat16)" "z.max(-1)"`, then "z.amax(-1)").
            lse = z.amax(-1).float() - g.amax(-1).float().log()
            total += (lse - (tw * z.gather(-1, ti).float()).sum(-1)).sum().double()
            del z
            flat = (ti + vocab * torch.arange(len(ti))[:, None]).flatten()
            g.view(-1).index_put_((flat,), -tw.flatten().to(dt), accumulate=True)
            grad_h[s:s + chunk] = g @ wb
            if ctx.needs_input_grad[1]:
                grad_w += g.T @ hb[s:s + chunk]
        ctx.save_for_backward(grad_h / n, grad_w / n)
        return (total / n).float()

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None


@torch.no_grad()
def agreement(draft, seqs: torch.Tensor, prompt_len: int, batch_size: int = 16) -> float:
    """Teacher-forced top-1 agreement of the draft with the target's greedy tokens."""
    was_training, weight, hits = draft.training, draft.lm_head.weight.to(compute_dtype()), 0
    draft.eval()
    for b in range(0, len(seqs), batch_size):
        ids = seqs[b:b + batch_size]
        pred = (_hidden(draft, ids, prompt_len).to(weight.dtype) @ weight.T).argmax(-1)
        hits += int((pred == ids[:, prompt_len:].reshape(-1)).sum())
    draft.train(was_training)
    return hits / seqs[:, prompt_len:].numel()


def train_draft(draft, train, held, topk_lp, topk_idx, cfg: DistillConfig, log=print) -> list:
    """The workbench's training loop (compress/trainer.py) on the distillation loss, batches from
    seeded permutations of the training sequences. Returns the history: at step 0, every
    `eval_every` steps and at the end, the held-out agreement and the mean training loss since
    the previous entry (None at step 0)."""
    P, w = cfg.prompt_len, cfg.kl_weight
    emb = draft.model.embed_tokens.weight
    groups = [{"params": [p for p in draft.parameters() if p is not emb]},
              {"params": [emb], "lr": cfg.lr * EMBED_LR_SCALE}]
    # Sparse soft targets: the greedy token with weight 1-w, the teacher's top-k with w * p.
    p = topk_lp.exp()
    target_idx = torch.cat([train[:, P:, None], topk_idx], dim=-1)
    target_w = torch.cat([torch.full_like(p[..., :1], 1 - w), w * p], dim=-1)
    entropy_term = w * (p * topk_lp).sum(-1).mean().item()   # the KL's constant part

    def batch_loss(batch: torch.Tensor, step: int):
        loss = SoftTargetHead.apply(_hidden(draft, train[batch], P), draft.lm_head.weight,
                                    target_idx[batch].flatten(0, 1),
                                    target_w[batch].flatten(0, 1)) + entropy_term
        return loss, len(batch) * (train.shape[1] - P)

    return train_loop(draft, groups, len(train), batch_loss,
                      lambda: {"agreement": agreement(draft, held, P)},
                      LoopConfig(cfg.steps, cfg.batch_size, cfg.lr, cfg.eval_every, cfg.seed),
                      log=lambda m: log(m.replace("[train]", "[distill]")))


def distill_draft(llm, out_dir, config: DistillConfig | None = None,
                  progress: bool = False) -> DistillResult:
    """Distil a draft from `llm`'s model (see the module docstring); save it in `out_dir`."""
    cfg = DistillConfig() if config is None else config
    if not isinstance(cfg, DistillConfig):
        _invalid("config", cfg, "pass a DistillConfig or None")
    args = llm.engine.model_args
    if cfg.hidden_size > args.hidden_size:
        _invalid("hidden_size", cfg.hidden_size, f"it must be <= the target's hidden size "
                 f"{args.hidden_size} (the embedding is a PCA projection of the target's)")
    if cfg.top_k_logits > args.vocab_size:
        _invalid("top_k_logits", cfg.top_k_logits, f"it must be <= vocab_size={args.vocab_size}")
    log = functools.partial(print, flush=True) if progress else (lambda *a, **k: None)
    start, P = time.perf_counter(), cfg.prompt_len
    train = target_generations(llm, cfg.num_prompts, P, cfg.gen_len, "calibration", cfg.seed)
    held = target_generations(llm, cfg.num_heldout_prompts, P, cfg.gen_len, "heldout")
    topk_lp, topk_idx = teacher_topk(llm, train, P, cfg.top_k_logits)
    log(f"[distill] teacher data: {len(train)} + {len(held)} held-out sequences in "
        f"{time.perf_counter() - start:.1f} s")
    config_dict = draft_config(llm, cfg)
    draft = init_draft(config_dict, llm.engine.model.embed_tokens.weight, cfg.seed)
    history = train_draft(draft, torch.tensor(train), torch.tensor(held), topk_lp, topk_idx,
                          cfg, log)
    path = save_draft(llm, draft, config_dict, out_dir, {"config": asdict(cfg),
                                                         "history": history})
    num_params = sum(p.numel() for p in draft.parameters())   # the tied weight once
    return DistillResult(path, history, num_params, time.perf_counter() - start)


def save_draft(llm, draft, config: dict, out_dir, record: dict) -> Path:
    """fp32 safetensors (the engine casts on load; the tied head stored once, as the embedding),
    config.json, the target's generation config and tokenizer files, and distill.json (`record`:
    the DistillConfig and history)."""
    from safetensors.torch import save_file
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous() for k, v in draft.state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    target = str(llm.engine.config.model)
    (path / "config.json").write_text(json.dumps(dict(config, workbench_draft_of=target),
                                                 indent=2, default=str))
    src = llm.engine.checkpoint
    for f in src.iterdir():
        if f.is_file() and (f.name == "generation_config.json"
                            or f.name.startswith(TOKENIZER_PREFIXES)):
            shutil.copy(f, path / f.name)
    (path / "distill.json").write_text(json.dumps(dict(record, target=target), indent=2))
    return path

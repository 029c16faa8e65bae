"""workbench/compress/draft.py: a tiny draft distilled from the real SmolLM2 (a very small config, so
the file runs in well under a minute on 2 cores), saved, and loaded back by the engine and by
transformers; plus the pieces (PCA embedding, the fused loss, determinism) on synthetic data."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.compress.draft import (DistillConfig, SoftTargetHead, agreement, distill_draft,
                                    init_draft, pca_embedding, target_generations, teacher_topk,
                                    train_draft)

from conftest import hf_greedy, hf_model

torch.set_num_threads(1)

# Small enough for seconds of training; lr 3e-2 (defaults: 3e-3) so 60 steps fit the data.
SMALL = dict(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128,
             num_prompts=16, prompt_len=16, gen_len=32, steps=60, batch_size=8, lr=3e-2,
             top_k_logits=16, eval_every=20, num_heldout_prompts=8, seed=0)


@pytest.fixture(scope="module")
def llm():
    # max_num_seqs=16: all the prompts of one generate call decode together, which is faster on
    # CPU too (`python -m workbench.bench offline-mixed` measures what batching gains).
    return LLM(model="smollm2-135m", dtype="auto", device="cpu", verbose=False,
               max_model_len=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def train_seqs(llm):
    return target_generations(llm, SMALL["num_prompts"], SMALL["prompt_len"], SMALL["gen_len"],
                              "calibration", seed=SMALL["seed"])


@pytest.fixture(scope="module")
def result(llm, tmp_path_factory):
    return distill_draft(llm, tmp_path_factory.mktemp("draft") / "smollm2-draft",
                         DistillConfig(**SMALL))


# ------------------------------------------------------------------------------- teacher data
def test_target_generations_are_prompt_plus_greedy_continuation(llm, train_seqs):
    from workbench.quant.calibration import calibration_windows
    P, G = SMALL["prompt_len"], SMALL["gen_len"]
    windows = calibration_windows(llm.get_tokenizer(), SMALL["num_prompts"], P, seed=0)
    assert [s[:P] for s in train_seqs] == windows
    assert all(len(s) == P + G for s in train_seqs)
    # The same as one greedy request on its own (continuous batching changes nothing).
    alone = llm.generate(train_seqs[3][:P], SamplingParams(temperature=0, max_tokens=G,
                                                           ignore_eos=True))
    assert alone[0].outputs[0].token_ids == train_seqs[3][P:]


def test_teacher_topk_is_aligned_with_the_generated_tokens(llm, train_seqs):
    P = SMALL["prompt_len"]
    lp, idx = teacher_topk(llm, train_seqs[:4], P, 8)
    assert lp.shape == idx.shape == (4, SMALL["gen_len"], 8)
    # Row t is the distribution of generated token t: its top-1 is that greedy token (prefill vs
    # decode in bf16 may swap near-ties, hence not 100%).
    generated = torch.tensor([s[P:] for s in train_seqs[:4]])
    assert (idx[..., 0] == generated).float().mean() > 0.9
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(4, SMALL["gen_len"]))
    assert (lp.diff(dim=-1) <= 0).all()


# ------------------------------------------------------------------------------- distillation
def test_training_learns_the_teacher(result, train_seqs):
    P = SMALL["prompt_len"]
    steps = [h["step"] for h in result.history]
    assert steps == [0, 20, 40, 60]
    assert result.history[0]["train_loss"] is None
    assert result.history[-1]["train_loss"] < 0.7 * result.history[1]["train_loss"]
    assert result.history[-1]["agreement"] > result.history[0]["agreement"]
    # Fitted the target's generations well beyond the trivial "most frequent token" predictor.
    # (Held-out agreement above that baseline needs the default config's data and minutes,
    # 64 prompts x 96 tokens and 200 steps: `python -m workbench.bench spec --drafters
    # draft_model` distils that draft and measures its acceptance; 512 tokens here can't
    # generalise.)
    draft = hf_model(result.path)
    train = torch.tensor(train_seqs)
    most_frequent = Counter(train[:, P:].flatten().tolist()).most_common(1)[0][0]
    baseline = (train[:, P:] == most_frequent).float().mean().item()
    assert agreement(draft, train, P) > max(2 * baseline, 0.15)
    assert result.num_params == sum(p.numel() for p in draft.parameters())
    assert result.seconds > 0


def test_saved_folder_is_a_complete_checkpoint(result, llm):
    files = {f.name for f in result.path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "distill.json"} <= files
    cfg = json.loads((result.path / "config.json").read_text())
    target = json.loads((llm.engine.checkpoint / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "rms_norm_eps",
                "max_position_embeddings", "vocab_size"):
        assert cfg[key] == target[key], key
    assert cfg["rope_theta"] == target["rope_parameters"]["rope_theta"] == 100000.0
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["model_type"] == "llama" and cfg["head_dim"] == 32
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (64, 1)
    from safetensors import safe_open
    with safe_open(str(result.path / "model.safetensors"), framework="pt") as st:
        assert "lm_head.weight" not in st.keys()                 # tied: stored once
        assert {st.get_tensor(k).dtype for k in st.keys()} == {torch.float32}
    record = json.loads((result.path / "distill.json").read_text())
    assert record["history"] == result.history and record["config"]["hidden_size"] == 64


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_and_transformers_agree_on_the_draft(result, dtype):
    engine = LLM(model=str(result.path), dtype=dtype, device="cpu", verbose=False,
                 max_model_len=128, max_num_seqs=2)
    hf = hf_model(result.path, getattr(torch, dtype))
    tok = engine.get_tokenizer()
    prompts = ["The with statement is used to wrap the execution of a block",
               "def fibonacci(n):\n    \"\"\"Return"]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, tok.encode(prompt), 24), prompt


# ------------------------------------------------------------------------------- pieces
def test_pca_embedding_keeps_the_top_principal_directions():
    g = torch.Generator().manual_seed(0)
    e = torch.randn(500, 12, generator=g) * torch.linspace(3, 0.1, 12) + 5.0
    p = pca_embedding(e, 4)
    assert p.shape == (500, 4)
    torch.testing.assert_close(p.mean(0), torch.zeros(4), atol=1e-4, rtol=0)   # centred
    var = p.var(0)
    assert (var.diff() < 0).all()                                             # descending
    s = torch.linalg.svdvals(e.double() - e.double().mean(0))[:4] ** 2 / 499
    torch.testing.assert_close(var.double(), s, rtol=1e-4, atol=0)
    assert torch.equal(p, pca_embedding(e, 4))                                # deterministic


def test_soft_target_head_matches_autograd_reference():
    g = torch.Generator().manual_seed(1)
    n, h, v, k, w = 40, 16, 3000, 6, 0.3
    x = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (torch.randn(v, h, generator=g) * 0.5).requires_grad_()
    greedy = torch.randint(0, v, (n, 1), generator=g)
    top = torch.randn(n, v, generator=g).topk(k, -1).indices
    top[:10, 0] = greedy[:10, 0]                      # the greedy token among the top-k
    p = torch.softmax(torch.randn(n, k, generator=g), -1)
    loss = SoftTargetHead.apply(x, weight, torch.cat([greedy, top], -1),
                                torch.cat([torch.full((n, 1), 1 - w), w * p], -1))
    (3 * loss).backward()
    x2, w2 = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logq = (x2.bfloat16() @ w2.bfloat16().T).float().log_softmax(-1)
    ref = ((1 - w) * -logq.gather(-1, greedy).squeeze(-1)
           + w * (p * (p.log() - logq.gather(-1, top))).sum(-1)).mean()
    (3 * ref).backward()
    torch.testing.assert_close(loss + w * (p * p.log()).sum(-1).mean(), ref, rtol=0, atol=5e-3)
    for ours, theirs in ((x.grad, x2.grad), (weight.grad, w2.grad)):
        assert (ours - theirs).abs().max() <= 0.02 * theirs.abs().max()


def test_training_is_deterministic_given_the_seed():
    g = torch.Generator().manual_seed(2)
    vocab, P, G = 300, 4, 12
    cfg = DistillConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                        intermediate_size=32, num_prompts=6, prompt_len=P, gen_len=G, steps=6,
                        batch_size=4, eval_every=3, top_k_logits=5, num_heldout_prompts=2, seed=7)
    model_cfg = dict(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                     tie_word_embeddings=True)
    embedding = torch.randn(vocab, 24, generator=g)
    train = torch.randint(0, vocab, (6, P + G), generator=g)
    held = torch.randint(0, vocab, (2, P + G), generator=g)
    lp, idx = torch.randn(6, G, vocab, generator=g).log_softmax(-1).topk(5, -1)
    lp = lp - lp.logsumexp(-1, keepdim=True)
    runs = []
    for _ in range(2):
        draft = init_draft(model_cfg, embedding, cfg.seed)
        history = train_draft(draft, train, held, lp, idx, cfg, log=lambda *a: None)
        runs.append((history, draft.state_dict()))
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 3
    assert runs[0][1] and runs[0][1].keys() == runs[1][1].keys()
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


# ------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("field, value", [
    ("hidden_size", 100), ("num_kv_heads", 3), ("kl_weight", 1.5), ("lr", 0.0), ("steps", 0),
    ("batch_size", 128), ("seed", -1), ("num_layers", True), ("lr", "fast"),
    ("top_k_logits", 0), ("eval_every", 2.5), ("gen_len", -4),
])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}="):
        DistillConfig(**{field: value})


def test_bad_arguments_against_the_target_name_the_field(llm, tmp_path):
    with pytest.raises(ValueError, match="^hidden_size=640 .*target's hidden size 576"):
        distill_draft(llm, tmp_path, DistillConfig(hidden_size=640, num_heads=10, num_kv_heads=5))
    with pytest.raises(ValueError, match="^part='test'"):
        target_generations(llm, 2, 8, 8, part="test")
    with pytest.raises(ValueError, match="^gen_len=300 .*max_model_len=256"):
        target_generations(llm, 2, 8, 300)
    with pytest.raises(ValueError, match="^num_prompts=100000 "):
        target_generations(llm, 100000, 8, 8)
    assert not any(tmp_path.iterdir())

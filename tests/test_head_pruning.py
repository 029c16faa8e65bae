"""Structured pruning of query heads (`pruning="heads"`, compress/structured.py): the score on a
model whose heads we control, the greedy per-layer choice on hand-made scores, and a model with
heads removed by hand (a different number per layer, grouped-query attention) against a
transformers-free reference forward through every path that runs attention: the fused C++ decode
step, the layer-by-layer C++ paged decode, plain PyTorch, batch-invariant, compiled, the Triton
kernels (interpreted), speculative verification; prefill and decode over the paged KV cache. Then
SmolLM2 pruned for real, the saved checkpoint's round trip, quantization on load, distillation of
a head-pruned student, and the knobs' errors."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.kernels.cpu import available
from workbench import LLM, SamplingParams
from workbench.compress.checkpoint import save_pruned
from workbench.compress.pruning import PruneConfig
from workbench.compress.structured import (head_counts, head_scores, heads_removed_per_group,
                                           kept_heads, prune_heads, slice_heads)
from workbench.models.loader import load_model
from workbench.quant.calibration import heldout_windows
from workbench.experiments.quality import compare_many
from workbench.quant.forward import prefill_hidden

needs_kernels = pytest.mark.skipif(not available()[0], reason="CPU kernels unavailable")

# 6 query heads in 2 KV groups of 3, head_dim 16 (what the C++ attention takes), 3 layers.
SMALL = dict(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
             rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
             initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=2,
             hidden_act="silu")
# Kept per layer: 4 (2 per group), 2 (1 per group), all 6.
KEEP = {0: [0, 2, 3, 5], 1: [1, 4]}


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("small")
    LlamaForCausalLM(LlamaConfig(**SMALL)).save_pretrained(folder)
    return folder


def fp32_model(folder):
    return load_model(folder, torch.float32, torch.device("cpu"))


def remove_heads_by_hand(attn, keep: list[int]) -> None:
    """Slice the query rows of qkv_proj and the columns of o_proj (independently of the code under
    test) and set the layer's head count."""
    d = attn.head_dim
    rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in keep])
    w = attn.qkv_proj.weight.data
    qkv = torch.cat([w[:attn.q_size][rows], w[attn.q_size:]])
    attn.qkv_proj = nn.Linear(qkv.shape[1], qkv.shape[0], bias=False)
    attn.qkv_proj.weight.data = qkv.clone()
    o = attn.o_proj.weight.data[:, rows].clone()
    attn.o_proj = nn.Linear(o.shape[1], o.shape[0], bias=False)
    attn.o_proj.weight.data = o
    attn.num_heads, attn.q_size = len(keep), len(keep) * d


def zero_heads(attn, keep: list[int]) -> None:
    """The heads not in `keep` add nothing: their o_proj columns zeroed."""
    d = attn.head_dim
    for h in set(range(attn.num_heads)) - set(keep):
        attn.o_proj.weight.data[:, h * d:(h + 1) * d] = 0


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """(T, vocab) fp32 logits of a plain causal forward, written out head by head: query head i
    of a layer with H_l heads reads KV head i // (H_l / KVH)."""
    a, n = model.args, len(ids)
    x = model.embed_tokens.weight[torch.tensor(ids)].float()
    inv = 1.0 / a.rope_theta ** (torch.arange(0, a.head_dim, 2).float() / a.head_dim)
    ang = torch.arange(n).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(t):
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[:, half:], t[:, :half]], -1) * sin

    def norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + a.rms_norm_eps) * w

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in model.layers:
        attn = layer.self_attn
        heads, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        qkv = norm(x, layer.input_layernorm.weight) @ attn.qkv_proj.weight.T
        q, k, v = qkv.split([heads * d, kv * d, kv * d], -1)
        outs = []
        for i in range(heads):
            j = i // (heads // kv)
            s = rope(q[:, i * d:(i + 1) * d]) @ rope(k[:, j * d:(j + 1) * d]).T * d ** -0.5
            outs.append(s.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, j * d:(j + 1) * d])
        x = x + torch.cat(outs, -1) @ attn.o_proj.weight.T
        gate, up = (norm(x, layer.post_attention_layernorm.weight)
                    @ layer.mlp.gate_up_proj.weight.T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ layer.mlp.down_proj.weight.T
    return norm(x, model.norm.weight) @ model.lm_head.weight.T


def reference_greedy(model, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens by the reference and its log-probs (T, vocab) over prompt + tokens."""
    ids = list(prompt)
    for _ in range(new):
        ids.append(int(reference_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):], torch.log_softmax(reference_logits(model, ids), -1)


# ----------------------------------------------------------------------------- (a) the score
def test_a_head_that_adds_nothing_scores_zero_and_goes_first(small_folder):
    model = fp32_model(small_folder)
    windows = [list(range(7, 40)), list(range(100, 130))]
    for h in (1, 4):        # layer 0: the middle head of each KV group writes nothing
        zero_heads(model.layers[0].self_attn, [i for i in range(6) if i != h])
    scores, stream = head_scores(model, windows)
    assert [s.shape for s in scores] == [(6,)] * 3 and len(stream) == 3
    embedded = model.embed_tokens.weight[torch.tensor(windows[0] + windows[1])].double()
    assert abs(stream[0] - embedded.pow(2).sum(-1).mean().sqrt().item()) < 1e-6 * stream[0]
    assert scores[0][1] == 0 and scores[0][4] == 0 and (scores[0][[0, 2, 3, 5]] > 1e-3).all()

    # The score is the RMS over tokens of what the head adds to the residual stream, measured
    # here directly from o_proj's inputs in the whole model's forward.
    inputs = []
    hook = model.layers[2].self_attn.o_proj.register_forward_pre_hook(
        lambda m, args: inputs.append(args[0].detach().clone()))
    for w in windows:
        prefill_hidden(model, w)
    hook.remove()
    a = torch.cat(inputs).double()
    w_o = model.layers[2].self_attn.o_proj.weight.double()
    direct = torch.stack([(a[:, h * 16:(h + 1) * 16] @ w_o[:, h * 16:(h + 1) * 16].T)
                          .pow(2).sum(-1).mean().sqrt() for h in range(6)])
    torch.testing.assert_close(scores[2], direct, rtol=1e-5, atol=0)

    # 2 of 18 heads: one step, from the layer whose step costs 0 (relative to its stream or not);
    # each group keeps its others.
    counts = prune_heads(model, 2 / 18, windows)
    assert counts == {0: 4, 1: 6, 2: 6} and head_counts(model) == [4, 6, 6]
    original = fp32_model(small_folder).layers[0].self_attn
    w = original.qkv_proj.weight
    keep_rows = torch.cat([torch.arange(h * 16, (h + 1) * 16) for h in (0, 2, 3, 5)])
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight,
                       torch.cat([w[:96][keep_rows], w[96:]]))
    assert torch.equal(model.layers[0].self_attn.o_proj.weight,
                       original.o_proj.weight[:, keep_rows])


def test_slicing_heads_computes_what_zeroing_them_does(small_folder):
    zeroed, sliced = fp32_model(small_folder), fp32_model(small_folder)
    for index, keep in KEEP.items():
        zero_heads(zeroed.layers[index].self_attn, keep)
        slice_heads(sliced.layers[index].self_attn, torch.tensor(keep))
    assert head_counts(sliced) == [4, 2, 6]
    ids = [5, 17, 300, 41, 9, 77, 128, 3]
    torch.testing.assert_close(prefill_hidden(sliced, ids), prefill_hidden(zeroed, ids),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reference_logits(sliced, ids), reference_logits(zeroed, ids),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"keep=\[0, 1, 3\] is invalid: each of the 2 KV groups"):
        slice_heads(fp32_model(small_folder).layers[0].self_attn, torch.tensor([0, 1, 3]))


# ----------------------------------------------------------------------------- (b) the choice
SCORES = [torch.tensor([5.0, 1, 9, 8, 2, 7]),       # groups sorted: [1 5 9] [2 7 8]: steps 3, 12
          torch.tensor([0.5, 4, 4, 0.5, 6, 6]),     # [.5 4 4] [.5 6 6]: steps 1, 10
          torch.tensor([20.0, 30, 40, 25, 35, 45])]  # steps 45, 65


@pytest.mark.parametrize("count, expected", [(0, [0, 0, 0]), (1, [0, 1, 0]), (2, [0, 1, 0]),
                                             (4, [1, 1, 0]), (5, [1, 2, 0]), (6, [1, 2, 0]),
                                             (8, [2, 2, 0]), (10, [2, 2, 1]), (12, [2, 2, 2])])
def test_the_greedy_choice_takes_the_cheapest_step_over_all_layers(count, expected):
    removed = heads_removed_per_group(SCORES, 2, count)
    assert removed == expected
    assert all(r <= 2 for r in removed)                 # every group keeps a head
    assert 2 * sum(removed) >= count and 2 * sum(removed) - count < 2


def test_a_group_never_loses_its_last_head():
    with pytest.raises(ValueError, match="removing 13 query heads would empty a KV group: at most "
                                         "12 can go"):
        heads_removed_per_group(SCORES, 2, 13)


def test_each_group_keeps_its_highest_scores_in_order():
    assert kept_heads(SCORES[0], 2, 1).tolist() == [0, 2, 3, 5]
    assert kept_heads(SCORES[0], 2, 2).tolist() == [2, 3]
    assert kept_heads(SCORES[1], 2, 1).tolist() == [1, 2, 4, 5]
    assert kept_heads(SCORES[1], 2, 2).tolist() == [2, 5]           # a tie: the lower index goes
    assert kept_heads(SCORES[2], 2, 0).tolist() == list(range(6))


# ----------------------------------------------------------------------------- (c) every path
@pytest.fixture(scope="module")
def hand_pruned(small_folder, tmp_path_factory):
    """(pruned checkpoint folder, the unpruned model with the same heads zeroed)."""
    sliced, zeroed = fp32_model(small_folder), fp32_model(small_folder)
    for index, keep in KEEP.items():
        remove_heads_by_hand(sliced.layers[index].self_attn, keep)
        zero_heads(zeroed.layers[index].self_attn, keep)
    folder = save_pruned(sliced, PruneConfig.from_args("heads", {}), small_folder,
                         tmp_path_factory.mktemp("hand") / "pruned")
    return folder, zeroed


PROMPTS = [[5, 17, 300, 41, 9, 77, 128, 3, 5, 17, 300, 41], [11, 12, 13, 11, 12, 13, 11]]
NEW = 10
PATHS = {
    "default": {},                                              # fused C++ decode step
    "layer_by_layer": {"fused_decode": False},                  # C++ paged decode attention
    "torch": {"cpu_gemv": False, "attention_backend": "torch"},
    "batch_invariant": {"batch_invariant": True},
    "compiled": {"compile": True},
    "contiguous_cache": {"kv_cache_layout": "contiguous", "attention_backend": "torch"},
    "speculative": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "triton": {"attention_backend": "triton"},          # the kernels/ package, interpreted on CPU
}


@needs_kernels
@pytest.mark.parametrize("path", list(PATHS))
def test_per_layer_heads_give_the_reference_logits_on_every_path(hand_pruned, path):
    folder, zeroed = hand_pruned
    if path == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 (conftest sets it, no CUDA)")
    llm = LLM(model=str(folder), dtype="float32", device="cpu", verbose=False, max_model_len=128,
              max_num_seqs=4, **PATHS[path])
    assert head_counts(llm.engine.model) == [4, 2, 6]
    if path in ("default", "speculative"):
        from workbench.models.fused_decode import FusedDecodeForward
        assert isinstance(llm.engine.runner.forward_fn, FusedDecodeForward)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    outs = llm.generate(PROMPTS, params)
    if path == "speculative":                   # verifications (k + 1 tokens a sequence) ran
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        tokens, ref = reference_greedy(zeroed, prompt, NEW)
        assert list(out.outputs[0].token_ids) == tokens
        # the first prompt token has no logprobs; every other position has its top 3 at least
        assert len(out.outputs[0].logprobs) == NEW and len(out.prompt_logprobs) == len(prompt)
        assert all(len(top) >= 3 for top in out.outputs[0].logprobs + out.prompt_logprobs[1:])
        for t, top in enumerate(out.outputs[0].logprobs):       # decode steps, paged KV
            for token, lp in top.items():
                assert abs(lp.logprob - ref[len(prompt) + t - 1, token].item()) < 1e-4
        for t, top in enumerate(out.prompt_logprobs[1:], start=1):  # the prefill
            for token, lp in top.items():
                assert abs(lp.logprob - ref[t - 1, token].item()) < 1e-4


@needs_kernels
def test_bf16_fused_steps_give_the_unfused_tokens(hand_pruned):
    folder, _ = hand_pruned
    kw = dict(model=str(folder), dtype="bfloat16", device="cpu", verbose=False, max_model_len=128,
              cpu_gemv=True, attention_backend="cpu")
    fused, plain = LLM(fused_decode=True, **kw), LLM(fused_decode=False, **kw)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in fused.generate(PROMPTS, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]


def test_the_training_forward_reads_each_layers_heads(hand_pruned):
    from workbench.compress.checkpoint import load_pruned
    from workbench.compress.train_forward import hidden_states
    folder, zeroed = hand_pruned
    model, manifest = load_pruned(folder, torch.float32, torch.device("cpu"))
    assert manifest["num_attention_heads"] == [4, 2, 6]
    ids = torch.tensor(PROMPTS[:1])
    with torch.no_grad():
        torch.testing.assert_close(model.compute_logits(hidden_states(model, ids))[0],
                                   reference_logits(zeroed, PROMPTS[0]), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- (d) SmolLM2
@pytest.fixture(scope="module")
def smollm2_heads():
    return LLM(model="smollm2-135m", dtype="float32", verbose=False, max_model_len=256,
               num_kv_blocks=64, pruning="heads",
               pruning_config={"ratio": 0.25, "num_calibration_windows": 2,
                               "calibration_window_len": 64})


def test_on_smollm2_a_quarter_of_the_heads_go_and_it_still_works(smollm2_llm, smollm2_heads):
    dense, small = smollm2_llm, smollm2_heads
    counts = head_counts(small.engine.model)
    # round(0.25 * 270) = 68 heads, in whole steps of one head per KV group (3): 69.
    assert sum(counts) == 270 - 69 and len(counts) == 30
    assert all(c in (3, 6, 9) for c in counts) and len(set(counts)) > 1
    assert small.engine.kv_cache_bytes * dense.engine.kv_cache_tokens \
        == dense.engine.kv_cache_bytes * small.engine.kv_cache_tokens     # KV heads untouched
    assert dense.engine.model.num_parameters() - small.engine.model.num_parameters() \
        == 69 * 64 * 576 * 2                    # each head's q rows and o_proj columns
    assert "pruning=heads 25%" in small.describe()
    out = small.generate(["The capital of France is"],
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8 and out[0].outputs[0].text.strip()
    result = compare_many(dense, {"heads": small},
                          heldout_windows(dense.engine.tokenizer, 2, 128))["heads"]
    assert math.isfinite(result.ppl_candidate) and result.mean_kl > 0, result
    # Costs relative to the residual stream keep it within a few times the dense perplexity
    # (absolute scores would strip the first ten layers instead, far worse); the failure message
    # prints the measured result.
    assert result.ppl_candidate < 6 * result.ppl_reference, (counts, result)


# ----------------------------------------------------------------------------- (e) save, load
def test_a_saved_head_pruned_model_loads_back_and_quantizes(tmp_path):
    pruned = LLM(model="random:tiny", dtype="float32", verbose=False, pruning="heads",
                 pruning_config={"ratio": 0.25, "num_calibration_windows": 2,
                                 "calibration_window_len": 32})
    counts = head_counts(pruned.engine.model)
    assert sorted(counts) == [2, 4]            # 2 of 8 heads: one per KV group of one layer
    folder = pruned.save_pruned(tmp_path / "pruned")
    manifest = json.loads((tmp_path / "pruned" / "pruning.json").read_text())
    assert manifest["method"] == "heads" and manifest["num_attention_heads"] == counts
    assert json.loads((tmp_path / "pruned" / "config.json").read_text())[
        "num_attention_heads"] == 4
    loaded = LLM(model=folder, dtype="float32", verbose=False)
    assert "pruned checkpoint (heads)" in loaded.describe()
    assert head_counts(loaded.engine.model) == counts
    a, b = pruned.engine.model.state_dict(), loaded.engine.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from conftest import engine_next_token_logits
    prompt = [4, 8, 15, 16, 23, 42]
    assert torch.equal(engine_next_token_logits(pruned, prompt),
                       engine_next_token_logits(loaded, prompt))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert pruned.generate([prompt], sp)[0].outputs[0].token_ids == \
        loaded.generate([prompt], sp)[0].outputs[0].token_ids
    for method in ("int4", "int8"):
        both = LLM(model=folder, dtype="float32", verbose=False, quantization=method)
        assert both.engine.quantization == method and head_counts(both.engine.model) == counts
        assert len(both.generate([prompt], sp)[0].outputs[0].token_ids) == 6
    for method in ("awq", "smoothquant"):      # scales folded with each layer's head count
        both = LLM(model=folder, dtype="float32", verbose=False, quantization=method,
                   quantization_config={"num_calibration_windows": 2,
                                        "calibration_window_len": 32})
        assert len(both.generate([prompt], sp)[0].outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="is a pruned checkpoint, and the parallel engine"):
        LLM(model=folder, verbose=False, tensor_parallel_size=2)


def test_a_head_pruned_student_distils(tiny_llm, tmp_path):
    from workbench.compress.distill import StudentDistillConfig, distill_student
    folder = LLM(model="random:tiny", dtype="float32", verbose=False, pruning="heads",
                 pruning_config={"ratio": 0.25, "num_calibration_windows": 2,
                                 "calibration_window_len": 32}).save_pruned(tmp_path / "pruned")
    cfg = StudentDistillConfig(steps=2, batch_size=2, seq_len=16, num_sequences=4,
                               eval_windows=2, eval_every=2, checkpoint_every=0)
    run = distill_student(folder, tiny_llm, tmp_path / "student", cfg)
    assert [h["step"] for h in run.history] == [0, 2]
    manifest = json.loads((tmp_path / "student" / "pruning.json").read_text())
    assert manifest["method"] == "heads" and sorted(manifest["num_attention_heads"]) == [2, 4]
    student = LLM(model=str(tmp_path / "student"), dtype="float32", verbose=False)
    assert sorted(head_counts(student.engine.model)) == [2, 4]


# ----------------------------------------------------------------------------- (f) errors
@pytest.mark.parametrize("options, message", [
    ({"ratio": 1.0}, r"pruning_config\['ratio'\]=1.0 is invalid"),
    ({"ratio": -0.1}, r"pruning_config\['ratio'\]=-0.1 is invalid"),
    ({"pattern": "2:4"}, r"\['pattern'\] do not apply to pruning='heads'"),
    ({"sparsity": 0.5}, r"\['sparsity'\] do not apply to pruning='heads'"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        PruneConfig.from_args("heads", options)
    with pytest.raises(ValueError, match=message):
        LLM(model="random:tiny", pruning="heads", pruning_config=options, verbose=False)


@pytest.mark.parametrize("preset, ratio, message", [
    ("tiny", 0.75, r"pruning_config\['ratio'\]=0.75 would remove 6 of the 8 query heads, and "
                   r"every one of the 2 KV groups per layer keeps at least one of its 2: "
                   r"at most 4"),
    ("tiny-mha", 0.25, r"pruning_config\['ratio'\]=0.25 would remove 3 of the 12 query heads.* "
                       r"at most 0 "),
])
def test_a_ratio_that_would_empty_a_group_is_refused(preset, ratio, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=f"random:{preset}", pruning="heads", verbose=False,
            pruning_config={"ratio": ratio, "num_calibration_windows": 1,
                            "calibration_window_len": 16})

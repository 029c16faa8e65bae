"""Cross-layer KV sharing in the training forward, and its short distillation: the training
forward with sharing equals the evaluation path, only the sharing layers train, and the held-out
KL to the unshared model falls."""
from __future__ import annotations

import pytest
import torch

from workbench import LLM
from workbench.compress.train_forward import hidden_states
from workbench.experiments.cla_distill import distill_sharing
from workbench.experiments.kv_compression import KVTransform, perplexity, sharing_map, window_nll
from workbench.models import make_random_checkpoint
from workbench.models.loader import load_model
from workbench.quant.calibration import heldout_windows


def test_training_forward_with_sharing_equals_the_evaluation_path(tiny_folder):
    model = load_model(tiny_folder, torch.float32, torch.device("cpu")).eval()
    n = len(model.layers)
    ids = torch.randint(5, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    for share in (list(range(n)), sharing_map(n, 2)):
        with torch.no_grad():
            lp = torch.log_softmax(model.compute_logits(hidden_states(model, ids, share_from=share))[0], -1)
        nll = -lp[:-1].gather(1, ids[0, 1:, None])[:, 0].double()
        expected = window_nll(model, ids[0].tolist(), KVTransform(share_from=share))
        assert torch.allclose(nll, expected, atol=1e-4), (share, (nll - expected).abs().max())
    assert sharing_map(n, 2) != list(range(n))


def test_sharing_is_refused_with_a_decode_cache(tiny_folder):
    model = load_model(tiny_folder, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="share_from with a decode cache is invalid"):
        hidden_states(model, torch.tensor([[5, 6]]), cache=[], share_from=[0, 0])


def test_distillation_trains_only_the_sharing_layers_and_lowers_perplexity(tiny_llm):
    n = len(tiny_llm.engine.model.layers)
    share = sharing_map(n, 2)
    result = distill_sharing(tiny_llm, share, steps=12, batch_size=4, seq_len=32,
                             num_sequences=16, lr=3e-3, eval_windows=2, eval_len=32)
    assert result["trained_layers"] == [i for i, s in enumerate(share) if s != i]
    teacher, student = tiny_llm.engine.model, result["student"]
    assert len(student.layers) == n
    for i, (a, b) in enumerate(zip(teacher.layers, student.layers)):
        # frozen layers are the engine's own modules; trained ones are copies that moved
        assert (a is b) == (i not in result["trained_layers"]), i
        if a is not b:
            assert not any(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())), i
            assert all(p.dtype == q.dtype for p, q in zip(a.parameters(), b.parameters())), i
    assert student.embed_tokens is teacher.embed_tokens and student.lm_head is teacher.lm_head
    assert result["trained_params"] == sum(p.numel() for i in result["trained_layers"]
                                           for p in teacher.layers[i].parameters())
    # a random tiny model's perplexity is near its vocabulary size whatever it does: the KL to the
    # unshared model is what the training lowers
    assert result["kl_after"] < 0.8 * result["kl_before"], result
    assert [h["step"] for h in result["history"]] == [0, 12]
    # the perplexity before training is compress_eval's number for the same sharing and windows,
    # and the engine's own weights are untouched and frozen again afterwards
    held = heldout_windows(tiny_llm.get_tokenizer(), 2, 32)
    assert result["before"] == perplexity(teacher, held, KVTransform(share_from=share))
    assert result["reference"] == perplexity(teacher, held)
    assert all(p.requires_grad for p in teacher.parameters())


@pytest.mark.parametrize("share, message", [([0], "one entry per layer"),
                                            (None, "one entry per layer")])
def test_bad_sharing_maps_are_refused(tiny_llm, share, message):
    with pytest.raises(ValueError, match=message):
        distill_sharing(tiny_llm, share)


def test_a_map_without_sharing_is_refused(tiny_llm):
    n = len(tiny_llm.engine.model.layers)
    with pytest.raises(ValueError, match="no layer shares"):
        distill_sharing(tiny_llm, list(range(n)))


def test_the_benchmark_row_is_the_tables_deep_pair_row_after_training():
    """bench memory's distilled row starts from the table's own deep-pair number (same windows,
    same evaluation path) and keeps that row's bytes (3 layers: the deepest pair shares)."""
    from workbench.bench.memory import distilled_sharing_row
    from workbench.experiments.kv_compression import compression_table
    llm = LLM(model=str(make_random_checkpoint("tiny-mha", seed=0)), dtype="float32", verbose=False)
    n = len(llm.engine.model.layers)
    rows = compression_table(llm, num_windows=1, window_len=32, calibration_windows_count=1,
                             counts=(1,), ranks=(4,))
    row = distilled_sharing_row(llm, rows, 1, 32, steps=2, seed=0)
    deep = next(r for r in rows if r["setting"] == f"groups of 2, layers {n // 2}+")
    assert row["perplexity_before"] == deep["perplexity"]
    assert (row["kv_bytes_per_token"], row["ratio"]) == (deep["kv_bytes_per_token"], deep["ratio"])
    assert row["delta"] == row["perplexity"] - rows[0]["perplexity"]
    assert row["setting"] == f"groups of 2, layers {n // 2}+, distilled 2 steps"
    assert row["kl_after"] < row["kl_before"]

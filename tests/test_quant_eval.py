"""The quantization evaluation harness on the real model and tokenizer: the calibration/held-out
split of CPython's docs, next-token distributions taken from the engine's own forward pass, and the
metrics (perplexity, KL, top-1 agreement, bytes) on known cases."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import engine_next_token_logits
from workbench import LLM
from workbench.quant import calibration as cal
from workbench.experiments import quality as ev

WINDOWS, WINDOW_LEN = 2, 128


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tests run whole-window prefills. On a shared 2-core machine that is oversubscribed,
    two intra-op threads wait at every op's barrier for a descheduled thread, which makes a
    window many times slower than with one thread (`python -m pytest tests/test_quant_eval.py
    --durations=5` times the tests), so the module runs single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer(smollm2_llm):
    return smollm2_llm.get_tokenizer()


@pytest.fixture(scope="module")
def windows(tokenizer):
    return cal.heldout_windows(tokenizer, WINDOWS, WINDOW_LEN)


# ------------------------------------------------------------------------ calibration text
def test_calibration_and_heldout_share_no_topic_and_no_text():
    from pydoc_data.topics import topics
    calibration, heldout = cal.split_topics()
    assert not set(calibration) & set(heldout)
    assert sorted(calibration + heldout) == sorted(topics)
    assert heldout and len(calibration) > len(heldout)
    held = set(cal.part_paragraphs("heldout"))
    assert all(p in held for t in heldout for p in topics[t].split("\n\n"))   # kept whole
    # Topics repeat each other (in 3.11 'if' and 'else' are one text), so disjoint topics are not enough:
    # no line of 40 characters or more may appear in both parts.
    def long_lines(part):
        return {line.strip() for line in cal.part_text(part).split("\n")
                if len(line.strip()) >= 40}
    assert not long_lines("heldout") & long_lines("calibration")


def test_windows_are_deterministic_and_come_from_their_part(tokenizer):
    held = cal.heldout_windows(tokenizer, 3, 64)
    assert held == cal.heldout_windows(tokenizer, 3, 64)
    assert all(len(w) == 64 for w in held)
    stream = cal.part_tokens(tokenizer, "heldout")
    assert held == [stream[0:64], stream[64:128], stream[128:192]]
    calib = cal.calibration_windows(tokenizer, 8, 64, seed=0)
    assert calib == cal.calibration_windows(tokenizer, 8, 64, seed=0)
    assert calib != cal.calibration_windows(tokenizer, 8, 64, seed=1)
    assert len({tuple(w) for w in calib}) == 8               # distinct windows
    cstream = cal.part_tokens(tokenizer, "calibration")
    # every window is an aligned slice of the calibration stream
    assert all(any(cstream[i:i + 64] == w for i in range(0, len(cstream) - 63, 64))
               for w in calib)


def test_calibration_errors_name_the_field(tokenizer):
    available = len(cal.part_tokens(tokenizer, "heldout")) // 256
    with pytest.raises(ValueError, match=f"num_windows={available + 1} .* holds {available} "):
        cal.heldout_windows(tokenizer, available + 1, 256)
    with pytest.raises(ValueError, match="window_len=1 is invalid"):
        cal.calibration_windows(tokenizer, 1, 1)
    with pytest.raises(ValueError, match="num_windows=0 is invalid"):
        cal.calibration_windows(tokenizer, 0, 64)
    with pytest.raises(ValueError, match="part='train' is invalid"):
        cal.part_text("train")


# ------------------------------------------------------------------------ metrics
def test_kl_equals_a_direct_torch_computation():
    g = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(3 * torch.randn(5, 7, 300, generator=g), dim=-1)
    cand = torch.log_softmax(ref + 0.3 * torch.randn(5, 7, 300, generator=g), dim=-1)
    ours = ev.kl_divergence(ref, cand, chunk=4)
    direct = F.kl_div(cand.double(), ref.double(), log_target=True, reduction="none").sum(-1)
    assert ours.shape == (5, 7) and ours.dtype == torch.float64
    torch.testing.assert_close(ours, direct, rtol=1e-12, atol=1e-12)
    assert (ours > 0).all() and (ev.kl_divergence(ref, ref) == 0).all()


def test_window_logprobs_row_t_is_the_next_token_distribution_after_t_tokens(smollm2_llm,
                                                                             windows):
    window = windows[0][:40]
    rows = ev.window_logprobs(smollm2_llm, window)
    assert rows.shape == (40, smollm2_llm.engine.model_args.vocab_size)
    for t in (0, 17, 39):   # one-step prefill of window[:t + 1], compared position by position
        expected = torch.log_softmax(engine_next_token_logits(smollm2_llm, window[:t + 1]), -1)
        torch.testing.assert_close(rows[t], expected, atol=2e-4, rtol=0)
    assert not smollm2_llm.engine.has_unfinished_requests()   # the request was freed


def test_reference_against_itself_is_exact(smollm2_llm, windows):
    r = ev.compare(smollm2_llm, smollm2_llm, windows)
    assert r.mean_kl == 0.0 and r.max_kl == 0.0 and r.top1_agreement == 1.0
    assert r.ppl_candidate == r.ppl_reference
    assert r.num_positions == WINDOWS * WINDOW_LEN
    print(f"SmolLM2 fp32 perplexity on {WINDOWS}x{WINDOW_LEN} held-out tokens: "
          f"{r.ppl_reference:.2f}")
    assert 2 < r.ppl_reference < 100   # docs are in-domain English and code for SmolLM2
    model = smollm2_llm.engine.model
    assert r.decode_read_bytes == model.weight_bytes() == r.weight_bytes   # tied, unquantized
    assert r.kv_bytes_per_token == smollm2_llm.engine.model_args.kv_bytes_per_token(torch.float32)


def test_a_perturbed_candidate_shows_up_in_every_metric(smollm2_llm, windows):
    """A copy of SmolLM2 whose MLP down projections get small noise (a few percent of their
    spread, like a coarse quantizer): KL > 0 and perplexity changes; a random model is far."""
    cand = LLM("smollm2-135m", dtype="float32", device="cpu", verbose=False, max_model_len=512,
               max_num_seqs=1)
    g = torch.Generator().manual_seed(0)
    for layer in cand.engine.model.layers:
        w = layer.mlp.down_proj.weight.data
        w += 0.05 * w.std() * torch.randn(w.shape, generator=g)
    short = [w[:64] for w in windows]
    r = ev.compare(smollm2_llm, cand, short)
    print(r)
    assert r.mean_kl > 0 and r.max_kl >= r.mean_kl
    assert r.ppl_candidate != r.ppl_reference
    assert 0.5 < r.top1_agreement <= 1.0
    # KL per position agrees with the direct definition on one window.
    ref_rows = ev.window_logprobs(smollm2_llm, short[0])
    cand_rows = ev.window_logprobs(cand, short[0])
    direct = (ref_rows.double().exp() * (ref_rows.double() - cand_rows.double())).sum(-1)
    torch.testing.assert_close(ev.kl_divergence(ref_rows, cand_rows), direct)


def test_a_random_model_is_far_from_smollm2(smollm2_llm, tiny_llm, windows):
    r = ev.compare(smollm2_llm, tiny_llm, [windows[0][:32]])
    assert r.mean_kl > 1.0 and r.top1_agreement < 0.2
    assert r.ppl_candidate > 10 * r.ppl_reference and math.isfinite(r.ppl_candidate)
    assert r.weight_bytes < ev.model_bytes(smollm2_llm.engine.model)


def test_window_errors_name_the_field(tiny_folder):
    llm = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
              max_model_len=64, max_num_batched_tokens=16, enable_chunked_prefill=True)
    with pytest.raises(ValueError, match="max_num_batched_tokens=16 is too small"):
        ev.window_logprobs(llm, list(range(1, 33)))
    with pytest.raises(ValueError, match="lengths"):
        ev.compare(llm, llm, [[1, 2, 3], [1, 2]])
    rows = ev.window_logprobs(llm, list(range(1, 17)))   # at the budget: one step, fine
    assert rows.shape[0] == 16


def test_quant_benchmark_table_on_the_tiny_model(tiny_folder):
    """The benchmark's code path end to end (quality, sizes, round-robin decode) on a tiny model;
    a benchmark, not a timing test: only its arithmetic and bookkeeping are checked."""
    from workbench.bench import quant as qb
    r = qb.run(methods=[None, "int8"], kv_dtypes=["auto"], num_windows=1, window_len=32,
               repeats=1, new_tokens=4, model=str(tiny_folder), dtype="bfloat16")
    ref, int8 = r["rows"]
    assert (ref["label"], int8["label"]) == ("bfloat16", "int8")
    assert ref["speedup"] == 1.0 and ref["mean_kl"] == 0.0 and ref["same_greedy_tokens"] == 4
    assert int8["error"] is None and int8["mean_kl"] >= 0 and 0 <= int8["top1_agreement"] <= 1
    assert int8["decode_read_bytes"] < ref["decode_read_bytes"]
    for row in (ref, int8):
        assert row["achieved_gbs"] == pytest.approx(row["bytes_per_token"] * row["decode_tok_s"]
                                                    / 1e9)
    assert "int8" in qb.format_table(r)
    assert qb.parse_method("int4-g32-bf16head") == ("int4", {"group_size": 32,
                                                             "quantize_lm_head": False})
    with pytest.raises(ValueError, match="method='int4-x' is invalid"):
        qb.run(methods=["int4-x"], model=str(tiny_folder))

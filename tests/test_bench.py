"""The benchmark harness itself (not a timing test): on a tiny model it runs both peers, they produce
the same tokens, and the bandwidth arithmetic is the documented formula."""
from workbench.bench import copy_bandwidth, decode_bytes_per_token
from workbench.bench import single_stream


def test_single_stream_runs_both_peers_on_identical_tokens(tiny_folder):
    result = single_stream.run(dtypes=["float32"], repeats=1, new_tokens=16,
                               model=str(tiny_folder))
    d = result["dtypes"]["float32"]
    assert d["same_tokens"]  # the engine and transformers generated the same 16 tokens
    assert d["engine_tok_s"] > 0 and d["transformers_tok_s"] > 0
    assert d["ratio_median"] == d["ratios"][0]
    assert abs(d["achieved_gbs"] - d["bytes_per_token"] * d["engine_decode_tok_s"] / 1e9) < 1e-9
    assert "ratio" in single_stream.format_table(result)


def test_bandwidth_helpers():
    assert copy_bandwidth(size_mib=16, repeats=2) > 0
    assert decode_bytes_per_token(1000, 10, 5) == 1050

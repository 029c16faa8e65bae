"""2:4 weights on sparse tensor cores (compress/semi_structured.py): refused with a reason where
no kernel reads them, converted and exact where one does (the CUDA test runs in scripts/gpu_check.sh
on an Ampere-or-newer GPU)."""
import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.bench.compress import parse_variant
from workbench.compress import semi_structured
from workbench.compress.pruning import PruneConfig, follows_pattern, keep_mask

CUDA_8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def test_the_2_4_check_reads_every_group_of_four():
    w = torch.randn(8, 16)
    assert not follows_pattern(w, "2:4")
    pruned = w * keep_mask(w.abs(), 0.5, (2, 4))
    assert follows_pattern(pruned, "2:4")
    pruned[3, 4:8] = torch.tensor([1.0, 2.0, 3.0, 0.0])             # a group with 3 nonzeros
    assert not follows_pattern(pruned, "2:4")
    assert not follows_pattern(torch.zeros(2, 6), "2:4")       # 6 columns: not groups of 4


@pytest.mark.parametrize("method, options, message", [
    ("magnitude", {"semi_structured": True}, r"read only the 2:4 pattern"),
    ("wanda", {"pattern": "4:8", "semi_structured": True}, r"pattern '4:8'"),
    ("layers", {"semi_structured": True}, r"pruning='layers'"),
    ("magnitude", {"pattern": "2:4", "semi_structured": "yes"}, r"must be True or False"),
])
def test_bad_semi_structured_options_are_named(method, options, message):
    with pytest.raises(ValueError, match=r"pruning_config\['semi_structured'\]=.*" + message):
        PruneConfig.from_args(method, options)


def test_on_a_cpu_the_engine_says_no_kernel_reads_2_4():
    with pytest.raises(ValueError, match=r"semi_structured'\]=True is invalid here: .*engine runs on "
                                         r"cpu; no kernel here reads 2:4 weights on a CPU"):
        LLM(model="random:tiny", device="cpu", pruning="magnitude", verbose=False,
            pruning_config={"pattern": "2:4", "semi_structured": True})
    why = semi_structured.unsupported("cpu", torch.bfloat16)
    assert "compute capability >= 8.0" in why


def test_a_projection_that_is_not_2_4_is_not_converted():
    llm = LLM(model="random:tiny", dtype="float32", verbose=False)
    with pytest.raises(ValueError, match=r"layers.0.self_attn.qkv_proj does not follow the 2:4"):
        semi_structured.to_semi_structured(llm.engine.model)


def test_the_bench_variant_asks_for_the_kernels():
    assert parse_variant("wanda-2:4-semi") == {
        "pruning": "wanda", "pruning_config": {"pattern": "2:4", "semi_structured": True}}
    with pytest.raises(ValueError, match=r"variant='wanda-50%-semi' is invalid"):
        parse_variant("wanda-50%-semi")


@pytest.mark.skipif(not CUDA_8, reason="needs a CUDA GPU with compute capability >= 8.0")
def test_on_cuda_semi_structured_weights_compute_the_dense_2_4_layer():
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    args = dict(model="random:smollm2-135m", device="cuda", dtype="bfloat16", verbose=False,
                max_model_len=256)
    dense = LLM(**args, pruning="magnitude", pruning_config={"pattern": "2:4"})
    sparse = LLM(**args, pruning="magnitude", pruning_config={"pattern": "2:4",
                                                              "semi_structured": True})
    lin_d = dense.engine.model.layers[0].mlp.gate_up_proj
    lin_s = sparse.engine.model.layers[0].mlp.gate_up_proj
    assert isinstance(lin_s.weight, torch.sparse.SparseSemiStructuredTensor)
    assert torch.equal(semi_structured.dense_weight(lin_s.weight), lin_d.weight)
    x = torch.randn(64, lin_d.in_features, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(lin_s(x), lin_d(x), rtol=2e-2, atol=2e-2)
    prompt = [[5, 6, 7, 8, 9, 10, 11, 12]]
    a = dense.generate(prompt, sp)[0].outputs[0].token_ids
    b = sparse.generate(prompt, sp)[0].outputs[0].token_ids
    # bf16 sums in another order can flip a near-tie late; the first tokens must agree
    assert a[:4] == b[:4], (a, b)

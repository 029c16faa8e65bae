"""kernels/cpu's paged decode attention, and attention_backend="cpu" that runs it.

The kernel against attention computed in float64 from the same inputs (fp32: to fp32 rounding;
bf16: within one bf16 step of the exact result, since it sums in fp32 and rounds once), over
scattered block tables, both of its code paths (compiled-in head shapes and the general loop) and
lengths that end mid-block and mid-vector. Then the backend against the plain one on random mixed
batches, and the engine's tokens against the "torch" backend's and transformers'.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from workbench.kernels.cpu import available
from workbench import LLM, SamplingParams
from workbench.attention import AttentionMetadata, get_attention_backend
from workbench.attention.torch_backend import TorchAttention

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable: {WHY}")


def exact_decode(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale):
    """float64 attention of each sequence's one query to its seq_lens[s] cached positions."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for s in range(q.shape[0]):
        pos = torch.arange(int(seq_lens[s]))
        slots = block_tables[s, pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].double().repeat_interleave(group, 1)     # (L, H, D)
        v = v_cache[slots].double().repeat_interleave(group, 1)
        probs = (torch.einsum("hd,lhd->hl", q[s].double(), k) * scale).softmax(-1)
        out[s] = torch.einsum("hl,lhd->hd", probs, v)
    return out


def random_case(num_seqs, heads, kv_heads, dim, block_size, dtype, seed, max_len=70):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 4 * num_seqs * (-(-max_len // block_size))
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    width = -(-max_len // block_size)
    block_tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width]
                                for _ in range(num_seqs)])
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=g)
    seq_lens[0] = 1                                     # a context of one token: itself
    if num_seqs > 1:
        seq_lens[1] = 2 * block_size                    # ends exactly at a block boundary
    q = (3 * torch.randn(num_seqs, heads, dim, generator=g)).to(dtype)   # peaked softmaxes too
    return q, k_cache, v_cache, block_tables, seq_lens


SHAPES = [   # (heads, kv_heads, dim, block_size)
    (9, 3, 64, 16),     # SmolLM2-135M: a compiled-in shape (G=3, D=64)
    (8, 2, 128, 8),     # G=4, D=128: compiled in
    (8, 1, 16, 4),      # G=8, D=16: the general loop
    (4, 2, 32, 16),     # G=2, D=32: the general loop
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-KVH{}-D{}-B{}".format(*s))
def test_paged_decode_matches_float64_attention(shape, dtype):
    heads, kv_heads, dim, block_size = shape
    q, kc, vc, tables, lens = random_case(6, heads, kv_heads, dim, block_size, dtype, seed=dim)
    scale = 1 / math.sqrt(dim)
    out = torch.ops.workbench_cpu.paged_decode(q, kc, vc, tables, lens, block_size, scale)
    assert out.dtype == dtype and out.shape == q.shape
    exact = exact_decode(q, kc, vc, tables, lens, block_size, scale)
    err = (out.double() - exact).abs()
    if dtype == torch.float32:
        assert err.max() < 2e-6, err.max()
    else:   # one bf16 step of |exact| (2^-7 relative at most), plus fp32 sum order near zero
        step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) - 7)
        assert (err <= step + 1e-5).all(), (err / (step + 1e-5)).max()
    # A sequence's result does not depend on the others in the call.
    alone = torch.ops.workbench_cpu.paged_decode(q[2:3], kc, vc, tables[2:3], lens[2:3],
                                                 block_size, scale)
    assert torch.equal(alone, out[2:3])


@pytest.mark.parametrize("num_seqs", [1, 3, 9])
def test_long_bf16_contexts_match_float64_attention(num_seqs):
    """The bf16 row kernel past its prefetch distance (8 tiles of 16 positions) and across block
    boundaries inside a tile (block size 8), with one task per (sequence, kv head) when the
    sequences are fewer than twice the threads and one per sequence otherwise."""
    q, kc, vc, tables, lens = random_case(num_seqs, 9, 3, 64, 8, torch.bfloat16, seed=num_seqs,
                                          max_len=400)
    lens[-1] = 400
    out = torch.ops.workbench_cpu.paged_decode(q, kc, vc, tables, lens, 8, 0.125)
    exact = exact_decode(q, kc, vc, tables, lens, 8, 0.125)
    step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) - 7)
    assert ((out.double() - exact).abs() <= step + 1e-5).all()


def test_bad_input_names_what_is_wrong():
    q, kc, vc, tables, lens = random_case(2, 4, 2, 16, 4, torch.float32, seed=0)
    op = torch.ops.workbench_cpu.paged_decode
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\]=0 must be in \[1, 72\]"):
        op(q, kc, vc, tables, torch.tensor([1, 0]), 4, 0.25)
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\]=73 must be in \[1, 72\]"):
        op(q, kc, vc, tables, torch.tensor([73, 1]), 4, 0.25)
    bad = tables.clone()
    bad[0, 0] = 10_000
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 0\]=10000 is outside the cache"):
        op(q, kc, vc, bad, lens, 4, 0.25)
    with pytest.raises(RuntimeError, match="q and the caches must share a dtype"):
        op(q.bfloat16(), kc, vc, tables, lens, 4, 0.25)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16"):
        op(q[..., :8].contiguous(), kc[..., :8].contiguous(), vc[..., :8].contiguous(),
           tables, lens, 4, 0.25)
    with pytest.raises(RuntimeError, match="must be int64"):
        op(q, kc, vc, tables.int(), lens, 4, 0.25)


def paged_batch(q_lens, ctx_lens, kv_heads, group, dim, block_size, seed):
    """A packed batch over a block pool with each sequence's blocks scattered."""
    g = torch.Generator().manual_seed(seed)
    width = -(-max(ctx_lens) // block_size)
    num_blocks = len(q_lens) * width + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[:len(q_lens) * width].view(len(q_lens), width)
    pos = torch.arange(width * block_size)
    slot_table = (tables[:, pos // block_size] * block_size + pos % block_size)[:, :max(ctx_lens)]
    heads = kv_heads * group
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g)
    total = sum(q_lens)
    q = torch.randn(total, heads, dim, generator=g)
    k, v = (torch.randn(total, kv_heads, dim, generator=g) for _ in range(2))
    mapping = torch.cat([slot_table[i, c - n:c] for i, (n, c) in enumerate(zip(q_lens, ctx_lens))])
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + list(q_lens)).cumsum(0), seq_lens=torch.tensor(ctx_lens),
        slot_mapping=mapping, slot_table=slot_table, max_query_len=max(q_lens),
        max_seq_len=max(ctx_lens), query_lens=list(q_lens), seq_lens_list=list(ctx_lens),
        block_tables=tables, block_size=block_size)
    return q, k, v, k_cache, v_cache, meta


@settings(max_examples=30, deadline=None)
@given(data=st.data(), num_seqs=st.integers(1, 8), group=st.sampled_from([1, 3]),
       seed=st.integers(0, 1000))
def test_backend_matches_the_plain_backend_on_mixed_batches(data, num_seqs, group, seed):
    """Random batches of decodes, prefills and chunks on top of cached blocks: the same output as
    attention_backend="torch" (fp32), decode rows in one kernel call, and no padded group that
    mixes one-query sequences with longer ones."""
    ctx_lens = [data.draw(st.integers(1, 50)) for _ in range(num_seqs)]
    kinds = [data.draw(st.sampled_from(["decode", "decode", "prefill", "chunk"]))
             for _ in range(num_seqs)]
    q_lens = [1 if kind == "decode" or c == 1 else c if kind == "prefill"
              else data.draw(st.integers(2, c)) for kind, c in zip(kinds, ctx_lens)]
    batch = paged_batch(q_lens, ctx_lens, 2, group, 16, 4, seed)
    q, k, v, k_cache, v_cache, meta = batch
    plain, kernel = TorchAttention(), TorchAttention(decode_kernel=True)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    expected = plain.forward(q, k, v, k_expected, v_expected, meta, 0.25)
    meta.plan = None
    out = kernel.forward(q, k, v, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)  # same writes
    decoding = [i for i, n in enumerate(q_lens) if n == 1]
    kernel_groups = [grp for grp in meta.plan if grp.kernel]
    assert len(kernel_groups) == (1 if decoding else 0)
    if decoding:
        assert kernel_groups[0].num_seqs == len(decoding)
        assert kernel_groups[0].seq_lens.tolist() == [ctx_lens[i] for i in decoding]
    for grp in plain.plan(meta) + meta.plan:    # SDPA groups: decodes never padded with prefills
        if not grp.kernel:
            rows = grp.rows.tolist() if grp.rows is not None else list(range(sum(q_lens)))
            starts = meta.query_start_loc.tolist()
            members = {i for i in range(num_seqs) for r in rows if starts[i] <= r < starts[i + 1]}
            assert len({q_lens[i] == 1 for i in members}) <= 1, (q_lens, members)


def test_a_decode_only_step_writes_and_attends_in_one_call():
    """All sequences decoding: the backend's one paged_decode_write call stores each new key and
    value at its slot and gives the plain backend's output; a bad slot is named, nothing read."""
    q, k, v, k_cache, v_cache, meta = paged_batch([1, 1, 1], [5, 17, 1], 2, 3, 16, 4, seed=7)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    expected = TorchAttention().forward(q, k, v, k_expected, v_expected, meta, 0.25)
    meta.plan = None
    with torch.profiler.profile() as prof:
        out = TorchAttention(decode_kernel=True).forward(q, k, v, k_cache, v_cache, meta, 0.25)
    calls = [e.name for e in prof.events()
             if e.name.startswith(("workbench_cpu::", "aten::index_copy"))]
    assert calls == ["workbench_cpu::paged_decode_write"], calls
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    assert torch.equal(k_cache[meta.slot_mapping], k) and torch.equal(v_cache[meta.slot_mapping], v)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    group = meta.plan[0]
    bad = meta.slot_mapping.clone()
    bad[2] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match=rf"slot_mapping\[2\]={k_cache.shape[0]} is outside"):
        torch.ops.workbench_cpu.paged_decode_write(q, k, v, k_cache, v_cache, bad,
                                                   group.block_table, group.seq_lens, 4, 0.25)


def test_backend_is_chosen_by_name_and_validated():
    assert get_attention_backend("cpu", torch.device("cpu")).name == "cpu"
    with pytest.raises(ValueError, match="attention_backend='cpu' is invalid on device 'cuda'"):
        get_attention_backend("cpu", torch.device("cuda"))


PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3,
           "The quick brown fox jumps over the lazy dog. Then", "1 2 3", "Hello"]


def test_engine_tokens_and_logprobs_match_the_torch_backend(tiny_folder):
    """The tiny model in fp32 through chunked prefills, shared prefix blocks, mixed and pure decode
    steps: seeded sampling gives the same tokens, and logprobs agree to fp32 rounding."""
    def run(backend):
        llm = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
                  attention_backend=backend, block_size=4, max_num_batched_tokens=8,
                  enable_prefix_caching=True, max_model_len=128, max_num_seqs=4)
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True,
                                 logprobs=3) for i in range(len(PROMPTS))]
        outs = llm.generate(PROMPTS, params)
        assert llm.engine.backend.name == backend
        assert f"attention={backend}" in llm.describe()
        return outs, llm.engine.trace
    ref, _ = run("torch")
    out, steps = run("cpu")
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)
    assert len(ref) == len(out) == len(PROMPTS)
    for a, b in zip(ref, out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].logprobs) == len(b.outputs[0].logprobs) == 12
        for ra, rb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert ra.keys() == rb.keys()
            for t in ra:
                assert abs(ra[t].logprob - rb[t].logprob) < 1e-4


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_with_the_cpu_backend(smollm2_folder):
    """The real model, fp32, four prompts decoded together (the kernel's batched path): greedy
    tokens identical to transformers' generate()."""
    from conftest import hf_greedy, hf_model
    llm = LLM(model="smollm2-135m", dtype="float32", device="cpu", verbose=False,
              max_model_len=256, attention_backend="cpu")
    prompts = ["The capital of France is", "Here is a list of three fruits:\n1.",
               "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    assert len(outs) == len(prompts)
    hf = hf_model(smollm2_folder)
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, tok.encode(prompt), 32), prompt

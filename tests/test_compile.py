"""compile=True: the forward under torch.compile with attention as an opaque custom operator.

One compilation must serve every step shape (prefill chunks, mixed batches, decode at any batch
size) and give transformers' greedy tokens; compiling must not leak into other engines."""
import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.config import onednn_bf16_prepack_reason
from workbench.models.compile import attention_context

from conftest import hf_greedy, hf_model
from test_paged_equality import NEW, make_prompts


@pytest.fixture(scope="module")
def compiled_tiny(tiny_folder):
    return LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
               max_model_len=128, compile=True, max_num_batched_tokens=16, block_size=4)


def test_compiled_engine_matches_transformers_through_chunks_and_batches(tiny_folder,
                                                                          compiled_tiny):
    prompts = make_prompts(seed=3)
    hf = hf_model(tiny_folder)
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    outputs = compiled_tiny.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    trace = compiled_tiny.trace
    # The steps really had different shapes: chunked prefills of 16 tokens, mixed steps, and
    # pure decode steps at several batch sizes.
    assert max(r.num_prefill_tokens for r in trace) == 16
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in trace)
    assert len({r.num_seqs for r in trace if r.num_prefill_tokens == 0}) >= 2


def test_one_compilation_serves_every_step_shape(compiled_tiny):
    """dynamic=True: the token count is symbolic, so new batch sizes do not recompile."""
    from torch._dynamo.utils import counters
    compiled_tiny.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))  # warm
    before = counters["stats"]["unique_graphs"]
    prompts = [[11 + i] * (3 + 5 * i) for i in range(5)]
    compiled_tiny.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    assert counters["stats"]["unique_graphs"] == before


def test_compiled_and_eager_logits_agree_on_the_real_model(smollm2_llm):
    """SmolLM2 in fp32, compiled: the next-token logits equal the eager engine's to rounding."""
    from conftest import engine_next_token_logits
    compiled = LLM(model="smollm2-135m", dtype="float32", device="cpu", verbose=False,
                   max_model_len=256, compile=True)
    prompt = smollm2_llm.get_tokenizer().encode("The capital of France is")
    eager_logits = engine_next_token_logits(smollm2_llm, prompt)
    compiled_logits = engine_next_token_logits(compiled, prompt)
    assert compiled_logits.argmax() == eager_logits.argmax()
    torch.testing.assert_close(compiled_logits, eager_logits, atol=2e-3, rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=24)
    assert (compiled.generate([prompt], params)[0].outputs[0].token_ids
            == smollm2_llm.generate([prompt], params)[0].outputs[0].token_ids)


def test_attention_operator_outside_a_step_is_a_clear_error():
    q = torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match="outside attention_context"):
        torch.ops.workbench.attention(q, q[:, :1], q[:, :1], 0)
    with attention_context([], None, None, 1.0):
        pass   # the context restores the previous (empty) state on exit
    with pytest.raises(RuntimeError, match="outside attention_context"):
        torch.ops.workbench.attention(q, q[:, :1], q[:, :1], 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_frozen_weights_are_prepacked_and_give_the_same_tokens(tiny_folder, dtype):
    """freeze_weights=True: Inductor's freezing turns every linear layer of the compiled graph
    into oneDNN's linear over a prepacked weight (seen in the profile), tokens unchanged."""
    from torch.profiler import profile
    if dtype == "bfloat16" and onednn_bf16_prepack_reason():   # e.g. AVX2 only: refused, by name
        with pytest.raises(ValueError, match=r"freeze_weights=True is invalid here for bf16: oneDNN"):
            LLM(model=str(tiny_folder), dtype=dtype, device="cpu", verbose=False,
                max_model_len=128, compile=True, freeze_weights=True)
        return
    prompts = make_prompts(seed=7, n=3)
    params = SamplingParams(temperature=0, max_tokens=8)
    ops, tokens = {}, {}
    for freeze in (False, True):
        llm = LLM(model=str(tiny_folder), dtype=dtype, device="cpu", verbose=False,
                  max_model_len=128, compile=True, freeze_weights=freeze)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))   # compile
        with profile() as prof:
            out = llm.generate(prompts, params)
        tokens[freeze] = [o.outputs[0].token_ids for o in out]
        ops[freeze] = {e.key: e.count for e in prof.key_averages()}
    assert tokens[True] == tokens[False]
    assert ops[True].get("mkldnn::_linear_pointwise", 0) > 0
    assert "mkldnn::_linear_pointwise" not in ops[False]


@pytest.mark.skipif(bool(onednn_bf16_prepack_reason()), reason=f"{onednn_bf16_prepack_reason()}")
def test_prepacked_lm_head_gives_the_same_logits(tiny_folder):
    """With frozen weights the runner's LM head is oneDNN's matmul over a prepacked copy of the
    weight: the same fp32 logits as the model's own head, bit for bit, at every row count the
    engine asks for (none, one, a decode batch, a prefill chunk). bf16 only: an fp32 head stays
    on aten. (cpu_gemv=False: the model's own head is then aten's at every row count.)"""
    from workbench.models.compile import PrepackedLMHead
    llm = LLM(model=str(tiny_folder), dtype="bfloat16", device="cpu", cpu_gemv=False,
              verbose=False, max_model_len=64, compile=True, freeze_weights=True)
    runner = llm.engine.runner
    assert isinstance(runner.compute_logits, PrepackedLMHead)
    hidden_size = runner.model.args.hidden_size
    for rows in (0, 1, 7, 37, 300):
        g = torch.Generator().manual_seed(rows)
        hidden = torch.randn(rows, hidden_size, generator=g).bfloat16()
        mine = runner.compute_logits(hidden)
        assert mine.dtype == torch.float32 and mine.shape == (rows, runner.model.args.vocab_size)
        assert torch.equal(mine, runner.model.compute_logits(hidden)), rows
    unfrozen = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
                   max_model_len=64, compile=True)
    assert not isinstance(unfrozen.engine.runner.compute_logits, PrepackedLMHead)


@pytest.mark.parametrize("kwargs, field", [
    ({"compile": "yes"}, "compile='yes'"),
    ({"freeze_weights": True}, "freeze_weights=True is invalid with compile=False"),
    ({"compile": True, "freeze_weights": 1}, "freeze_weights=1 is invalid"),
    ({"compile": True, "tensor_parallel_size": 2}, "compile=True is invalid with parallel workers"),
])
def test_bad_compile_settings_name_the_field(tiny_folder, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False, **kwargs)


@pytest.mark.parametrize("method, config", [("int8", None), ("int4", {"group_size": 32})])
def test_compiled_quantized_engines_give_the_eager_tokens(tiny_folder, method, config):
    """The packed INT8/INT4 kernels inside the compiled graph (INT4 repacks before tracing)."""
    kwargs = dict(model=str(tiny_folder), dtype="bfloat16", device="cpu", verbose=False,
                  quantization=method, quantization_config=config)
    prompts = make_prompts(seed=5, n=3)
    params = SamplingParams(temperature=0, max_tokens=8)
    eager = LLM(**kwargs).generate(prompts, params)
    compiled = LLM(compile=True, **kwargs).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager]


def test_many_compiled_engines_in_one_process(tiny_folder):
    """Each engine compiles its own copy of the forward's code: dynamo keeps at most 8 graphs per
    code object, so engines sharing one would fail (fullgraph=True) once a process had built a
    few of them, and every step would check the guards of every other engine's graphs."""
    params = SamplingParams(temperature=0, max_tokens=3)
    outputs = []
    for _ in range(6):          # 6 engines x 2 graphs (one-token and several-token steps) > 8
        llm = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
                  max_model_len=64, compile=True)
        outputs.append(llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids)
        del llm
    assert all(o == outputs[0] for o in outputs)


def test_the_compiled_forward_checks_only_the_guards_that_choose_a_graph(tiny_folder, monkeypatch):
    """Dynamo's guards on the model object are dropped (thousands of checks before every step,
    models/compile.py says why; TORCH_LOGS=guards lists them); the ones on the inputs and shapes
    stay, so a prefill after decode steps still gets its own graph."""
    from workbench.models import compile as compile_module
    decisions, keep_guards = [], compile_module.keep_guards

    def recording(entries):
        keep = keep_guards(entries)
        decisions.append({(e.guard_type, e.name) for e, k in zip(entries, keep) if k})
        decisions[-1].add(("dropped", sum(not k for k in keep)))
        return keep

    monkeypatch.setattr(compile_module, "keep_guards", recording)
    # fused_decode=False: the 1-token graph exists only when decode steps run the compiled forward
    llm = LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
              max_model_len=64, compile=True, fused_decode=False)
    params = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids     # prefill, decode
    again = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids     # prefill after decode
    assert first == again
    assert len(decisions) == 2                      # the several-token graph and the 1-token one
    for kept in decisions:
        dropped = next(n for t, n in kept if t == "dropped")
        names = {(t, n) for t, n in kept if t != "dropped"}
        assert {("TENSOR_MATCH", "input_ids"), ("TENSOR_MATCH", "positions")} <= names
        assert ("SHAPE_ENV", "") in names and ("GRAD_MODE", "") in names
        assert len(names) <= 8 and dropped > 100    # the model's own guards are the bulk

"""batch_invariant=True: a request's tokens and logprobs are the same alone and inside any batch.

Random batch compositions (other prompts of random lengths, the request at a random place, prompts
longer than a step's token budget so chunks split differently), compared bit for bit with the
request run alone. bf16 is the dtype where this fails without the switch on most machines (the
GEMM picks kernels by row count; padded attention rounds), and fp32 is checked too; both with the
CPU kernels' loops in their row-invariant mode (the default) and on torch's padded GEMM
(cpu_gemv=False)."""
import random

import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.models import make_random_checkpoint
from workbench.models.batch_invariant import MIN_ROWS, make_batch_invariant, rows_that_differ

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


def run(llm, prompts):
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()}
                                      for d in o.outputs[0].logprobs])
            for o in llm.generate(prompts, PARAMS)]


def check_compositions(llm, vocab: int, rounds: int, seed: int):
    rng = random.Random(seed)
    for _ in range(rounds):
        target = [rng.randrange(vocab) for _ in range(rng.randrange(1, 70))]
        others = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 70))]
                  for _ in range(rng.randrange(1, 6))]
        at = rng.randrange(len(others) + 1)
        alone = run(llm, [target])[0]
        together = run(llm, others[:at] + [target] + others[at:])[at]
        # every token with its top-2 logprobs (and the sampled token's, if not among them)
        tokens, logprobs = alone
        assert len(tokens) == len(logprobs) == PARAMS.max_tokens
        assert all(t in d and 2 <= len(d) <= 3 for t, d in zip(tokens, logprobs))
        assert together == alone, (len(target), [len(o) for o in others], at)


@pytest.mark.parametrize("cpu_gemv", [None, False], ids=["loops", "torch"])
@pytest.mark.parametrize("dtype, quantization", [("bfloat16", None), ("float32", None),
                                                 ("auto", None), ("bfloat16", "int8")])
def test_tiny_model_results_do_not_depend_on_the_batch(dtype, quantization, cpu_gemv):
    folder = make_random_checkpoint("tiny", seed=5)
    llm = LLM(model=str(folder), dtype=dtype, device="cpu", verbose=False, max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=32, batch_invariant=True,
              quantization=quantization, cpu_gemv=cpu_gemv)
    check_compositions(llm, 32000, rounds=12, seed=1)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_smollm2_results_do_not_depend_on_the_batch(smollm2_folder, quantization):
    # dtype "auto": bf16 where this CPU has it natively; elsewhere (AVX2) fp32 over bf16 weights
    llm = LLM(device="cpu", verbose=False, max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=48, batch_invariant=True, quantization=quantization)
    check_compositions(llm, 49152, rounds=4, seed=2)


def test_min_rows_covers_the_row_counts_where_this_gemm_changes_its_sums():
    g = torch.Generator().manual_seed(0)     # the weights and rows rows_that_differ measures
    w, x = torch.randn(1536, 576, generator=g), torch.randn(64, 576, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        assert all(m < MIN_ROWS for m in rows_that_differ(dtype)), dtype
        # the padded layer gives row 0 its 64-row value at every row count, those included where
        # the plain GEMM does not
        layer = torch.nn.Linear(576, 1536, bias=False, dtype=dtype)
        layer.weight.data.copy_(w.to(dtype))
        assert make_batch_invariant(layer) == 1
        rows = x.to(dtype)
        full = layer(rows)[0]
        assert [m for m in range(1, 64) if not torch.equal(layer(rows[:m])[0], full)] == [], dtype


def test_batch_invariant_refuses_what_it_cannot_keep():
    with pytest.raises(ValueError, match="fused_decode=True is invalid here: batch_invariant"):
        LLM(dtype="bfloat16", device="cpu", verbose=False, batch_invariant=True, fused_decode=True)
    with pytest.raises(ValueError, match="compile=True is invalid with batch_invariant"):
        LLM(device="cpu", verbose=False, batch_invariant=True, compile=True)
    with pytest.raises(ValueError, match="batch_invariant='yes' is invalid"):
        LLM(device="cpu", verbose=False, batch_invariant="yes")

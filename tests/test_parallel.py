"""Tensor, pipeline and expert parallelism in real worker processes on gloo, against the
single-process engine: greedy outputs token for token, logprobs to fp32 rounding, the
collectives counted exactly, and a killed worker turned into an error instead of a hang."""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.executor.distributed import WorkerDied
from workbench.parallel.moe import MoEMLP
from workbench.parallel.pipeline import bubble_fraction, stage_layers

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
PROMPTS = [[1, 5, 9, 200, 3000], [7, 8, 9], list(range(100, 160)), [42] * 20]


def run(llm, prompts=PROMPTS, params=GREEDY):
    return llm.generate(prompts, params)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_same(got, want):
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):            # the chosen tokens' logprobs, to fp32 rounding
        lg = [lp[t].logprob for lp, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
        lw = [lp[t].logprob for lp, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)]
        assert len(lg) == len(lw) == len(w.outputs[0].token_ids) > 0
        assert lg == pytest.approx(lw, abs=1e-4)


def make(folder, **kw):
    kw = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 64, **kw}
    return LLM(model=str(folder), dtype="float32", device="cpu", verbose=False, **kw)


@pytest.fixture(scope="module")
def tiny_reference(tiny_folder):
    return run(make(tiny_folder))


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                    dict(tensor_parallel_size=2, pipeline_parallel_size=2)],
                         ids=["tp2", "pp2", "tp2xpp2"])
def test_parallel_greedy_is_token_identical(tiny_folder, tiny_reference, layout):
    # max_num_batched_tokens=64 chunks the 60-token prompt together with the others' decodes.
    with make(tiny_folder, **layout) as llm:
        assert_same(run(llm), tiny_reference)
        assert llm.engine.executor.layout.world_size == len(llm.engine.executor.procs)


def test_tensor_parallel_collectives_are_counted_exactly(tiny_folder):
    with make(tiny_folder, tensor_parallel_size=2) as llm:
        llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=3))
        args = llm.engine.model_args
        prefill, decode = llm.trace[0], llm.trace[-1]
        for record, n_tokens in ((prefill, 5), (decode, 1)):
            calls, nbytes, secs = record.comm["all_reduce"]
            # one all-reduce after attention and one after the MLP per layer, one for the embedding
            assert calls == 2 * args.num_hidden_layers + 1
            assert nbytes == calls * n_tokens * args.hidden_size * 4
            assert secs > 0
            # the vocabulary-parallel LM head gathers half the vocabulary from each rank
            assert record.comm["all_gather"][:2] == (1, 1 * args.vocab_size // 2 * 4)
        assert decode.comm_bytes == decode.comm["all_reduce"][1] + decode.comm["all_gather"][1]


def test_pipeline_keeps_micro_batches_in_flight(tiny_folder, tiny_reference):
    with make(tiny_folder, pipeline_parallel_size=2) as llm:
        assert_same(run(llm), tiny_reference)
        overlapped = [r for r in llm.trace if r.num_in_flight == 2]
        assert overlapped, "no step had two micro-batches in the pipeline"
        for r in llm.trace:                   # each boundary sends hidden states and residuals
            n = r.num_tokens
            assert r.comm["send"][:2] == (2, 2 * n * llm.engine.model_args.hidden_size * 4)
            assert len(r.stage_busy_s) == 2


def test_pipeline_with_requests_arriving_between_steps(tiny_folder):
    """Continuous batching across stages: requests join while others are in the pipeline."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 4000) for _ in range(rng.randrange(2, 40))] for _ in range(7)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(2, 12), ignore_eos=True)
              for _ in prompts]
    want = tokens(make(tiny_folder).generate(prompts, params))

    def drive(llm):
        engine, ids, pending = llm.engine, {}, list(range(len(prompts)))
        while pending or engine.has_unfinished_requests():
            for _ in range(rng.randrange(0, 3)):
                if pending:
                    i = pending.pop(0)
                    ids[i] = engine.add_request(prompts[i], params[i])
            engine.step()
        return [engine.pop_output(ids[i]).outputs[0].token_ids for i in range(len(prompts))]

    with make(tiny_folder, pipeline_parallel_size=2) as llm:
        assert drive(llm) == want
        assert llm.stats()["blocks_used"] == 0


def test_swap_preemption_block_copies_reach_the_workers(tiny_folder):
    """A pool too small for all requests: swap-out and swap-in copies run on every shard."""
    kw = dict(num_kv_blocks=8, block_size=4, preemption_mode="swap", max_num_seqs=4)
    prompts = [list(range(10 + i, 20 + i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = tokens(make(tiny_folder, **kw).generate(prompts, params))
    with make(tiny_folder, tensor_parallel_size=2, **kw) as llm:
        assert tokens(llm.generate(prompts, params)) == want
        assert sum(r.blocks_swapped_out for r in llm.trace) > 0


# ---------------------------------------------------------------------- mixture of experts
def test_moe_with_every_expert_active_is_the_dense_mlp(tiny_folder):
    from workbench.models import load_model
    from workbench.models.loader import resolve_checkpoint
    model = load_model(resolve_checkpoint(str(tiny_folder)), torch.float32, torch.device("cpu"))
    mlp = model.layers[0].mlp
    x = torch.randn(37, model.args.hidden_size)
    moe = MoEMLP(mlp, num_experts=4, top_k=4)
    torch.testing.assert_close(moe(x), mlp(x), rtol=1e-5, atol=1e-6)
    assert moe.tokens_per_expert.tolist() == [37] * 4
    top1 = MoEMLP(mlp, num_experts=4, top_k=1)
    y = top1(x)
    assert top1.tokens_per_expert.sum() == 37 and not torch.allclose(y, mlp(x))


def test_expert_parallel_matches_the_single_process_moe(tiny_folder):
    moe = {"num_experts": 4, "top_k": 2}
    want = run(make(tiny_folder, moe_config=moe))
    with make(tiny_folder, moe_config=moe, expert_parallel_size=2) as llm:
        assert_same(run(llm), want)
        calls = llm.trace[0].comm["all_to_all"][0]
        # per MoE layer: counts, token rows, expert ids, results back
        assert calls == 4 * llm.engine.model_args.num_hidden_layers


# ---------------------------------------------------------------------- failures
def test_a_killed_worker_is_an_error_not_a_hang(tiny_folder):
    llm = make(tiny_folder, tensor_parallel_size=2)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    victim = llm.engine.executor.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    result = {}

    def generate():
        try:
            llm.generate([[4, 5, 6]], SamplingParams(max_tokens=4))
        except WorkerDied as err:
            result["error"] = err

    t = threading.Thread(target=generate, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(60)
    assert not t.is_alive(), "generate hung after a worker died"
    assert "worker rank 1" in str(result["error"]) and "exit code -9" in str(result["error"])
    assert time.monotonic() - start < 30
    assert all(not p.is_alive() for p in llm.engine.executor.procs)   # the others were stopped


def test_close_stops_every_worker(tiny_folder):
    llm = make(tiny_folder, pipeline_parallel_size=2)
    procs = llm.engine.executor.procs
    llm.close()
    assert all(not p.is_alive() for p in procs)
    assert all(p.exitcode == 0 for p in procs)      # they left their loop: no kill was needed


@pytest.mark.parametrize("kwargs,words", [
    (dict(model="smollm2-135m", tensor_parallel_size=2),
     ["tensor_parallel_size=2", "num_attention_heads=9", "allowed sizes are 1, 3"]),
    (dict(pipeline_parallel_size=3), ["pipeline_parallel_size=3", "only 2 layers"]),
    (dict(expert_parallel_size=2), ["expert_parallel_size=2", "moe_config"]),
    (dict(moe_config={"num_experts": 3, "top_k": 1}), ["num_experts']=3", "intermediate_size=128"]),
    (dict(moe_config={"num_experts": 4, "top_k": 5}), ["top_k']=5", "num_experts=4"]),
    (dict(moe_config={"experts": 4}), ["moe_config=", "'num_experts' and 'top_k'"]),
    (dict(tensor_parallel_size=0), ["tensor_parallel_size=0", ">= 1"]),
    (dict(tensor_parallel_size=2, speculative_config={"method": "ngram",
                                                      "num_speculative_tokens": 2}),
     ["speculative_config", "parallel workers"]),
    (dict(tensor_parallel_size=2, quantization="int8"), ["quantization='int8'", "parallel"]),
])
def test_bad_parallel_configs_are_named_before_any_process_starts(tiny_folder, kwargs, words):
    kwargs = {"model": str(tiny_folder), **kwargs}
    with pytest.raises(ValueError) as err:
        LLM(dtype="float32", device="cpu", verbose=False, **kwargs)
    for w in words:
        assert w in str(err.value)


def test_stage_layers_and_bubble():
    assert stage_layers(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert stage_layers(2, 2) == [range(0, 1), range(1, 2)]
    assert bubble_fraction(1, 5) == 0
    assert bubble_fraction(4, 1) == pytest.approx(3 / 4)
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)


def test_torchrun_launch_gives_the_single_process_text(tiny_folder):
    """The real launcher: torchrun starts both ranks, rank 0 drives, rank 1 serves."""
    import subprocess
    import sys
    prompt = "The capital of France is"
    want = make(tiny_folder).generate(prompt, SamplingParams(temperature=0, max_tokens=8,
                                                             ignore_eos=True))[0].outputs[0].text
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "workbench", "generate", prompt, "--model", str(tiny_folder), "-tp", "2",
           "--dtype", "float32", "--device", "cpu", "--max-tokens", "8", "--ignore-eos"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    described, text = done.stdout.split("\n", 1)
    assert "2 workers (tp=2)" in described
    assert text == want


def test_pipeline_schedulers_share_a_tight_pool_without_cutting_requests(tiny_folder):
    """Two micro-batch schedulers over a pool that holds about two of the requests at once:
    they preempt their own sequences and wait for each other's, and every request still gets
    all its tokens (none is ended for 'length' because the *other* scheduler held the blocks)."""
    prompts = [list(range(20 + i, 44 + i)) for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = tokens(make(tiny_folder).generate(prompts, params))
    with make(tiny_folder, pipeline_parallel_size=2, num_kv_blocks=12, block_size=4) as llm:
        out = llm.generate(prompts, params)
        assert tokens(out) == want
        assert all(len(t) == 16 for t in tokens(out))
        assert sum(r.num_preempted for r in llm.trace) > 0


def test_workers_exit_when_the_driver_process_is_killed(tiny_folder):
    """A kernel restart kills the driver without running any cleanup: the workers notice that
    their parent is gone and exit on their own."""
    import subprocess
    import sys
    script = (f"from workbench import LLM\n"
              f"llm = LLM(model={str(tiny_folder)!r}, dtype='float32', device='cpu', verbose=False,"
              f" tensor_parallel_size=2)\n"
              f"print(' '.join(str(p.pid) for p in llm.engine.executor.procs), flush=True)\n"
              f"import time; time.sleep(600)\n")
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2
        driver.kill()
        driver.wait(10)
        deadline = time.monotonic() + 20
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [p for p in alive if _running(p)]
        assert not alive, f"workers {alive} outlived their driver"
    finally:
        driver.kill()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"     # a zombie has exited
    except FileNotFoundError:
        return False


def test_aborting_a_request_whose_batch_is_in_the_pipeline(tiny_folder):
    prompts = [list(range(30 + 7 * i, 45 + 7 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = tokens(make(tiny_folder).generate(prompts, params))
    with make(tiny_folder, pipeline_parallel_size=2) as llm:
        engine = llm.engine
        ids = [engine.add_request(p, params) for p in prompts]
        engine.step()                         # both micro-batches posted, the first collected
        in_flight = {s.request_id for f in engine._in_flight for s in f.batch.seqs}
        victim = sorted(in_flight)[0]
        engine.abort_request(victim)
        while engine.has_unfinished_requests():
            engine.step()
        for i, r in enumerate(ids):
            if r != victim:
                assert engine.pop_output(r).outputs[0].token_ids == want[i]
        assert engine.get_sequence(victim) is None
        assert llm.stats()["blocks_used"] == 0


def test_a_script_without_a_main_guard_is_told_what_to_write(tiny_folder, tmp_path):
    """Spawned workers import the script that started them; at top level it would start workers
    again. Both the worker and the driver say what to write instead of multiprocessing's error."""
    import subprocess
    import sys
    script = tmp_path / "noguard.py"
    script.write_text(f"from workbench import LLM\n"
                      f"llm = LLM(model={str(tiny_folder)!r}, dtype='float32', device='cpu', "
                      f"verbose=False, tensor_parallel_size=2)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr
    assert "importing the script that started it" in done.stderr      # the worker's own error
    assert "bootstrapping phase" not in done.stderr

